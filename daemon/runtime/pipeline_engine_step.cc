// The engine's steps: each device's forwards and backwards in the schedule's order, the
// transfers between stages, and the gradient reduction (see pipeline_engine.h).
#include "daemon/runtime/pipeline_engine.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/subgraph.h"
#include "daemon/runtime/pipeline_engine_impl.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {

using pipeline_internal::Device;
using pipeline_internal::kMaxMicroBatches;
using pipeline_internal::kMaxValues;
using pipeline_internal::OutputKind;
using pipeline_internal::Phase;
using pipeline_internal::StageInfo;
using pipeline_internal::Tag;
using pipeline_internal::Worker;
using std::chrono::milliseconds;

absl::Status PipelineEngine::Impl::Wait(Device& d, std::unique_ptr<comm::Work> work,
                                        at::Tensor keep, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    absl::Status s = work->Wait(milliseconds(20));
    if (s.code() != absl::StatusCode::kDeadlineExceeded) {
      if (s.ok()) return s;
      return Annotate(s, what);
    }
    const bool late = std::chrono::steady_clock::now() >= deadline;
    if (late || aborted_.load() || Cancelled()) {
      d.abandoned.emplace_back(std::move(work), std::move(keep));
      if (late) {
        return absl::DeadlineExceededError(absl::StrCat(
            what, ": not done after ", timeout_.count(), " ms"));
      }
      return absl::AbortedError(absl::StrCat(what, ": abandoned, another device failed"));
    }
  }
}

absl::Status PipelineEngine::Impl::WaitAll(Device& d, Pending& pending) {
  absl::Status status = absl::OkStatus();
  for (auto& [work, keep] : pending) {
    if (!status.ok()) {
      d.abandoned.emplace_back(std::move(work), std::move(keep));
      continue;
    }
    status = Wait(d, std::move(work), std::move(keep), "a send");
  }
  pending.clear();
  return status;
}

absl::Status PipelineEngine::Impl::Send(Device& d, const at::Tensor& t, int dst_device,
                                        uint32_t tag, Pending& pending) {
  at::Tensor data = t.detach().contiguous();
  absl::StatusOr<comm::Buffer> buf = BufferOf(data);
  if (!buf.ok()) return buf.status();
  pending.emplace_back(d.world->Send(*buf, world_rank_[dst_device], {tag}), data);
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::Recv(Device& d, const at::Tensor& t, int src_device,
                                        uint32_t tag, const std::string& what) {
  absl::StatusOr<comm::Buffer> buf = BufferOf(t);
  if (!buf.ok()) return buf.status();
  return Wait(d, d.world->Recv(*buf, world_rank_[src_device], {tag}), t,
              absl::StrCat(what, " from device ", src_device));
}

absl::Status PipelineEngine::Impl::OnEveryDevice(const std::function<absl::Status(Device&)>& fn,
                                                 bool breaks) {
  aborted_ = false;
  if (Cancelled()) {
    broken_ = true;
    first_error_ = absl::AbortedError("the engine was cancelled");
    return first_error_;
  }
  std::vector<std::future<absl::Status>> done;
  for (Device& d : devices_) {
    if (!d.local) continue;
    done.push_back(d.worker->Post([this, &d, &fn]() -> absl::Status {
      const int64_t held = HeldBytes(d);
      d.memory->ResetPeak();
      const int64_t start = d.memory->current();
      absl::Status s = TorchCall(absl::StatusCode::kInternal, "step", [&] { return fn(d); });
      d.peak_bytes = std::max(d.peak_bytes, held + d.memory->peak() - start);
      if (!s.ok()) {
        s = Annotate(s, absl::StrCat("device ", d.index, " (stage ", d.stage, ", replica ",
                                     d.replica, ")"));
        aborted_ = true;
      }
      return s;
    }));
  }
  absl::Status first = absl::OkStatus();
  for (auto& f : done) {
    absl::Status s = f.get();
    // An abandoned wait is the consequence of another device's error, not the cause.
    if (!s.ok() && (first.ok() || (first.code() == absl::StatusCode::kAborted &&
                                   s.code() != absl::StatusCode::kAborted))) {
      first = s;
    }
  }
  if (!first.ok() && breaks) {
    broken_ = true;
    std::lock_guard<std::mutex> lock(error_mu_);
    first_error_ = first;
  }
  return first;
}

void PipelineEngine::Impl::PartialToHost(Device& d, int v) {
  const at::Tensor& partial = d.partial.at(v);
  if (!outputs_before_backward_ || partial.device().is_cpu()) return;
  at::Tensor host = PinnedLike(partial);
  if (!host.defined()) {
    d.partial_host.erase(v);  // read with a blocking copy
    return;
  }
  host.copy_(partial, /*non_blocking=*/true);
  d.partial_host[v] = host;
  const c10::impl::VirtualGuardImpl impl(d.place.type());
  if (!d.partial_ready) d.partial_ready = std::make_unique<c10::Event>(d.place.type());
  d.partial_ready->record(impl.getStream(d.place));
}

at::Tensor PipelineEngine::Impl::PartialOnHost(const Device& d, int v) {
  auto host = d.partial_host.find(v);
  if (host == d.partial_host.end() || !d.partial_ready) return ToHost(d.partial.at(v));
  AwaitOnHost(*d.partial_ready);
  return host->second.clone();  // the buffer is the next step's copy's
}

absl::Status PipelineEngine::Impl::RunForward(Device& d, const StepPlan& step, int mb,
                                              Pending& pending) {
  const IrGraph& ir = *ir_;
  const StageInfo& st = stages_[d.stage];
  const MicroBatchShard shard = ShardOf(d, step, mb);
  if (shard.count == 0) return absl::OkStatus();  // no samples of this micro-batch here
  const int64_t n = shard.micro_batch;
  const int64_t my_off = shard.offset;
  const int64_t my_count = shard.count;
  const double weight = shard.weight;
  std::vector<at::Tensor> in;
  for (size_t j = 0; j < st.data_inputs.size(); ++j) {
    const int v = st.data_inputs[j];
    const int p = st.source[j];
    if (p < 0) {
      in.push_back(d.Here(Rows((*step.inputs)[-1 - p], v, step.mb_offsets[mb] + my_off, my_count)));
      continue;
    }
    const IrValue& val = ir.values[v];
    at::Tensor x = at::empty(ShapeFor(v, my_count), d.On(val.dtype));
    for (const Transfer& t : Transfers(v, n, p, d.stage)) {
      if (t.dst != d.replica) continue;
      const bool whole = val.batch_dim < 0 || (t.dst_offset == 0 && t.count == my_count);
      at::Tensor piece = whole ? x : at::empty(ShapeFor(v, t.count), x.options());
      absl::Status s = Recv(d, piece, stages_[p].devices[t.src], Tag(false, mb, v),
                            absl::StrCat("activation ", val.name, " of micro-batch ", mb));
      if (!s.ok()) return s;
      if (!whole) Rows(x, v, t.dst_offset, t.count).copy_(piece);
    }
    in.push_back(x);
  }
  const auto compute_start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<at::Tensor>> out = d.exec->Forward(mb, in, step.requires_grad);
  CountSince(compute_start, &EngineCounters::compute_ns);
  if (!out.ok()) return Annotate(out.status(), absl::StrCat("micro-batch ", mb));
  for (size_t k = 0; k < st.outputs.size(); ++k) {
    const int v = st.outputs[k];
    auto kind = stage_outputs_.find(v);
    if (kind != stage_outputs_.end()) {
      at::Tensor value = (*out)[k].detach();
      at::Tensor& partial = d.partial[v];
      switch (kind->second) {
        case OutputKind::kBatched:
          Rows(step.batched->at(v), v, step.mb_offsets[mb] + my_off, my_count).copy_(value);
          break;
        case OutputKind::kMean:
          value = value.to(at::kDouble) * weight;
          partial = partial.defined() ? partial + value : value;
          break;
        case OutputKind::kSum:
          partial = partial.defined() ? partial + value : value.clone();
          break;
        default:
          if (mb == 0 && d.replica == 0) partial = value.clone();
          break;
      }
      if (partial.defined()) PartialToHost(d, v);
    }
    // The IR's dtype, which the consumers receive. The IR takes a CUDA stage's dtypes from a
    // run on the device (IrOptions::dtype_device); where that run could not be made, the host's
    // autocast lists gave them and the two may differ.
    at::Tensor sent = (*out)[k];
    if (sent.scalar_type() != ir.values[v].dtype) {
      if (!warned_cast_.exchange(true)) {
        spdlog::warn("job {}: stage {} computes %{} as {} where the IR says {}; it is sent cast "
                     "(logged once)", id_, d.stage, ir.values[v].name,
                     c10::toString(sent.scalar_type()), c10::toString(ir.values[v].dtype));
      }
      sent = sent.to(ir.values[v].dtype);
    }
    for (int q : st.consumers[k]) {
      for (const Transfer& t : Transfers(v, n, d.stage, q)) {
        if (t.src != d.replica) continue;
        absl::Status s = Send(d, Rows(sent, v, t.src_offset, t.count),
                              stages_[q].devices[t.dst], Tag(false, mb, v), pending);
        if (!s.ok()) return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::RunBackward(Device& d, const StepPlan& step, int mb,
                                               Pending& pending) {
  const IrGraph& ir = *ir_;
  const StageInfo& st = stages_[d.stage];
  const MicroBatchShard shard = ShardOf(d, step, mb);
  if (shard.count == 0) return absl::OkStatus();  // no samples of this micro-batch here
  const int64_t n = shard.micro_batch;
  const int64_t my_off = shard.offset;
  const int64_t my_count = shard.count;
  const double weight = shard.weight;
  std::vector<at::Tensor> out_grads;
  for (size_t k = 0; k < st.outputs.size(); ++k) {
    const int v = st.outputs[k];
    const IrValue& val = ir.values[v];
    at::Tensor g;
    if (step.phase == Phase::kFused) {
      // The loss's gradient 1, through its combination of the shards, times the loss scale:
      // made in fp32 and cast, as backward from loss.float() * scale (Apex's amp.scale_loss)
      // gives it, so a scale past an fp16 loss's range is an overflow the step skips.
      if (v == ir.outputs[0]) {
        g = at::full(ShapeFor(v, 0),
                     (stage_outputs_.at(v) == OutputKind::kMean ? weight : 1.0) *
                         scaler_.scale(),
                     d.On(at::kFloat))
                .to(val.dtype);
      }
    } else if (auto client = step.grads->find(v); client != step.grads->end()) {
      switch (stage_outputs_.at(v)) {
        case OutputKind::kBatched:
          g = d.Here(Rows(client->second, v, step.mb_offsets[mb] + my_off, my_count));
          break;
        case OutputKind::kMean:
          g = d.Here(client->second) * weight;
          break;
        case OutputKind::kSum:
          if (at::isFloatingType(val.dtype)) g = d.Here(client->second);
          break;
        case OutputKind::kFirst:
          if (mb == 0 && d.replica == 0) g = d.Here(client->second);
          break;
        default:
          break;
      }
    }
    if (!st.consumers[k].empty() && at::isFloatingType(val.dtype)) {
      at::Tensor sum = at::zeros(ShapeFor(v, my_count), d.On(val.dtype));
      for (int q : st.consumers[k]) {
        for (const Transfer& t : Transfers(v, n, d.stage, q)) {
          if (t.src != d.replica) continue;
          at::Tensor piece = at::empty(ShapeFor(v, val.batch_dim < 0 ? 0 : t.count),
                                       sum.options());
          absl::Status s = Recv(d, piece, stages_[q].devices[t.dst], Tag(true, mb, v),
                                absl::StrCat("gradient of ", val.name, " of micro-batch ", mb));
          if (!s.ok()) return s;
          Rows(sum, v, t.src_offset, t.count).add_(piece);
        }
      }
      g = g.defined() ? g + sum : sum;
    }
    out_grads.push_back(g);
  }
  const auto compute_start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<at::Tensor>> in_grads =
      d.exec->Backward(mb, out_grads, step.retain_graph);
  CountSince(compute_start, &EngineCounters::compute_ns);
  if (!in_grads.ok()) return Annotate(in_grads.status(), absl::StrCat("micro-batch ", mb));
  for (size_t j = 0; j < st.data_inputs.size(); ++j) {
    const int p = st.source[j];
    const int v = st.data_inputs[j];
    const IrValue& val = ir.values[v];
    if (p < 0 || !at::isFloatingType(val.dtype)) continue;
    at::Tensor g = (*in_grads)[j];
    g = g.defined() ? g.to(val.dtype)
                    : at::zeros(ShapeFor(v, my_count), d.On(val.dtype));
    for (const Transfer& t : Transfers(v, n, p, d.stage)) {
      if (t.dst != d.replica) continue;
      absl::Status s = Send(d, Rows(g, v, t.dst_offset, t.count), stages_[p].devices[t.src],
                            Tag(true, mb, v), pending);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::RunDevice(Device& d, const StepPlan& step) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = RunDeviceOps(d, step);
  CountSince(start, &EngineCounters::schedule_ns);
  return s;
}

void PipelineEngine::Impl::CountSince(std::chrono::steady_clock::time_point start,
                                      std::atomic<int64_t> EngineCounters::*counter) const {
  if (!counters_) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - start);
  ((*counters_).*counter).fetch_add(ns.count(), std::memory_order_relaxed);
}

absl::Status PipelineEngine::Impl::RunDeviceOps(Device& d, const StepPlan& step) {
  const StageInfo& st = stages_[d.stage];
  const int S = static_cast<int>(stages_.size());
  const int m = static_cast<int>(step.mb_sizes.size());
  std::vector<PipelineOp> ops;
  switch (step.phase) {
    case Phase::kFused:
      ops = StageOps(schedule_, d.stage, S, m);
      break;
    case Phase::kForward:
      for (int mb = 0; mb < m; ++mb) ops.push_back({false, mb});
      break;
    case Phase::kBackward:
      for (int mb = m - 1; mb >= 0; --mb) ops.push_back({true, mb});
      break;
  }
  if (step.phase != Phase::kBackward) {
    // A new forward replaces whatever the previous one kept, as re-running a model does.
    for (int mb = 0; mb < last_micro_batches_; ++mb) d.exec->Release(mb);
    d.fused_grads.clear();
    for (pipeline_internal::ZeroPartition& part : d.zero) part.fused_grad.reset();
    d.partial.clear();
    d.partial_host.clear();
  }
  if (offload_) {
    absl::Status up = Upload(d);
    if (!up.ok()) return up;
  }
  // Offloaded parameters stay on the device while a backward may still come over this step's
  // graphs; otherwise they go when the step ends (failed or not).
  const bool keep_resident = (step.phase == Phase::kForward && step.requires_grad) ||
                             (step.phase == Phase::kBackward && step.retain_graph);
  auto end = [&](absl::Status s) {
    d.exec->ShareCasts(false);
    TakeDownloads(d, /*wait=*/true);  // the copies end before their memory goes
    d.streamed_grads.clear();  // taken below, or dropped with a failed step
    if (offload_ && (!keep_resident || !s.ok())) Release(d);
    return s;
  };
  const bool backward = step.phase != Phase::kForward;
  const bool reduce = backward && !step.delay;
  std::vector<at::Tensor> params;
  for (int li : st.params) params.push_back(d.lifted[li]);
  // This step's gradients are kept apart until they are reduced. A parameter kept on a
  // streamed device (Device::kept) waits in host memory meanwhile: the plan counts the kept
  // gradients only from the backward of the blocks that read them on, not an earlier
  // backward's all through this one (a client accumulating over several backwards).
  std::vector<at::Tensor> saved;
  if (backward) {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = params[i];
      saved.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
      if (saved.back().defined() && d.kept.count(st.params[i])) {
        saved.back() = HostCopy(saved.back().detach());
      }
    }
  }
  // An earlier backward's gradient of params[i], on its device again.
  auto saved_grad = [&](size_t i) {
    const at::Tensor& g = saved[i];
    return !g.defined() || g.device() == params[i].device() ? g : g.to(params[i].device());
  };
  // On failure the gradients accumulated before this step are put back.
  auto fail = [&](absl::Status s) {
    for (size_t i = 0; i < saved.size(); ++i) params[i].mutable_grad() = saved_grad(i);
    return end(s);
  };
  // The micro-batches of this call read the same parameter values (the optimizer steps between
  // calls): O2's grouped casts are made once for all of them (StageExecutor::ShareCasts).
  d.exec->ShareCasts(m > 1);
  Pending pending;
  bool first_backward = true;
  for (size_t i = 0; i < ops.size(); ++i) {
    const PipelineOp& op = ops[i];
    // ZeRO's buckets are the gradients from the first backward on, not during the forwards.
    if (op.backward && first_backward && d.zero_reducer) {
      absl::Status bound = d.zero_reducer->BindGrads();
      if (!bound.ok()) {
        WaitAll(d, pending).IgnoreError();
        return fail(bound);
      }
      first_backward = false;
    }
    // The device's last op is its last backward: the reducers start each bucket's collective
    // as soon as autograd has finished that bucket's gradients. ZeRO's reduce-scatter runs
    // after every backward, delayed or not; while its hooks issue collectives on the replica
    // group, the all-reduce waits for the backward's end (Device::zero_reducer).
    if (backward && i + 1 == ops.size()) {
      if (d.zero_reducer) {
        d.zero_reducer->BeginFinalBackward();
      } else if (reduce && d.reducer) {
        d.reducer->BeginFinalBackward();
      }
    }
    absl::Status s = op.backward ? RunBackward(d, step, op.micro_batch, pending)
                                 : RunForward(d, step, op.micro_batch, pending);
    if (!s.ok()) {
      WaitAll(d, pending).IgnoreError();
      return fail(s);
    }
  }
  absl::Status sent = WaitAll(d, pending);
  if (!sent.ok()) return fail(sent);
  if (!backward) return end(absl::OkStatus());
  TakeDownloads(d, /*wait=*/true);  // the last blocks' gradients of streamed parameters
  // ZeRO's shards are reduce-scattered after every backward, delayed or not: sums are linear,
  // so accumulating shards is exact, and the full local gradient is not kept. First, so that
  // its remaining buckets are issued before the all-reduce's on the same group; added to the
  // shards' gradients only once nothing can fail, as the others' are.
  absl::StatusOr<std::vector<at::Tensor>> shards = ReduceScatterZero(d);
  if (!shards.ok()) return fail(shards.status());
  if (reduce) {
    if (d.zero_reducer && d.reducer) d.reducer->BeginFinalBackward();
    absl::Status reduced = ReduceGrads(d);
    if (!reduced.ok()) return fail(reduced);
  }
  AddZeroShards(d, std::move(*shards), step.phase == Phase::kFused);
  for (size_t i = 0; i < params.size(); ++i) {
    const int li = st.params[i];
    // A streamed parameter's gradient went to the host block by block (BlockGradsToHost).
    at::Tensor step_grad = params[i].grad();
    if (d.Streamed(li)) {
      auto streamed = d.streamed_grads.find(li);
      step_grad = streamed == d.streamed_grads.end() ? at::Tensor() : streamed->second;
    }
    if (scaler_.enabled() && step_grad.defined()) Unscale(step_grad);
    if (!d.host.empty() && d.host[li].defined()) {
      // Offloaded: the step's gradient goes to the host master (the device had none before),
      // into page-locked memory from a CUDA device (HostCopy: a DMA at the link's speed, and
      // the caching host allocator hands the same pages out again at the next step once the
      // client's zero_grad has freed them; pageable memory is faulted in anew every step).
      params[i].mutable_grad().reset();
      if (step_grad.defined()) {
        step_grad = step_grad.device().is_cpu() ? step_grad : HostCopy(step_grad.detach());
      }
      at::Tensor& master = d.host[li];
      if (step.phase == Phase::kFused) {
        d.fused_grads.push_back(step_grad);
      } else if (step_grad.defined() &&
                 !(step.primary_only && d.world_rank != primary_[li])) {
        master.mutable_grad() =
            master.grad().defined() ? master.mutable_grad().add_(step_grad) : step_grad;
      }
      continue;
    }
    if (step.phase == Phase::kFused) {
      d.fused_grads.push_back(step_grad);
      params[i].mutable_grad() = saved_grad(i);
    } else if (step.primary_only && d.world_rank != primary_[st.params[i]]) {
      params[i].mutable_grad() = saved_grad(i);
    } else if (saved[i].defined()) {
      params[i].mutable_grad() = step_grad.defined() ? saved_grad(i).add_(step_grad)
                                                     : saved_grad(i);
    }
  }
  return end(absl::OkStatus());
}

absl::Status PipelineEngine::Impl::ReduceGrads(Device& d) {
  const StageInfo& st = stages_[d.stage];
  auto grad_of = [&](int li) -> at::Tensor {
    at::Tensor& p = d.lifted[li];
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
    return p.grad();
  };
  std::set<int> tied(tied_.begin(), tied_.end());
  // Tied parameters: over every device, the non-holders contributing zeros (the devices' local
  // gradients, so the sum over all devices is the full gradient; no replica reduction). Summed
  // into copies, so that a failure leaves the gradients as they were.
  std::vector<std::pair<int, at::Tensor>> tied_sums;
  for (int li : tied_) {
    const bool holds = d.lifted[li].defined();
    at::Tensor g = holds ? grad_of(li).clone()
                         : at::zeros(lifted_shapes_[li], d.On(lifted_types_[li]));
    if (!d.world) continue;
    absl::StatusOr<comm::Buffer> buf = BufferOf(g);
    if (!buf.ok()) return buf.status();
    absl::Status s = Wait(d, d.world->AllReduce(*buf, {comm::ReduceOp::kSum}), g,
                          absl::StrCat("all-reducing the tied ", ir_->tensor_names[li]));
    if (!s.ok()) return s;
    if (holds) tied_sums.emplace_back(li, g);
  }
  if (d.reducer) {
    absl::Status s = d.reducer->Finish(
        [&](std::unique_ptr<comm::Work> work, at::Tensor keep, const std::string& what) {
          return Wait(d, std::move(work), std::move(keep), what);
        });
    if (!s.ok()) return s;
  }
  for (auto& [li, sum] : tied_sums) d.lifted[li].mutable_grad() = sum;
  for (int li : st.params) {
    if (tied.count(li) || sharded(li)) continue;
    if (d.Streamed(li)) {
      // Its gradient is on the host (a stage with one replica: nothing to reduce); zeros where
      // the step gave it none, as grad_of makes them.
      at::Tensor& g = d.streamed_grads[li];
      if (!g.defined()) g = at::zeros_like(d.host[li].detach());
      continue;
    }
    grad_of(li);
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::BeginLocalGrads() {
  if (pending_) return;
  for (Device& d : devices_) {
    if (!d.local) continue;
    for (int li : stages_[d.stage].params) {
      if (d.world_rank != primary_[li]) d.Master(li).mutable_grad().reset();
    }
  }
  pending_ = true;
}

absl::Status PipelineEngine::Impl::AllReduceGrads() {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  if (!pending_) return absl::OkStatus();
  absl::Status reduced = OnEveryDevice(
      [&](Device& d) {
        if (offload_) return ReduceOffloaded(d, held_ == Held::kGraphs);
        // Nothing runs a backward: Finish takes every gradient as it stands.
        if (d.reducer) d.reducer->BeginFinalBackward();
        return ReduceGrads(d);
      },
      true);
  if (reduced.ok()) pending_ = false;
  return reduced;
}

absl::StatusOr<std::vector<at::Tensor>> PipelineEngine::Impl::Forward(
    const std::vector<at::Tensor>& inputs, bool requires_grad) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  const IrGraph& ir = *ir_;
  if (inputs.size() != ir.num_client_inputs) {
    return absl::InvalidArgumentError(
        absl::StrCat(inputs.size(), " inputs for ", ir.num_client_inputs));
  }
  // The step inputs (loss denominators) come from the whole batch; every shard reads them.
  // A loss's class weights come from a device of this process that holds them (the loss's
  // stage, the only one that reads its denominator).
  absl::Status settled = absl::OkStatus();
  absl::StatusOr<std::vector<at::Tensor>> batch = WithStepInputs(ir, inputs, [&](int lifted) {
    // Class weights that are a parameter the last optimizer step may still be stepping.
    if (settled.ok()) settled = SettleHostSteps();
    for (const Device& d : devices_) {
      if (d.local && d.lifted[lifted].defined()) return ParamValue(lifted, d.index);
    }
    return at::Tensor();
  });
  if (!batch.ok()) return batch.status();
  if (!settled.ok()) return settled;
  StepPlan step;
  step.inputs = &*batch;
  step.requires_grad = requires_grad;
  step.phase = requires_grad && fused_ ? Phase::kFused : Phase::kForward;
  step.delay = delay_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int v = ir.inputs[i];
    const int bd = ir.values[v].batch_dim;
    if (bd < 0) continue;
    if (!inputs[i].defined() || inputs[i].dim() <= bd) {
      return absl::InvalidArgumentError(absl::StrCat("input ", i, " has no batch dimension"));
    }
    const int64_t ps = PerSample(v);
    const int64_t b = ps > 0 ? inputs[i].size(bd) / ps : 0;
    if (step.batch == 0) step.batch = b;
    if (b != step.batch || b * ps != inputs[i].size(bd)) {
      return absl::InvalidArgumentError(
          absl::StrCat("input ", i, "'s batch does not match the others' (", step.batch, ")"));
    }
  }
  if (step.batch <= 0) return absl::InvalidArgumentError("the inputs have no batch");
  // A batch smaller than the plan's (an epoch's last) runs in fewer micro-batches, as long as
  // each keeps one sample per replica; below that, replicas without samples sit a micro-batch
  // out (and all-reduce zeros).
  int64_t max_replicas = 1;
  for (const StageInfo& st : stages_) {
    max_replicas = std::max<int64_t>(max_replicas, st.devices.size());
  }
  const int m = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(micro_batches_, step.batch / max_replicas)));
  step.mb_sizes = SplitSizes(step.batch, m);
  step.mb_offsets = Offsets(step.mb_sizes);

  std::map<int, at::Tensor> batched;
  for (const auto& [v, kind] : stage_outputs_) {
    if (kind == OutputKind::kBatched) {
      // A partial engine's share: other processes' rows stay zeros.
      const at::TensorOptions type = at::TensorOptions().dtype(ir.values[v].dtype);
      batched[v] = partial_ ? at::zeros(ShapeFor(v, step.batch), type)
                            : at::empty(ShapeFor(v, step.batch), type);
    }
  }
  step.batched = &batched;
  if (offload_low_precision_ && !host_copies_checked_) {
    // The first forward makes the copies; a step before it may be making them on its thread.
    SettleHostStepsKeepingFailure();
    absl::Status room = CheckHostMemory(
        HostCopiesToMake(), "offload_low_precision's copies of the offloaded parameters");
    if (!room.ok()) return room;
    host_copies_checked_ = true;
  }
  held_ = Held::kNothing;
  absl::Status ran = OnEveryDevice([&](Device& d) { return RunDevice(d, step); }, true);
  last_micro_batches_ = m;
  // The forward waited for each block's optimizer step; the steps' threads end with it.
  settled = SettleHostSteps();
  if (!ran.ok()) return ran;
  if (!settled.ok()) return settled;

  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < ir.outputs.size(); ++i) {
    const int v = ir.outputs[i];
    const IrValue& val = ir.values[v];
    at::Tensor out;
    switch (output_kinds_[i]) {
      case OutputKind::kBatched:
        out = batched.at(v);
        break;
      case OutputKind::kUserInput:
      case OutputKind::kLifted: {
        // Returned as they are; of several partial engines, the one running the plan's first
        // device returns them (the others zeros, so that members' outputs add up).
        const int index =
            static_cast<int>(std::find(ir.inputs.begin(), ir.inputs.end(), v) - ir.inputs.begin());
        if (partial_ && !devices_[0].local) {
          out = at::zeros(val.shape, at::TensorOptions().dtype(val.dtype));
        } else if (output_kinds_[i] == OutputKind::kUserInput) {
          out = inputs[index];
        } else {
          const at::Tensor held = ParamValue(index - static_cast<int>(ir.num_user_inputs));
          out = held.defined() ? held : at::zeros(val.shape, at::TensorOptions().dtype(val.dtype));
        }
        break;
      }
      default:
        for (const Device& d : devices_) {
          auto p = d.partial.find(v);
          if (p == d.partial.end()) continue;
          const at::Tensor shard = PartialOnHost(d, v);
          if (output_kinds_[i] == OutputKind::kFirst) {
            out = shard;
            break;
          }
          out = out.defined() ? out + shard : shard;
        }
        if (!out.defined() && partial_) out = at::zeros(val.shape, at::kDouble);
        if (!out.defined()) return absl::InternalError(absl::StrCat("no shard computed ", val.name));
        out = out.to(val.dtype);
        break;
    }
    outputs.push_back(out);
  }
  last_ = step;
  last_.inputs = nullptr;
  last_.batched = nullptr;
  last_outputs_.clear();
  for (const at::Tensor& o : outputs) last_outputs_.push_back({o.scalar_type(), o.sizes().vec()});
  if (requires_grad) held_ = fused_ ? Held::kFusedGrads : Held::kGraphs;
  fused_local_ = step.phase == Phase::kFused && delay_;
  return outputs;
}

absl::Status PipelineEngine::Impl::Backward(
    const std::vector<std::pair<size_t, at::Tensor>>& output_grads, bool retain_graph) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  if (held_ == Held::kNothing) {
    return absl::FailedPreconditionError(
        "backward called with no forward pending: call forward (with gradients enabled) first, "
        "or keep_graph(True) to run backward twice over one forward");
  }
  std::map<int, at::Tensor> grads;
  for (const auto& [index, grad] : output_grads) {
    if (index >= last_outputs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ", but the model has ", last_outputs_.size(),
          " outputs"));
    }
    const auto& [dtype, shape] = last_outputs_[index];
    if (!grad.defined() || !grad.sizes().equals(shape) || grad.scalar_type() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ": expected ", DescribeTensor(dtype, shape), ", got ",
          grad.defined() ? DescribeTensor(grad.scalar_type(), grad.sizes()) : "none"));
    }
    if (!at::isFloatingType(grad.scalar_type())) continue;
    const int v = ir_->outputs[index];
    at::Tensor& slot = grads[v];
    slot = slot.defined() ? slot + grad : grad.contiguous();
  }
  if (held_ == Held::kFusedGrads) {
    // Gradients are linear in the output gradient: add g x the fused forward's.
    auto loss_grad = grads.find(ir_->outputs[0]);
    const double g = loss_grad == grads.end() ? 0.0 : loss_grad->second.item<double>();
    // Local gradients go to every holder; reduced ones, while others are pending, to each
    // parameter's primary holder only.
    const bool primary_only = !fused_local_ && pending_;
    if (fused_local_) BeginLocalGrads();
    at::NoGradGuard no_grad;
    for (Device& d : devices_) {
      const StageInfo& st = stages_[d.stage];
      for (size_t i = 0; i < d.fused_grads.size() && g != 0.0; ++i) {
        if (primary_only && d.world_rank != primary_[st.params[i]]) continue;
        at::Tensor& grad = d.Master(st.params[i]).mutable_grad();
        const at::Tensor& step = d.fused_grads[i];
        if (!step.defined()) continue;
        if (grad.defined()) {
          grad.add_(step, g);
        } else {
          grad = g == 1.0 && !retain_graph ? step : step * g;
        }
      }
      if (!retain_graph) d.fused_grads.clear();
      AddZeroFusedGrads(d, g, retain_graph);
    }
    if (!retain_graph) held_ = Held::kNothing;
    return absl::OkStatus();
  }
  if (scaler_.enabled()) {
    // The backward starts from scaled gradients (the step's gradients are unscaled at its end).
    for (auto& [v, g] : grads) g = g * scaler_.scale();
  }
  StepPlan step = last_;
  step.phase = Phase::kBackward;
  step.grads = &grads;
  step.retain_graph = retain_graph;
  step.delay = delay_;
  step.primary_only = !delay_ && pending_;
  if (delay_) BeginLocalGrads();
  if (!retain_graph) held_ = Held::kNothing;
  return OnEveryDevice([&](Device& d) { return RunDevice(d, step); }, true);
}

}  // namespace rannc
