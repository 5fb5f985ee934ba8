// The optimizer step of a streamed device's host masters beside the next forward
// (Device::host_step). With offload the step runs on the host and reads every master, its
// gradient and its optimizer state once: for a model of billions of parameters, about as long
// as a forward. The forward after it needs a block's parameters only when it reaches that
// block, so the step goes in the same order on a thread of its own and the forward waits for
// each block's unit before fetching it: the step overlaps the forward, and the values are the
// ones a step before the forward gives.
//
//   Step       -> StartHostStep: the parameters uploaded whole (unit 0), then the parameters
//                 kept on the device (Device::kept) posted to its worker and the thread, at
//                 once (the optimizer is split in two: Device::optimizer_parts)
//   Forward    -> Upload (unit 0 is done), Fetch(k) -> AwaitStepped(k), Prefetch(k) only once
//                 Stepped(k); at the forward's end SettleHostSteps joins the thread
//   anything else reading or writing the masters, gradients or optimizer state
//              -> SettleHostSteps first (PipelineEngine's methods)
//   ZeroGrad   -> DeferZeroGrad while the thread runs: done at its end
//
// A unit is stepped by the device's optimizer with only that unit's gradients in place: every
// kind skips a parameter without a gradient, as torch.optim does, and updates each parameter
// from its own gradient and state only (optim/optimizer.h), so stepping unit by unit gives what
// one step of all of them gives, to the bit. Where a parameter streams in a narrower dtype
// (Device::low_dtype), its cast for the upload is made on the thread too, right after its
// update, while the master is still in the cache.
#include <chrono>
#include <string>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/runtime/pipeline_engine_impl.h"

namespace rannc {

using pipeline_internal::Device;

bool PipelineEngine::Impl::StepsBesideForward(const Device& d) const {
  if (!offload_ || !d.local || !d.optimizer || d.host.empty()) return false;
  if (!d.kept.empty()) return true;
  for (const std::vector<int>& block : d.streamed) {
    if (!block.empty()) return true;
  }
  return false;
}

absl::Status PipelineEngine::Impl::StartHostStep(Device& d,
                                                 const std::vector<HyperParams>& hypers) {
  auto step = std::make_unique<Device::HostStep>();
  step->started = std::chrono::steady_clock::now();
  step->hypers = hypers;
  step->units.emplace_back();
  for (int li : stages_[d.stage].params) {
    if (d.host[li].defined() && !d.Streamed(li)) step->units[0].push_back(li);
    if (d.host[li].defined()) step->bytes += d.host[li].nbytes();
  }
  for (const std::vector<int>& block : d.streamed) step->units.push_back(block);
  // The thread holds every gradient until its end; each unit's go back to their masters only
  // while the unit steps.
  step->grads.assign(d.lifted.size(), at::Tensor());
  for (int li : stages_[d.stage].params) {
    if (!d.host[li].defined() || !d.host[li].grad().defined()) continue;
    step->grads[li] = d.host[li].grad();
    d.host[li].mutable_grad().reset();
  }
  d.host_step = std::move(step);
  Device::HostStep& s = *d.host_step;
  absl::Status first = StepUnit(d, 0);
  if (!first.ok()) {
    // The optimizer checks its arguments before it updates anything: nothing was stepped.
    for (size_t li = 0; li < s.grads.size(); ++li) {
      if (s.grads[li].defined()) d.host[li].mutable_grad() = s.grads[li];
    }
    d.host_step.reset();
    return first;
  }
  s.done = 1;
  // The same hyper-parameters passed unit 0's checks: the kept parameters' step fails only as
  // LibTorch may fail (out of memory), which the thread reports with the rest.
  if (!d.kept.empty()) StepKept(d);
  s.thread = std::thread([this, &d, kept = s.kept] {
    Device::HostStep& s = *d.host_step;
    const auto thread_start = std::chrono::steady_clock::now();
    absl::Status status = absl::OkStatus();
    for (int u = 1; u < static_cast<int>(s.units.size()); ++u) {
      if (before_host_step_unit_) before_host_step_unit_(d.index, u);
      status = StepUnit(d, u);
      if (!status.ok()) break;
      std::lock_guard<std::mutex> lock(s.mu);
      s.done = u + 1;
      s.cv.notify_all();
    }
    if (kept.valid()) {  // whatever the units did: the worker's step reads the HostStep
      const absl::Status stepped = kept.get();
      if (status.ok()) status = stepped;
    }
    std::lock_guard<std::mutex> lock(s.mu);
    // The gradients back, as after any step, unless ZeroGrad came meanwhile (as it does: a
    // training loop's zero_grad precedes the next forward); zeros are freed and marked as
    // ZeroGrad(false) marks them.
    for (size_t li = 0; li < s.grads.size(); ++li) {
      if (!s.grads[li].defined()) continue;
      if (!s.zero_grad) {
        d.host[li].mutable_grad() = s.grads[li];
      } else if (!*s.zero_grad) {
        d.zeroed.insert(static_cast<int>(li));
      }
    }
    s.grads.clear();
    s.status = status;
    s.thread_s = SecondsSince(thread_start);
    s.finished = true;
    s.cv.notify_all();
  });
  return absl::OkStatus();
}

void PipelineEngine::Impl::StepKept(Device& d) {
  // On the worker, whose allocations (the state's, at the first step) count as the device's,
  // behind the backward's last work and ahead of the next forward's, which reads these first.
  // The host step's thread waits for it before it finishes: the HostStep outlives it.
  Device::HostStep& s = *d.host_step;
  s.kept = d.worker
               ->Post([this, &d, &s] {
                 if (before_host_step_unit_) before_host_step_unit_(d.index, -1);
                 return TorchCall(absl::StatusCode::kInternal, "optimizer step on the device",
                                  [&] { return d.optimizer_parts->StepPart(0, s.hypers); });
               })
               .share();
}

void PipelineEngine::Impl::AwaitKeptStep(const Device& d) {
  if (d.host_step && d.host_step->kept.valid()) d.host_step->kept.wait();
}

int64_t PipelineEngine::Impl::KeptStateBytes(const Device& d) {
  return d.optimizer_parts ? d.optimizer_parts->PartStateBytes(0) : 0;
}

absl::Status PipelineEngine::Impl::StepUnit(Device& d, int u) {
  Device::HostStep& s = *d.host_step;
  const std::vector<int>& unit = s.units[u];
  for (int li : unit) {
    if (s.grads[li].defined()) d.host[li].mutable_grad() = s.grads[li];
  }
  // Part 1 of a split optimizer: part 0, the kept parameters, steps on the worker meanwhile.
  absl::Status stepped = TorchCall(absl::StatusCode::kInternal, "optimizer step", [&] {
    return d.optimizer_parts ? d.optimizer_parts->StepPart(1, s.hypers)
                             : d.optimizer->Step(s.hypers);
  });
  for (int li : unit) d.host[li].mutable_grad().reset();
  if (!stepped.ok()) return stepped;
  return TorchCall(absl::StatusCode::kInternal, "casting stepped parameters for upload", [&] {
    at::NoGradGuard no_grad;
    for (int li : unit) {
      if (d.Low(li)) UploadSource(d, li);
    }
    return absl::OkStatus();
  });
}

bool PipelineEngine::Impl::Stepped(Device& d, int block) {
  if (!d.host_step) return true;
  Device::HostStep& s = *d.host_step;
  std::lock_guard<std::mutex> lock(s.mu);
  return s.done >= block + 2 || s.finished;
}

absl::Status PipelineEngine::Impl::AwaitStepped(Device& d, int block) {
  if (!d.host_step) return absl::OkStatus();
  Device::HostStep& s = *d.host_step;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.done < block + 2 && !s.finished) {
    const auto start = std::chrono::steady_clock::now();
    s.cv.wait(lock, [&] { return s.done >= block + 2 || s.finished; });
    s.waited_s += SecondsSince(start);
  }
  if (s.done >= block + 2) return absl::OkStatus();
  return Annotate(s.status, "the optimizer step before this forward");
}

void PipelineEngine::Impl::AwaitHostStepEnd(Device& d) {
  if (!d.host_step) return;
  Device::HostStep& s = *d.host_step;
  std::unique_lock<std::mutex> lock(s.mu);
  s.cv.wait(lock, [&] { return s.finished; });
}

bool PipelineEngine::Impl::DeferZeroGrad(Device& d, bool set_to_none) {
  if (!d.host_step) return false;
  Device::HostStep& s = *d.host_step;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.finished) return false;
  // zero_grad(False) then zero_grad(True) leaves none, and so does the reverse.
  s.zero_grad = set_to_none || s.zero_grad.value_or(false);
  return true;
}

absl::Status PipelineEngine::Impl::SettleHostSteps() {
  absl::Status first = std::exchange(host_step_failure_, absl::OkStatus());
  for (Device& d : devices_) {
    if (!d.host_step) continue;
    if (d.host_step->thread.joinable()) d.host_step->thread.join();
    const Device::HostStep& s = *d.host_step;
    spdlog::debug("device {}: the host optimizer step of {:.2f} GB of masters in {} units took "
                  "{:.3f} s on its thread ({:.3f} s to Settle since Step); the forward waited "
                  "{:.3f} s for it",
                  d.index, s.bytes / 1e9, s.units.size(), s.thread_s, SecondsSince(s.started),
                  s.waited_s);
    if (first.ok() && !d.host_step->status.ok()) {
      first = Annotate(d.host_step->status, "the last optimizer step");
    }
    d.host_step.reset();
  }
  return first;
}

void PipelineEngine::Impl::SettleHostStepsKeepingFailure() {
  absl::Status failed = SettleHostSteps();
  if (!failed.ok()) host_step_failure_ = failed;
}

}  // namespace rannc
