#include "daemon/planner/cost_eval.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "daemon/planner/cost_eval_internal.h"

namespace rannc {
namespace planner {
namespace {

uint64_t ClampBytes(double bytes) {
  if (!(bytes > 0)) return 0;
  return static_cast<uint64_t>(std::llround(bytes));
}

double ClampMs(double ms) { return ms > 0 ? ms : 0; }

// The line through (x0, a) and (x1, b), evaluated at x.
BlockProfile Line(int64_t x0, const BlockProfile& a, int64_t x1, const BlockProfile& b,
                  int64_t x) {
  const double t = static_cast<double>(x - x0) / static_cast<double>(x1 - x0);
  auto lerp = [t](double u, double v) { return u + (v - u) * t; };
  BlockProfile p;
  p.fwd_ms = ClampMs(lerp(a.fwd_ms, b.fwd_ms));
  p.bwd_ms = ClampMs(lerp(a.bwd_ms, b.bwd_ms));
  p.act_bytes = ClampBytes(lerp(static_cast<double>(a.act_bytes), static_cast<double>(b.act_bytes)));
  p.peak_bytes =
      ClampBytes(lerp(static_cast<double>(a.peak_bytes), static_cast<double>(b.peak_bytes)));
  return p;
}

BlockProfile Scale(const BlockProfile& a, double f) {
  BlockProfile p;
  p.fwd_ms = ClampMs(a.fwd_ms * f);
  p.bwd_ms = ClampMs(a.bwd_ms * f);
  p.act_bytes = ClampBytes(static_cast<double>(a.act_bytes) * f);
  p.peak_bytes = ClampBytes(static_cast<double>(a.peak_bytes) * f);
  return p;
}

}  // namespace

BlockProfile ProfileAt(const Block& block, int64_t mb) {
  const auto& m = block.by_mb;
  if (m.empty()) return BlockProfile{};
  auto exact = m.find(mb);
  if (exact != m.end()) return exact->second;
  auto hi = m.upper_bound(mb);
  if (hi == m.begin()) {  // below the smallest measured size
    return Scale(hi->second, static_cast<double>(mb) / static_cast<double>(hi->first));
  }
  if (hi == m.end()) {  // above the largest
    auto last = std::prev(m.end());
    if (last == m.begin()) {
      return Scale(last->second, static_cast<double>(mb) / static_cast<double>(last->first));
    }
    auto before = std::prev(last);
    return Line(before->first, before->second, last->first, last->second, mb);
  }
  auto lo = std::prev(hi);
  return Line(lo->first, lo->second, hi->first, hi->second, mb);
}

double AllreduceBandwidth(const Links& links, int k) {
  const auto& bw = links.allreduce_bytes_per_s;
  if (bw.empty()) {
    if (k <= 1) return links.p2p_bytes_per_s;
    // Ring all-reduce moves 2 (k-1)/k of the data through each device's link.
    return links.p2p_bytes_per_s * k / (2.0 * (k - 1));
  }
  auto it = bw.upper_bound(k);
  if (it == bw.begin()) return it->second;  // nothing measured at or below k
  return std::prev(it)->second;
}

namespace internal {

int64_t MicroBatchPerDevice(int64_t batch_size, int micro_batches, int replicas) {
  const int64_t devices_per_step = static_cast<int64_t>(micro_batches) * replicas;
  if (devices_per_step <= 0 || batch_size < devices_per_step) return 0;
  return (batch_size + devices_per_step - 1) / devices_per_step;
}

int Inflight(Schedule schedule, int stages_after, int micro_batches) {
  if (schedule == Schedule::kGPipe) return micro_batches;
  return std::min(micro_batches, stages_after + 1);
}

double CutBytes(const CostTable& table, int boundary) {
  if (boundary <= 0 || boundary >= static_cast<int>(table.cut_bytes_per_sample.size())) return 0;
  return table.cut_bytes_per_sample[boundary];
}

StageEval FinishStage(const CostTable& table, const Links& links, const SearchOptions& options,
                      int begin, int end, int replicas, int inflight, int64_t mb,
                      const StageSums& sums) {
  const int n = static_cast<int>(table.blocks.size());
  StageEval e;
  e.micro_batch = mb;
  e.inflight = inflight;
  e.param_bytes = sums.param_bytes;
  e.trainable_bytes = sums.trainable_bytes;
  e.act_bytes = sums.act_bytes;
  e.peak_bytes = sums.peak_bytes;
  e.fwd_ms = sums.fwd_ms;
  e.bwd_ms = sums.bwd_ms;

  // Each boundary is crossed by the outputs going forward and by their gradients coming back.
  const double mbd = static_cast<double>(mb);
  auto transfer_ms = [&](int boundary) {
    return 2.0 * (CutBytes(table, boundary) * mbd / links.p2p_bytes_per_s + links.p2p_latency_s) *
           1000.0;
  };
  e.comm_ms = 0;
  if (begin > 0) e.comm_ms += transfer_ms(begin);
  if (end < n) e.comm_ms += transfer_ms(end);

  if (replicas > 1) {
    e.allreduce_ms = (links.allreduce_latency_s +
                      static_cast<double>(sums.trainable_bytes) / AllreduceBandwidth(links, replicas)) *
                     1000.0;
  }

  // With ZeRO the state is a replica's shard, but a step's whole local gradient is still held
  // while it is computed (the reduce-scatter follows the backward).
  const double grads_and_state =
      static_cast<double>(sums.trainable_bytes) *
      (1.0 + options.optimizer_state_factor / (options.zero ? replicas : 1));
  const double fixed = static_cast<double>(sums.param_bytes) + grads_and_state;
  const double input = begin > 0 ? CutBytes(table, begin) * mbd : 0.0;
  const double act = static_cast<double>(sums.act_bytes);
  const double peak = static_cast<double>(sums.peak_bytes);
  const double limit =
      static_cast<double>(options.device_memory_bytes) * (1.0 - options.mem_margin);

  const double keep_all = fixed + act * inflight + peak + input * inflight;
  const double recomputed = fixed + input * inflight + act + peak;
  double memory = keep_all;
  if (keep_all > limit && options.allow_recompute) {
    memory = recomputed;
    e.recompute = true;
    e.bwd_ms += e.fwd_ms;
  }
  e.memory_bytes = static_cast<uint64_t>(std::ceil(memory));
  e.feasible = static_cast<double>(e.memory_bytes) <= limit;
  e.time_ms = e.fwd_ms + e.bwd_ms + e.comm_ms;
  return e;
}

}  // namespace internal

StageEval EvaluateStage(const CostTable& table, const Links& links,
                        const SearchOptions& options, int begin, int end, int replicas,
                        int stages_after, int micro_batches) {
  const int n = static_cast<int>(table.blocks.size());
  if (begin < 0 || end > n || begin >= end || replicas < 1 || micro_batches < 1 ||
      stages_after < 0) {
    return StageEval{};
  }
  const int64_t mb = internal::MicroBatchPerDevice(options.batch_size, micro_batches, replicas);
  if (mb == 0) return StageEval{};

  internal::StageSums sums;
  std::vector<bool> held(table.param_bytes.size(), false);
  for (int b = begin; b < end; ++b) {
    internal::AddBlockProfile(ProfileAt(table.blocks[b], mb), &sums);
    for (int p : table.blocks[b].params) {
      if (p < 0 || p >= static_cast<int>(held.size()) || held[p]) continue;
      held[p] = true;
      sums.param_bytes += table.param_bytes[p];
      if (p < static_cast<int>(table.param_trainable.size()) && table.param_trainable[p]) {
        sums.trainable_bytes += table.param_bytes[p];
      }
    }
  }
  return internal::FinishStage(table, links, options, begin, end, replicas,
                               internal::Inflight(options.schedule, stages_after, micro_batches),
                               mb, sums);
}

double Objective(const std::vector<StageEval>& stages, int micro_batches) {
  double max_time = 0, sum_time = 0, max_allreduce = 0;
  for (const StageEval& s : stages) {
    max_time = std::max(max_time, s.time_ms);
    sum_time += s.time_ms;
    max_allreduce = std::max(max_allreduce, s.allreduce_ms);
  }
  return (micro_batches - 1) * max_time + sum_time + max_allreduce;
}

}  // namespace planner
}  // namespace rannc
