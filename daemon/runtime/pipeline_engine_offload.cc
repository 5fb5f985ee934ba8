// Parameter offload in the pipeline engine (EngineOptions::offload). A device's parameters live
// in host memory between steps (Device::host: value, accumulated gradient, the optimizer's
// parameter and so its state; with ZeRO, the replica's host shard instead); the device holds
// them only during a step:
//  - Upload, at the start of the device's part of a step, copies them into the executor's
//    handles (ZeRO: all-gathers the replicas' shards into the flat buffer they are slices of).
//    A stage after the first uploads while the stages before it compute its first inputs, so
//    there the upload overlaps the pipeline's fill.
//  - After the step's backward and gradient reduction, its gradients go to the host masters
//    (ZeRO: the reduce-scattered shard) and Release frees the device copies.
//  - The optimizer steps the host masters, off the devices' workers.
// A forward whose graphs a later backward needs keeps the copies until that backward.
// Buffers and frozen parameters stay on the device.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "daemon/runtime/pipeline_engine_impl.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {

using pipeline_internal::Device;
using pipeline_internal::ZeroPartition;

namespace {

// t.set_(source) on a leaf between steps (no graph uses it). Autograd then drops the leaf's
// gradient accumulator, shaped as the leaf was, so the GradReducer must Rebind.
void SwapStorage(at::Tensor& t, const at::Tensor& source) {
  at::NoGradGuard no_grad;
  t.set_(source);
}

}  // namespace

void PipelineEngine::Impl::SetUpOffload(Device& d) {
  // Init left the stage's parameters in host memory; on a CUDA device they are pinned, so that
  // uploads are DMA copies.
  d.host.assign(d.lifted.size(), at::Tensor());
  for (int li : stages_[d.stage].params) {
    d.host[li] = d.lifted[li];
    if (d.place.is_cuda()) {
      d.host[li] = d.host[li].detach().pin_memory().requires_grad_(d.lifted[li].requires_grad());
    }
    d.lifted[li] = at::empty({0}, d.On(d.host[li].scalar_type())).requires_grad_(true);
  }
  d.resident = false;
}

absl::Status PipelineEngine::Impl::Upload(Device& d) {
  if (d.resident) return absl::OkStatus();
  at::NoGradGuard no_grad;
  for (int li : stages_[d.stage].params) {
    if (!d.host[li].defined()) continue;
    const at::Tensor& master = d.host[li];
    SwapStorage(d.lifted[li], master.detach().to(d.place, master.scalar_type(),
                                                 /*non_blocking=*/false, /*copy=*/true));
  }
  const int64_t R = static_cast<int64_t>(stages_[d.stage].devices.size());
  for (ZeroPartition& part : d.zero) {
    part.flat = at::empty({part.len * R}, d.On(part.shard.scalar_type()));
    const at::Tensor shard = d.Here(part.shard.detach());
    absl::StatusOr<comm::Buffer> mine = BufferOf(shard);
    if (!mine.ok()) return mine.status();
    absl::StatusOr<comm::Buffer> all = BufferOf(part.flat);
    if (!all.ok()) return all.status();
    absl::Status s = Wait(d, d.replicas->AllGather(*mine, *all), part.flat,
                          "all-gathering offloaded ZeRO parameters");
    if (!s.ok()) return s;
    for (size_t i = 0; i < part.params.size(); ++i) {
      const std::vector<int64_t>& shape = lifted_shapes_[part.params[i]];
      int64_t numel = 1;
      for (int64_t n : shape) numel *= n;
      SwapStorage(d.lifted[part.params[i]], part.flat.narrow(0, part.offsets[i], numel).view(shape));
    }
  }
  d.resident = true;
  for (GradReducer* r : {d.reducer.get(), d.zero_reducer.get()}) {
    if (r == nullptr) continue;
    absl::Status s = r->Rebind();
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::Release(Device& d) {
  if (!d.resident) return;
  at::NoGradGuard no_grad;
  for (int li : stages_[d.stage].params) {
    at::Tensor& t = d.lifted[li];
    t.mutable_grad().reset();
    SwapStorage(t, at::empty({0}, t.options()));
  }
  for (ZeroPartition& part : d.zero) part.flat.reset();
  d.resident = false;
}

absl::Status PipelineEngine::Impl::ReduceOffloaded(Device& d, bool keep_resident) {
  absl::Status s = Upload(d);
  if (s.ok()) {
    at::NoGradGuard no_grad;
    const std::vector<int>& params = stages_[d.stage].params;
    for (int li : params) {
      if (d.host[li].defined() && d.host[li].grad().defined()) {
        const at::Tensor& g = d.host[li].grad();
        d.lifted[li].mutable_grad() =
            g.detach().to(d.place, g.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
    // Nothing runs a backward: Finish takes every gradient as it stands.
    if (d.reducer) d.reducer->BeginFinalBackward();
    s = ReduceGrads(d);
    for (int li : params) {
      if (!d.host[li].defined()) continue;
      if (s.ok() && d.lifted[li].grad().defined()) {
        d.host[li].mutable_grad() = ToHost(d.lifted[li].grad());
      }
      d.lifted[li].mutable_grad().reset();
    }
  }
  if (!keep_resident || !s.ok()) Release(d);
  return s;
}

at::Tensor PipelineEngine::Impl::ToHost(const at::Tensor& t) {
  return t.device().is_cpu() ? t : t.to(at::kCPU);
}

at::Tensor PipelineEngine::Impl::HostCopy(const at::Tensor& t) {
  if (t.device().is_cpu()) return t.clone();
  // Into page-locked memory: the copy runs at the link's speed (pageable memory goes through a
  // bounce buffer and is faulted in page by page, ~1 GB/s), and LibTorch's caching host
  // allocator hands the same pages out again at the next read of the model (a checkpoint every
  // few steps), so they are pinned once.
  at::Tensor host = PinnedLike(t);
  if (!host.defined()) return t.to(at::kCPU);  // no page-locked memory to be had: pageable
  host.copy_(t);
  return host;
}

at::Tensor PipelineEngine::Impl::PinnedLike(const at::Tensor& t) {
  try {
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  } catch (const c10::Error&) {
    return at::Tensor();
  }
}

}  // namespace rannc
