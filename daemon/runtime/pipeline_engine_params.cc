// The engine's parameters, gradients and optimizers between steps (see pipeline_engine.h):
// reads and writes of the lifted tensors by name or index, gradient accumulation from outside,
// zeroing, norms and clipping, the per-device optimizers and their state, the loss scaler's
// overflow check, each device's held bytes, and the asynchronous reads of checkpoints. Called on
// the engine's calling thread between steps; OnEveryDevice runs the parts that need the devices
// on their workers.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/optim/grad_norm.h"
#include "daemon/runtime/pipeline_engine_impl.h"
#include "daemon/runtime/pinned_arena.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {

using pipeline_internal::Device;

absl::StatusOr<const at::Tensor*> PipelineEngine::Impl::Find(const std::string& name,
                                                             int device) const {
  for (size_t li = 0; li < ir_->tensor_names.size(); ++li) {
    if (ir_->tensor_names[li] != name) continue;
    if (device >= 0) {
      const Device* d = DeviceAt(device);
      if (d != nullptr && d->lifted[li].defined()) return &d->Master(li);
      break;
    }
    if (owner_[li] >= 0) return &devices_[owner_[li]].Master(li);
  }
  return absl::NotFoundError(absl::StrCat("no stage", device >= 0 ? " on that device" : "",
                                          " holds a tensor named ", name));
}

void PipelineEngine::Impl::SetParam(int lifted, const at::Tensor& value) {
  WaitForAsyncReads();
  at::NoGradGuard no_grad;
  auto slot = zero_slots_.find(lifted);
  for (Device& d : devices_) {
    if (!d.lifted[lifted].defined()) continue;
    if (offload_ && slot != zero_slots_.end()) {
      // The master is the replicas' shards: each gets its slice.
      const at::Tensor flat = value.reshape(-1);
      pipeline_internal::ZeroPartition& part = d.zero[slot->second.partition];
      ForShardSlice(part, slot->second.index, [&](int64_t shard_from, int64_t from, int64_t n) {
        part.shard.narrow(0, shard_from, n).copy_(flat.narrow(0, from, n));
      });
      if (d.resident) d.lifted[lifted].copy_(value);
      continue;
    }
    d.Master(lifted).copy_(value);
    if (d.Low(lifted)) d.low_fresh[lifted] = 0;  // its narrower copy is cast again
    // A streamed parameter's block not on the device now fetches the new value when it runs.
    if (!d.host.empty() && d.host[lifted].defined() && d.resident &&
        d.lifted[lifted].storage().nbytes() > 0) {
      d.lifted[lifted].copy_(value);
    }
  }
}

at::Tensor PipelineEngine::Impl::ParamValue(int lifted, int device) const {
  const Device* d = nullptr;
  if (device < 0) {
    if (owner_[lifted] >= 0) d = &devices_[owner_[lifted]];
  } else {
    d = DeviceAt(device);
  }
  if (d == nullptr || !d->lifted[lifted].defined()) return at::Tensor();
  if (offload_ && sharded(lifted)) return ShardedValue(lifted);
  return ReadCopy(d->Master(lifted).detach());
}

void PipelineEngine::Impl::AddGrad(int lifted, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  if (auto slot = zero_slots_.find(lifted); slot != zero_slots_.end()) {
    const at::Tensor flat = grad.reshape(-1);
    for (Device& d : devices_) {
      if (!d.local || d.stage != slot->second.stage) continue;
      pipeline_internal::ZeroPartition& part = d.zero[slot->second.partition];
      ForShardSlice(part, slot->second.index, [&](int64_t shard_from, int64_t from, int64_t n) {
        at::Tensor& g = part.shard.mutable_grad();
        if (!g.defined()) g = at::zeros_like(part.shard);
        g.narrow(0, shard_from, n).add_(flat.narrow(0, from, n).to(g.options()));
      });
    }
    return;
  }
  for (Device& d : devices_) {
    if (!d.lifted[lifted].defined()) continue;
    at::Tensor& p = d.Master(lifted);
    if (!p.requires_grad()) continue;
    if (pending_ && d.world_rank != primary_[lifted]) continue;
    if (p.grad().defined()) {
      p.mutable_grad().add_(grad.to(p.options()));
    } else {
      p.mutable_grad() = grad.to(p.options(), /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

void PipelineEngine::Impl::AddGradShare(int lifted, const at::Tensor& grad) {
  // A ZeRO gradient is never pending (reduce-scattered after every backward): it was read whole.
  if (sharded(lifted)) return AddGrad(lifted, grad);
  BeginLocalGrads();
  if (owner_[lifted] < 0) return;
  at::Tensor& p = devices_[owner_[lifted]].Master(lifted);
  if (!p.requires_grad()) return;
  at::NoGradGuard no_grad;
  if (p.grad().defined()) {
    p.mutable_grad().add_(grad.to(p.options()));
  } else {
    p.mutable_grad() = grad.to(p.options(), /*non_blocking=*/false, /*copy=*/true);
  }
}

at::Tensor PipelineEngine::Impl::GradCopy(int lifted, const at::Tensor& t) const {
  if (sharded(lifted)) return FullGrad(lifted);  // never pending; every replica's slice
  at::Tensor sum;
  if (!pending_) {
    if (t.grad().defined()) sum = HostCopy(t.grad().detach());
  } else {
    at::NoGradGuard no_grad;
    for (const Device& d : devices_) {
      if (!d.local || !d.lifted[lifted].defined()) continue;
      const at::Tensor& g = d.Master(lifted).grad();
      if (!g.defined()) continue;
      sum = sum.defined() ? sum.add_(ToHost(g)) : HostCopy(g.detach());
    }
  }
  if (!sum.defined() && owner_[lifted] >= 0 && devices_[owner_[lifted]].zeroed.count(lifted)) {
    return at::zeros(lifted_shapes_[lifted], at::TensorOptions().dtype(lifted_types_[lifted]));
  }
  return sum;
}

absl::Status PipelineEngine::Impl::CheckReduced(const char* what) const {
  if (!pending_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": the gradients of delayed backwards (delay_grad_allreduce) are not all-reduced "
      "yet; call allreduce_grads() first"));
}

void PipelineEngine::Impl::ZeroGrad(bool set_to_none) {
  for (Device& d : devices_) {
    for (pipeline_internal::ZeroPartition& part : d.zero) {
      if (!part.shard.grad().defined()) continue;
      if (set_to_none) {
        part.shard.mutable_grad().reset();
      } else {
        part.shard.mutable_grad().zero_();
      }
    }
    // The masters' gradients belong to an optimizer step still running: it drops them at its end.
    // The kept parameters' step, on the worker, reads theirs: it ends first.
    const bool deferred = DeferZeroGrad(d, set_to_none);
    AwaitKeptStep(d);
    // Which gradients are zeros the step's thread marks too (at its end, under its lock): the
    // parameters kept on the device have theirs here meanwhile.
    std::unique_lock<std::mutex> marking;
    if (d.host_step) marking = std::unique_lock<std::mutex>(d.host_step->mu);
    if (set_to_none && !deferred) d.zeroed.clear();
    for (std::vector<at::Tensor>* tensors : {&d.lifted, &d.host}) {
      if (deferred && tensors == &d.host) continue;
      for (size_t li = 0; li < tensors->size(); ++li) {
        at::Tensor& t = (*tensors)[li];
        if (!t.defined() || !t.grad().defined()) continue;
        // Zeros are freed too (Device::zeroed says where they are).
        if (!set_to_none) d.zeroed.insert(static_cast<int>(li));
        t.mutable_grad().reset();
      }
    }
  }
  // Every holder's gradient is now zero (or none): nothing is left to reduce.
  pending_ = false;
}

absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> PipelineEngine::Impl::GradNorms(
    const std::vector<int>& params, double norm_type) const {
  absl::Status reduced = CheckReduced("clip_grad_norm");
  if (!reduced.ok()) return reduced;
  // Each parameter's gradient counted once, its owner's.
  std::vector<std::pair<int, at::Tensor>> norms;
  for (int li : params) {
    const at::Tensor g = FullGrad(li);
    if (g.defined()) norms.emplace_back(li, ToHost(GradNorm(g, norm_type)));
  }
  return norms;
}

void PipelineEngine::Impl::ScaleGrads(const std::vector<int>& params,
                                      const at::Tensor& coefficient) {
  at::NoGradGuard no_grad;
  const std::set<int> selected(params.begin(), params.end());
  for (Device& d : devices_) {
    for (int li : selected) {
      if (!d.lifted[li].defined()) continue;
      at::Tensor& p = d.Master(li);
      if (p.grad().defined()) p.grad().mul_(coefficient);
    }
    for (const pipeline_internal::ZeroPartition& part : d.zero) {
      const at::Tensor& g = part.shard.grad();
      if (!g.defined()) continue;
      for (size_t i = 0; i < part.params.size(); ++i) {
        if (!selected.count(part.params[i])) continue;
        ForShardSlice(part, i, [&](int64_t shard_from, int64_t, int64_t n) {
          g.narrow(0, shard_from, n).mul_(coefficient);
        });
      }
    }
  }
}

absl::Status PipelineEngine::Impl::SetOptimizer(OptimizerKind kind,
                                                const std::vector<std::vector<int>>& groups,
                                                const std::vector<HyperParams>& hypers,
                                                std::shared_ptr<const ScriptedUpdate> scripted) {
  const std::set<int> tied(tied_.begin(), tied_.end());
  for (Device& d : devices_) {
    // ZeRO shards the untied parameters of a stage with replicas (SetUpZero).
    const bool shard = zero_ && d.local && d.replicas != nullptr;
    if (shard && offload_ && !d.zero.empty()) {
      // The shards are the masters now; laying them out again would need them gathered first.
      return absl::FailedPreconditionError(
          "with zero and offload, an engine's optimizer is set once");
    }
    std::vector<ParamGroup> device_groups(groups.size());
    std::vector<std::vector<int>> ids(groups.size());  // per group: lifted index, or -1 - k
    for (size_t g = 0; g < groups.size(); ++g) {
      device_groups[g].hyper = g < hypers.size() ? hypers[g] : DefaultHyperParams(kind);
      for (int li : groups[g]) {
        if (li < 0 || li >= static_cast<int>(d.lifted.size())) {
          return absl::InvalidArgumentError(absl::StrCat("no lifted tensor ", li));
        }
        if (!d.lifted[li].defined()) continue;
        const at::Tensor& p = d.Master(li);
        if (!p.requires_grad() || (shard && !tied.count(li))) continue;
        device_groups[g].params.push_back(p);
        ids[g].push_back(li);
      }
    }
    if (shard) {
      absl::Status s = SetUpZero(d, groups, &device_groups, &ids);
      if (!s.ok()) return Annotate(s, absl::StrCat("device ", d.index));
    }
    d.optimizer_parts = nullptr;
    if (d.kept.empty()) {
      absl::StatusOr<std::unique_ptr<Optimizer>> opt =
          MakeOptimizer(kind, std::move(device_groups), scripted);
      if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("device ", d.index));
      d.optimizer = std::move(*opt);
    } else {
      // The kept parameters (part 0) step on the worker while the host's masters step on a
      // thread (pipeline_engine_host_step.cc): two optimizers, seen as one.
      std::vector<std::vector<int>> part_of(ids.size());
      for (size_t g = 0; g < ids.size(); ++g) {
        for (int li : ids[g]) part_of[g].push_back(li >= 0 && d.kept.count(li) ? 0 : 1);
      }
      absl::StatusOr<std::unique_ptr<SplitOptimizer>> opt =
          SplitOptimizer::Make(kind, std::move(device_groups), part_of, 2, scripted);
      if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("device ", d.index));
      d.optimizer_parts = opt->get();
      d.optimizer = std::move(*opt);
    }
    d.optimizer_params.clear();
    for (const std::vector<int>& group : ids) {
      d.optimizer_params.insert(d.optimizer_params.end(), group.begin(), group.end());
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::Step(const std::vector<HyperParams>& hypers) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  for (const Device& d : devices_) {
    if (!d.optimizer) return absl::FailedPreconditionError("the engine has no optimizer");
  }
  absl::Status reduced = CheckReduced("optimizer step");
  if (!reduced.ok()) return reduced;
  if (scaler_.enabled()) {
    absl::StatusOr<bool> found_inf = FoundInf();
    if (!found_inf.ok()) return found_inf.status();
    if (*found_inf) {
      scaler_.Update(true);
      return absl::OkStatus();
    }
    absl::Status stepped = OptimizerStep(hypers);
    if (stepped.ok()) scaler_.Update(false);
    return stepped;
  }
  return OptimizerStep(hypers);
}

absl::Status PipelineEngine::Impl::OptimizerStep(const std::vector<HyperParams>& hypers) {
  WaitForAsyncReads();
  // Zeroed gradients are stepped as zeros, as PyTorch steps a zero gradient (weight decay and
  // moments still move).
  for (Device& d : devices_) {
    for (int li : d.zeroed) {
      at::Tensor& p = d.Master(li);
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
    d.zeroed.clear();
  }
  // Every device checks the same hypers against the same groups: all fail or none does.
  if (offload_) {
    absl::Status room = CheckHostMemory(HostStateToMake(hypers),
                                        "the optimizer's state for the offloaded parameters");
    if (!room.ok()) return room;
    // The masters and the optimizer state are in host memory: the step runs on the host, off
    // the devices' workers (whose allocations count as device memory), every device at once.
    // The next step's Upload brings the new values (and all-gathers ZeRO's shards). A streamed
    // device's step goes on beside the next forward (pipeline_engine_host_step.cc).
    std::vector<std::future<absl::Status>> done;
    for (Device& d : devices_) {
      if (!d.local) continue;
      done.push_back(std::async(std::launch::async, [this, &d, &hypers] {
        if (StepsBesideForward(d)) return StartHostStep(d, hypers);
        return TorchCall(absl::StatusCode::kInternal, "optimizer step",
                         [&] { return d.optimizer->Step(hypers); });
      }));
    }
    absl::Status first = absl::OkStatus();
    for (auto& f : done) {
      absl::Status s = f.get();
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  }
  absl::Status stepped =
      OnEveryDevice([&](Device& d) { return d.optimizer->Step(hypers); }, false);
  if (!stepped.ok() || zero_slots_.empty()) return stepped;
  return OnEveryDevice([&](Device& d) { return GatherZeroParams(d); }, true);
}

std::map<int, std::vector<std::pair<std::string, at::Tensor>>>
PipelineEngine::Impl::OptimizerState() const {
  // OptimizerStatePieces, a ZeRO parameter's slices of a per-element state assembled: in
  // offset order, and only where they cover it all (a state not every replica has yet is left
  // out).
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> out;
  const std::vector<PipelineEngine::StatePiece> pieces = OptimizerStatePieces();
  std::map<std::pair<int, std::string>, std::vector<const PipelineEngine::StatePiece*>> sliced;
  for (const PipelineEngine::StatePiece& p : pieces) {
    if (!p.slice) {
      out[p.lifted].emplace_back(p.key, p.value);
      continue;
    }
    auto [it, fresh] = sliced.try_emplace({p.lifted, p.key});
    if (fresh) out[p.lifted].emplace_back(p.key, at::Tensor());  // its place among the keys
    it->second.push_back(&p);
  }
  at::NoGradGuard no_grad;
  for (auto& [id, parts] : sliced) {
    std::sort(parts.begin(), parts.end(),
              [](const auto* a, const auto* b) { return a->offset < b->offset; });
    std::vector<at::Tensor> values;
    int64_t covered = 0;
    for (const PipelineEngine::StatePiece* p : parts) {
      if (p->offset != covered) break;
      values.push_back(p->value);
      covered += p->value.numel();
    }
    const std::vector<int64_t>& shape = lifted_shapes_[id.first];
    const bool whole = covered == c10::multiply_integers(shape);
    for (auto& [key, value] : out[id.first]) {
      if (key == id.second) value = whole ? at::cat(values).view(shape) : at::Tensor();
    }
  }
  for (auto& [li, entries] : out) {
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [](const auto& e) { return !e.second.defined(); }),
                  entries.end());
  }
  return out;
}

absl::Status PipelineEngine::Impl::LoadOptimizerState(
    const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state) {
  WaitForAsyncReads();
  for (Device& d : devices_) {
    if (!d.optimizer) return absl::FailedPreconditionError("the engine has no optimizer");
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < d.optimizer_params.size(); ++i) {
      auto it = state.find(d.optimizer_params[i]);
      if (it == state.end()) continue;
      for (const auto& [key, value] : it->second) {
        named.emplace_back(absl::StrCat(i, ".", key), value);
      }
    }
    LoadZeroOptimizerState(d, state, &named);
    absl::Status s = d.optimizer->LoadNamedState(named);
    if (!s.ok()) return Annotate(s, absl::StrCat("device ", d.index));
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::Unscale(const at::Tensor& grad) const {
  // A power of two by default: exact, as GradScaler's unscale is.
  at::NoGradGuard no_grad;
  grad.mul_(1.0 / scaler_.scale());
}

absl::StatusOr<bool> PipelineEngine::Impl::FoundInf() {
  std::atomic<bool> found{false};
  absl::Status s = OnEveryDevice(
      [&](Device& d) -> absl::Status {
        at::NoGradGuard no_grad;
        bool mine = false;
        auto check = [&](const at::Tensor& g) {
          if (!mine && g.defined()) mine = !at::isfinite(g).all().item<bool>();
        };
        for (int li : stages_[d.stage].params) check(d.Master(li).grad());
        for (const pipeline_internal::ZeroPartition& part : d.zero) check(part.shard.grad());
        at::Tensor flag = at::full({1}, mine ? 1.0f : 0.0f, d.On(at::kFloat));
        if (d.world) {
          absl::StatusOr<comm::Buffer> buf = BufferOf(flag);
          if (!buf.ok()) return buf.status();
          absl::Status r = Wait(d, d.world->AllReduce(*buf, {comm::ReduceOp::kSum}), flag,
                                "agreeing whether the gradients overflowed");
          if (!r.ok()) return r;
        }
        if (flag.item<float>() > 0) found = true;
        return absl::OkStatus();
      },
      true);
  if (!s.ok()) return s;
  return found.load();
}

void PipelineEngine::Impl::ApplySgd(double lr) {
  at::NoGradGuard no_grad;
  for (Device& d : devices_) {
    for (size_t li = 0; li < d.lifted.size(); ++li) {
      if (!d.lifted[li].defined()) continue;
      at::Tensor& t = d.Master(static_cast<int>(li));
      if (t.requires_grad() && t.grad().defined()) t.sub_(t.grad(), lr);
    }
  }
}

std::vector<int64_t> PipelineEngine::Impl::CheckpointCudaReads(
    const std::vector<int>& lifted) const {
  // The reads a checkpoint makes (Job::CopyShareLocked: ParamValue of each parameter, then
  // OptimizerStatePieces), with ReadCopy listing instead of copying.
  counting_reads_ = true;
  counted_reads_.clear();
  for (int li : lifted) {
    if (li < 0 || li >= static_cast<int>(owner_.size())) continue;
    if (offload_ && sharded(li)) continue;  // assembled from host memory, nothing to count
    ParamValue(li);
  }
  OptimizerStatePieces();
  counting_reads_ = false;
  return std::move(counted_reads_);
}

const pipeline_internal::Device* PipelineEngine::Impl::DeviceAt(int device) const {
  if (device < 0 || device >= static_cast<int>(world_rank_.size()) || world_rank_[device] < 0) {
    return nullptr;
  }
  return &devices_[world_rank_[device]];
}

int64_t PipelineEngine::Impl::DeviceBytes(int device) const {
  const Device* d = DeviceAt(device);
  if (d == nullptr) return 0;
  AwaitKeptStep(*d);  // which counts its state
  return HeldBytes(*d);
}

int64_t PipelineEngine::Impl::PeakDeviceBytes(int device) const {
  const Device* d = DeviceAt(device);
  if (d == nullptr) return 0;
  AwaitKeptStep(*d);
  return std::max(d->peak_bytes, HeldBytes(*d));
}

int PipelineEngine::Impl::StreamedBlocks(int device) const {
  const Device* d = DeviceAt(device);
  if (d == nullptr) return 0;
  return d->streamed.empty() ? 1 : static_cast<int>(d->streamed.size());
}

int64_t PipelineEngine::Impl::StreamedPeakBytes(int device) const {
  const Device* d = DeviceAt(device);
  return d == nullptr ? 0 : d->streamed_peak;
}

int64_t PipelineEngine::Impl::KeptOnDeviceBytes(int device) const {
  const Device* d = DeviceAt(device);
  if (d == nullptr) return 0;
  int64_t bytes = 0;
  for (int li : d->kept) bytes += static_cast<int64_t>(d->lifted[li].nbytes());
  return bytes;
}

void PipelineEngine::Impl::ResetPeakDeviceBytes() {
  for (Device& d : devices_) d.peak_bytes = 0;
}

std::pair<int, int> PipelineEngine::Impl::OverlappedBuckets(int device) const {
  std::pair<int, int> out{0, 0};
  const Device* d = DeviceAt(device);
  if (d == nullptr) return out;
  for (const GradReducer* r : {d->reducer.get(), d->zero_reducer.get()}) {
    if (r == nullptr) continue;
    out.first += r->buckets_started_early();
    out.second += r->buckets();
  }
  return out;
}

int64_t PipelineEngine::Impl::HeldBytes(const Device& d) const {
  int64_t bytes = 0;
  for (const at::Tensor& t : d.lifted) {
    if (!t.defined()) continue;
    // A streamed parameter's handle keeps its shape while its memory is freed.
    if (t.storage().nbytes() > 0) bytes += t.nbytes();
    if (t.grad().defined()) bytes += t.grad().nbytes();
  }
  if (d.reducer) bytes += d.reducer->buffer_bytes();
  // Offloaded: gradients between steps and optimizer state are host memory, but for the
  // parameters kept on the device (their own part of the optimizer, which the host's step
  // thread does not touch; off the worker, the callers wait for their step first).
  if (offload_) return bytes + KeptStateBytes(d);
  for (const at::Tensor& t : d.fused_grads) {
    if (t.defined()) bytes += t.nbytes();
  }
  for (const pipeline_internal::ZeroPartition& part : d.zero) {
    if (part.shard.grad().defined()) bytes += part.shard.grad().nbytes();
    if (part.fused_grad.defined()) bytes += part.fused_grad.nbytes();
  }
  if (d.optimizer) bytes += d.optimizer->StateBytes();
  return bytes;
}

at::Tensor PipelineEngine::Impl::ReadCopy(const at::Tensor& t) const {
  if (counting_reads_) {
    if (t.is_cuda()) counted_reads_.push_back(static_cast<int64_t>(t.nbytes()));
    return t;
  }
  if (!async_reads_ || !t.is_cuda()) return HostCopy(t);
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  auto found = std::find_if(read_streams_.begin(), read_streams_.end(),
                            [&](const auto& s) { return s.first == t.device(); });
  if (found == read_streams_.end()) {
    // The device's read stream starts after the work queued on its stream so far (the last
    // optimizer step's).
    const c10::Stream stream = impl.getStreamFromGlobalPool(t.device());
    c10::Event queued(t.device().type());
    queued.record(impl.getStream(t.device()));
    queued.block(stream);
    found = read_streams_.emplace(read_streams_.end(), t.device(), stream);
  }
  at::Tensor host = arena_open_ ? checkpoint_memory_->Allocate(t.sizes(), t.scalar_type())
                                : at::Tensor();
  if (arena_open_ && !host.defined()) arena_missed_ += static_cast<int64_t>(t.nbytes());
  if (!host.defined()) host = PinnedLike(t);
  if (!host.defined()) return t.to(at::kCPU);  // no page-locked memory: a synchronous copy
  const c10::StreamGuard on_read_stream(found->second);
  host.copy_(t, /*non_blocking=*/true);
  return host;
}

void PipelineEngine::Impl::WaitForAsyncReads() {
  for (const PendingRead& r : pending_reads_) {
    const c10::impl::VirtualGuardImpl impl(r.device.type());
    r.done->block(impl.getStream(r.device));
  }
  pending_reads_.clear();
}

void PipelineEngine::Impl::BeginAsyncReads() {
  async_reads_ = true;
  arena_open_ = checkpoint_memory_ != nullptr && checkpoint_memory_->Begin();
  arena_missed_ = 0;
}

std::function<void()> PipelineEngine::Impl::EndAsyncReads() {
  if (arena_missed_ > 0) {
    // CheckpointCudaReads under-counted, or a tensor is over a GiB: the rest was allocated and
    // page-locked while training waited.
    spdlog::warn("{:.3f} GB of a checkpoint's copies from the devices did not fit the host "
                 "memory made ready for them ({:.3f} GB)",
                 static_cast<double>(arena_missed_) / 1e9,
                 static_cast<double>(checkpoint_memory_->ready_bytes()) / 1e9);
  }
  async_reads_ = false;
  arena_open_ = false;
  std::vector<std::shared_ptr<c10::Event>> events;
  for (const auto& [device, stream] : read_streams_) {
    auto done = std::make_shared<c10::Event>(device.type());
    done->record(stream);
    pending_reads_.push_back({device, done});
    events.push_back(std::move(done));
  }
  read_streams_.clear();
  return [events = std::move(events)] {
    for (const std::shared_ptr<c10::Event>& e : events) AwaitOnHost(*e);
  };
}

void PipelineEngine::Impl::AwaitAsyncReads() const {
  for (const PendingRead& r : pending_reads_) AwaitOnHost(*r.done);
}

void PipelineEngine::Impl::AwaitOnHost(const c10::Event& event) {
  // c10::Event has no host wait in every LibTorch this builds with: polled (the waiter is a
  // checkpoint writer's thread, which has nothing else to do).
  while (!event.query()) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

}  // namespace rannc
