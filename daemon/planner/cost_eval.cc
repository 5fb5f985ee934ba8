#include "daemon/planner/cost_eval.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <vector>

#include "daemon/planner/cost_eval_internal.h"

namespace rannc {
namespace planner {
namespace {

uint64_t ClampBytes(double bytes) {
  if (!(bytes > 0)) return 0;
  return static_cast<uint64_t>(std::llround(bytes));
}

double ClampMs(double ms) { return ms > 0 ? ms : 0; }

// Tensor p's bytes on the device where a streamed block holds it (CostTable::
// param_streamed_bytes).
double StreamedBytes(const CostTable& table, int p) {
  return p < static_cast<int>(table.param_streamed_bytes.size())
             ? static_cast<double>(table.param_streamed_bytes[p])
             : static_cast<double>(table.param_bytes[p]);
}

// The bytes of the narrower copies planning block b's forward makes of its trainable
// parameters for a low-precision read (the graph's casts, among its profiled activations),
// which a streamed block holding the parameter in that dtype does not make; a tensor that
// `not_streamed` marks (StreamedBlocks) is read through its copy.
double LowCopyBytes(const CostTable& table, int b, const std::vector<bool>& not_streamed) {
  double bytes = 0;
  for (int p : table.blocks[b].params) {
    if (p < 0 || p >= static_cast<int>(table.param_streamed_bytes.size()) ||
        !table.param_trainable[p] ||
        (p < static_cast<int>(not_streamed.size()) && not_streamed[p])) {
      continue;
    }
    const double held = StreamedBytes(table, p);
    if (held < static_cast<double>(table.param_bytes[p])) bytes += held;
  }
  return bytes;
}

// Per tensor of the cost table, the first and the last planning block that read it (-1: none).
struct Readers {
  std::vector<int> first, last;
  // True where a block outside [begin, end) reads tensor p (blocks read in order).
  bool Outside(size_t p, int begin, int end) const {
    return first[p] >= 0 && (first[p] < begin || last[p] >= end);
  }
};
Readers ReadersOf(const CostTable& table) {
  Readers r;
  r.first.assign(table.param_bytes.size(), -1);
  r.last.assign(table.param_bytes.size(), -1);
  for (int b = 0; b < static_cast<int>(table.blocks.size()); ++b) {
    for (int p : table.blocks[b].params) {
      if (p < 0 || p >= static_cast<int>(r.first.size())) continue;
      if (r.first[p] < 0) r.first[p] = b;
      r.last[p] = b;
    }
  }
  return r;
}

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

DeviceMemory StageDeviceMemory(const SearchOptions& options, const MemoryTerms& t,
                               int replicas, int inflight, int micro_batches, bool recompute) {
  // Streamed (offload's blocks): two blocks' parameters and three blocks' gradients at most,
  // and those of the parameters not streamed throughout.
  const bool streamed = t.streamed_block > 0;
  const double R = std::min(t.trainable, t.streamed_resident);
  const double B3 = streamed ? std::min(t.trainable - R, t.streamed_grads) : 0.0;
  const double G = streamed ? R + B3 : t.trainable;
  const double params =
      streamed ? t.params - t.trainable + R + std::min(t.trainable - R, t.streamed_params)
               : t.params;
  // The runtime shards only stages with several replicas.
  const bool zero = options.zero && replicas > 1;
  const double state =
      options.offload ? 0.0 : G * options.optimizer_state_factor / (zero ? replicas : 1);
  double buckets = replicas > 1 && !zero ? G : 0.0;
  const double X = t.act + t.casts;
  const double I = t.input;
  const double K = recompute ? I : X + I;  // kept per micro-batch in flight
  const double k = inflight;
  if (recompute && streamed && t.streamed_act_peak > 0) {
    // Recomputed block by block: every micro-batch in flight keeps its blocks' inputs, and one
    // block's forward reruns at a time, with its gradients.
    DeviceMemory m;
    m.total = params + state + buckets + k * (I + t.streamed_kept) + t.streamed_act_peak + G;
    m.scaled = k * (I + t.streamed_kept) + t.streamed_act_peak;
    m.streamed_grads = B3;
    return m;
  }
  // A micro-batch's forward and backward, working memory included; its input is apart.
  const double U = t.act_peak;
  // The first backward: gradients allocated as the activations of later blocks are freed.
  const double T = std::max(G, streamed ? t.act_peak + G : t.grad_act_peak);
  double dynamic;
  if (zero) {
    // The flat gradient is allocated before the first backward.
    dynamic = std::max(G + (k - 1) * K + I + U, G + G / replicas);
  } else {
    dynamic = (k - 1) * K + I + T;
    if (micro_batches > 1) {
      // Later micro-batches run with the gradients in place: j in flight (forwards follow the
      // first backward when m > k), one of them running.
      const double j = micro_batches > inflight ? k : k - 1;
      dynamic = std::max(dynamic, recompute ? G + j * I + U : G + (j - 1) * K + I + U);
    }
    if (options.offload && micro_batches > 1) {
      // Offloaded, the reducer allocates its buckets for the device's last backward only,
      // when the last micro-batch alone is in flight.
      dynamic = std::max(dynamic, G + buckets + I + U);
      buckets = 0;
    }
  }
  DeviceMemory m;
  m.total = params + state + buckets + dynamic;
  m.scaled = (k - 1) * (recompute ? I : t.act + I) + I + t.act_peak_scaled;
  m.streamed_grads = B3;
  return m;
}

StreamedBlocks StreamedBlocksOf(const CostTable& table, int begin, int end, double max_bytes) {
  StreamedBlocks out;
  const int tensors = static_cast<int>(table.param_bytes.size());
  std::vector<int> in_block(tensors, -1);  // the last block that reads a tensor
  std::vector<int> readers(tensors, 0);    // the blocks that read it
  // What the runtime never streams: a tensor another stage reads too (every holder steps its
  // copy on the host), or one read by several of the stage's blocks (marked below).
  std::vector<bool>& resident = out.not_streamed;
  const Readers model = ReadersOf(table);
  resident.assign(tensors, false);
  for (int p = 0; p < tensors; ++p) resident[p] = model.Outside(p, begin, end);
  std::vector<std::vector<int>> block_params;  // per runtime block, the tensors it reads
  double bytes = 0;
  auto read = [&](const std::vector<int>& params, double cut) {
    double more = 0;
    const int current = static_cast<int>(block_params.size()) - 1;
    for (int p : params) {
      if (p < 0 || p >= tensors || (current >= 0 && in_block[p] == current)) continue;
      more += static_cast<double>(table.param_bytes[p]);
    }
    if (more == 0) return;
    if (block_params.empty() || (bytes > 0 && bytes + more > max_bytes)) {
      if (!block_params.empty()) out.inputs_per_sample += cut;
      block_params.emplace_back();
      bytes = 0;
    }
    const int block = static_cast<int>(block_params.size()) - 1;
    for (int p : params) {
      if (p < 0 || p >= tensors || in_block[p] == block) continue;
      in_block[p] = block;
      ++readers[p];
      block_params.back().push_back(p);
    }
    bytes += more;
  };
  for (int b = begin; b < end; ++b) {
    const Block& blk = table.blocks[b];
    if (blk.param_reads.empty()) {
      read(blk.params, CutBytes(table, b));
    } else {
      for (const Block::ParamRead& r : blk.param_reads) read(r.params, r.cut_bytes_per_sample);
    }
  }
  out.count = static_cast<int>(block_params.size());
  for (int p = 0; p < tensors; ++p) {
    if (readers[p] > 1) resident[p] = true;
  }
  // Per runtime block: its streamed trainable bytes as the masters have them, and as the
  // device holds them.
  std::vector<double> trainable(out.count, 0.0), held(out.count, 0.0);
  for (int i = 0; i < out.count; ++i) {
    for (int p : block_params[i]) {
      if (p >= static_cast<int>(table.param_trainable.size()) || !table.param_trainable[p]) {
        continue;
      }
      if (resident[p]) {
        if (in_block[p] == i) out.resident += static_cast<double>(table.param_bytes[p]);
        continue;
      }
      trainable[i] += static_cast<double>(table.param_bytes[p]);
      held[i] += StreamedBytes(table, p);
    }
  }
  for (int i = 0; i < out.count; ++i) {
    const double two = held[i] + (i + 1 < out.count ? held[i + 1] : 0.0);
    const double three = two + (i + 2 < out.count ? held[i + 2] : 0.0);
    out.largest = std::max(out.largest, trainable[i]);
    out.largest_pair = std::max(out.largest_pair, two);
    out.largest_triple = std::max(out.largest_triple, three);
  }
  return out;
}

StreamedRecomputeTerms StreamedRecompute(const CostTable& table, double cast_factor, int begin,
                                         int end, int64_t mb, double block_bytes,
                                         double inputs_per_sample,
                                         const std::vector<bool>& not_streamed) {
  StreamedRecomputeTerms out;
  if (end - begin < 2 || block_bytes <= 0) return out;
  std::vector<double> bytes, act, work;  // per planning block of the stage
  for (int b = begin; b < end; ++b) {
    double read = 0;
    for (int p : table.blocks[b].params) {
      if (p >= 0 && p < static_cast<int>(table.param_trainable.size()) &&
          table.param_trainable[p]) {
        read += static_cast<double>(table.param_bytes[p]);
      }
    }
    const BlockProfile profile = ProfileAt(table.blocks[b], mb);
    bytes.push_back(read);
    const double copies = LowCopyBytes(table, b, not_streamed);
    act.push_back(std::max(0.0, static_cast<double>(profile.act_bytes) - copies) +
                  cast_factor * read);
    work.push_back(static_cast<double>(profile.peak_bytes));
  }
  const int n = end - begin;
  // A window of block_bytes parameter bytes from planning block i on (step 1) or back (-1).
  auto window = [&](int i, int step) {
    double used = 0, window_act = 0, window_work = 0;
    for (int j = i; j >= 0 && j < n; j += step) {
      const double share = bytes[j] > 0 ? std::min(1.0, (block_bytes - used) / bytes[j]) : 1.0;
      if (share <= 0) break;
      window_act += share * act[j];
      window_work = std::max(window_work, work[j]);
      used += share * bytes[j];
      if (share < 1) break;
    }
    return window_act + window_work;
  };
  out.act_peak_from.assign(n, 0.0);
  for (int i = 0; i < n; ++i) {
    out.act_peak_from[i] = std::max(window(i, 1), window(i, -1));
    out.act_peak = std::max(out.act_peak, out.act_peak_from[i]);
  }
  out.kept = inputs_per_sample * static_cast<double>(mb);
  return out;
}

std::vector<BlockBackward> StreamedBackward(const CostTable& table, double cast_factor,
                                            int begin, int end, int64_t mb,
                                            const std::vector<double>& recomputed_act_peak_from,
                                            double* keepable) {
  const int n = end - begin;
  // Each parameter's first and last reader over the whole model: one that a block outside
  // the stage reads too is never kept (the runtime steps those on the host).
  const Readers model = ReadersOf(table);
  const std::vector<int>& first = model.first;
  const std::vector<int>& last = model.last;
  std::vector<double> first_read(n, 0.0), last_read(n, 0.0);
  for (size_t p = 0; p < first.size(); ++p) {
    if (first[p] < 0 || model.Outside(p, begin, end) || p >= table.param_trainable.size() ||
        !table.param_trainable[p]) {
      continue;
    }
    first_read[first[p] - begin] += static_cast<double>(table.param_bytes[p]);
    last_read[last[p] - begin] += static_cast<double>(table.param_bytes[p]);
  }
  std::vector<BlockBackward> out(n);
  double act = 0, casts = 0, first_before = 0, last_before = 0;
  std::vector<bool> seen(first.size(), false);
  for (int i = 0; i < n; ++i) {
    const BlockProfile profile = ProfileAt(table.blocks[begin + i], mb);
    act += static_cast<double>(profile.act_bytes);
    for (int p : table.blocks[begin + i].params) {  // AddBlock's casts: the stage's first reads
      if (p < 0 || p >= static_cast<int>(seen.size()) || seen[p]) continue;
      seen[p] = true;
      if (p < static_cast<int>(table.param_trainable.size()) && table.param_trainable[p]) {
        casts += cast_factor * static_cast<double>(table.param_bytes[p]);
      }
    }
    out[i].act = recomputed_act_peak_from.empty()
                     ? act + casts + static_cast<double>(profile.peak_bytes)
                     : recomputed_act_peak_from[i];
    out[i].first_before = first_before;
    out[i].last_before = last_before;
    first_before += first_read[i];
    last_before += last_read[i];
    out[i].first_through = first_before;
  }
  *keepable = first_before;
  return out;
}

KeptTerms KeepOnDevice(const std::vector<BlockBackward>& blocks, double act, double total,
                       double trainable, double limit, double state_factor, double streaming,
                       double block) {
  KeptTerms out;
  out.memory = total;
  const double most = std::floor(limit);
  const double room = most - std::ceil(total);
  if (!(room > 0) || trainable <= 0) return out;
  const double held = 1.0 + state_factor;  // a master and its state, for good
  if (blocks.empty()) {
    // Every gradient throughout: total + kept (2 + state_factor).
    out.bytes = std::min(trainable, std::floor(room / (held + 1.0)));
    out.memory = total + out.bytes * (held + 1.0);
    return out;
  }
  // While the backward runs block i, the device holds M_i = total - act + act_i, less
  // `streaming` where block i's runtime block is kept, besides the kept bytes' h_i(k) = k held
  // + g_i(k), g_i(k) = min(k, e) for k <= f, k - l above, with f and l the bytes read first and
  // last before i, e = f - l: each h_i is increasing and piecewise linear.
  streaming = std::max(0.0, std::floor(streaming));
  auto grads = [](const BlockBackward& b, double k) {
    const double e = b.first_before - b.last_before;
    return k <= b.first_before ? std::min(k, e) : k - b.last_before;
  };
  // Block i's runtime block is kept once k covers it, or everything keepable: then nothing
  // streams.
  auto kept_run = [&](const BlockBackward& b, double k) {
    return streaming > 0 && k >= std::min(b.first_through + block, trainable);
  };
  auto others = [&](const BlockBackward& b, double k) {  // M_i, rounded up
    return std::ceil(total - act + b.act) - (kept_run(b, k) ? streaming : 0.0);
  };
  // The largest k with h_i(k) <= r.
  auto largest = [&](const BlockBackward& b, double r) {
    const double e = b.first_before - b.last_before;
    double k;
    if (r <= e * (held + 1.0)) {
      k = r / (held + 1.0);
    } else if (r <= b.first_before * held + e) {
      k = (r - e) / held;
    } else {
      k = (r + b.last_before) / (held + 1.0);
    }
    return std::floor(std::max(0.0, k));
  };
  // Block i's backward has room for k in [0, K_i], and, where its runtime block turns kept, in
  // [first_through + block, K'_i] too (K'_i: with `streaming` more room). The largest k in the
  // room of every block is one of those ends or `trainable`; each is tried against every block
  // (an end that rounding put a byte too far, one less).
  std::vector<double> candidates = {std::floor(trainable)};
  for (const BlockBackward& b : blocks) {
    const double r = most - std::ceil(total - act + b.act);
    for (double extra : {0.0, streaming}) {
      const double k = std::min(std::floor(trainable), largest(b, r + extra));
      candidates.push_back(k);
      candidates.push_back(std::max(0.0, k - 1.0));
      if (streaming == 0) break;
    }
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<double>());
  double kept = 0;
  for (double k : candidates) {
    const bool fits = std::all_of(blocks.begin(), blocks.end(), [&](const BlockBackward& b) {
      return others(b, k) + k * held + grads(b, k) <= most;
    });
    if (fits) {
      kept = k;
      break;
    }
  }
  out.bytes = kept;
  // The forward's: no gradients (`streaming` is at least the streamed ones total counts).
  out.memory = total - streaming + kept * held;
  for (const BlockBackward& b : blocks) {
    const double here = total - act + b.act - (kept_run(b, kept) ? streaming : 0.0);
    out.memory = std::max(out.memory, here + kept * held + grads(b, kept));
  }
  return out;
}

StageEval FinishStage(const CostTable& table, const Links& links, const SearchOptions& options,
                      int begin, int end, int replicas, int inflight, int micro_batches,
                      int64_t mb, const StageSums& sums) {
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

  const double input = begin > 0 ? CutBytes(table, begin) * mbd : 0.0;
  const double limit =
      static_cast<double>(options.device_memory_bytes) * (1.0 - options.mem_margin);
  MemoryTerms terms;
  terms.params = static_cast<double>(sums.param_bytes);
  terms.trainable = static_cast<double>(sums.trainable_bytes);
  terms.act = static_cast<double>(sums.act_bytes);
  terms.casts = sums.casts;
  terms.input = input;
  terms.grad_act_peak = sums.grad_act_peak;
  terms.act_peak = sums.act_peak;
  terms.act_peak_scaled = sums.act_peak_scaled;
  StreamedBlocks runtime_blocks;
  if (options.offload) e.offload_blocks = 1;
  if (options.offload && replicas == 1 && options.offload_block_bytes > 0) {
    // A stage within one block's bytes is uploaded at once (one runtime block).
    runtime_blocks = StreamedBlocksOf(table, begin, end, options.offload_block_bytes);
    e.offload_blocks = std::max(1, runtime_blocks.count);
    if (runtime_blocks.count > 1) {
      terms.streamed_block = runtime_blocks.largest;
      terms.streamed_params = runtime_blocks.largest_pair;
      terms.streamed_grads = runtime_blocks.largest_triple;
      terms.streamed_resident = runtime_blocks.resident;
      // What the forward saves of a parameter held in its read dtype is the parameter, freed
      // between its block's uses.
      double low = 0;
      for (int b = begin; b < end; ++b) {
        low += LowCopyBytes(table, b, runtime_blocks.not_streamed);
      }
      terms.act = std::max(0.0, terms.act - low);
    }
  }
  auto memory_of = [&](bool recompute) {
    return StageDeviceMemory(options, terms, replicas, inflight, micro_batches, recompute);
  };
  DeviceMemory memory = memory_of(false);
  StreamedRecomputeTerms blocked;
  if (memory.total > limit && options.allow_recompute) {
    if (terms.streamed_block > 0) {
      blocked = StreamedRecompute(table, options.amp_cast_factor, begin, end, mb,
                                  terms.streamed_block, runtime_blocks.inputs_per_sample,
                                  runtime_blocks.not_streamed);
      terms.streamed_kept = blocked.kept;
      terms.streamed_act_peak = blocked.act_peak;
    }
    memory = memory_of(true);
    e.recompute = true;
    e.bwd_ms += e.fwd_ms;
  }
  // What streams over the link and steps on the host: the trainable bytes not kept on the
  // device, where the limit leaves room (kept whole: memory.total stays within the limit).
  double streamed = terms.trainable;
  if (terms.streamed_block > 0 && options.offload_keep_on_device &&
      std::ceil(memory.total) < std::floor(limit)) {
    // One micro-batch: the kept gradients appear as the backward reaches their blocks (block
    // by block recomputed, or with every activation kept); otherwise they are counted whole.
    const bool windows = e.recompute && terms.streamed_act_peak > 0;
    const bool by_block = micro_batches == 1 && (windows || !e.recompute);
    double keepable = 0;  // the trainable bytes no other stage reads
    std::vector<BlockBackward> blocks =
        StreamedBackward(table, options.amp_cast_factor, begin, end, mb,
                         windows ? blocked.act_peak_from : std::vector<double>{}, &keepable);
    if (!by_block) blocks.clear();
    // A kept runtime block's backward holds none of the two blocks' parameters and three
    // blocks' gradients memory.total counts for streaming, but for the two blocks' gradients
    // whose copies to the host may still be under way: three blocks' worth less.
    const double streaming = memory.streamed_grads;
    const KeptTerms kept =
        KeepOnDevice(blocks, windows ? terms.streamed_act_peak : terms.act_peak, memory.total,
                     keepable, limit, options.optimizer_state_factor, streaming,
                     runtime_blocks.largest);
    e.kept_bytes = static_cast<uint64_t>(kept.bytes);
    memory.total = kept.memory;
    streamed -= kept.bytes;
  }
  if (terms.streamed_block > 0) {
    // Streamed: every micro-batch fetches each block's parameters before its forward and again
    // before its backward, and copies each block's gradients to the host as its backward ends.
    const double host = links.host_bytes_per_s > 0 ? links.host_bytes_per_s
                                                   : links.p2p_bytes_per_s;
    const double pass_ms = streamed * options.offload_wire_factor / host * 1000.0;
    if (options.overlap_host_copies) {
      // Uploads on one side stream, gradients' copies on another, both beside the compute:
      // the slowest of the three paces a pass.
      e.fwd_ms = std::max(e.fwd_ms, pass_ms);
      e.bwd_ms = std::max(e.bwd_ms, pass_ms);
    } else {
      // Copies on the device's own thread; a CPU device's gradients are on the host already.
      e.fwd_ms += pass_ms;
      e.bwd_ms += pass_ms;
    }
    if (micro_batches > 1 && links.host_memory_bytes_per_s > 0) {
      // The gradients of every micro-batch after the first are added on the host to the sum
      // so far, on the device's thread (two read, one written): (m - 1) / m of such a pass a
      // micro-batch.
      e.bwd_ms += (micro_batches - 1.0) / micro_batches * 3.0 * streamed /
                  links.host_memory_bytes_per_s * 1000.0;
    }
  }
  if (options.offload && links.host_step_bytes_per_s > 0) {
    const double touched = (3.0 + 2.0 * options.optimizer_state_factor) * streamed /
                           (options.zero && replicas > 1 ? replicas : 1);
    const double step_ms = touched / links.host_step_bytes_per_s * 1000.0;
    // Streamed, the first micro-batch's forward waits for each block's unit of the step only.
    e.host_step_ms = terms.streamed_block > 0 ? std::max(0.0, step_ms - e.fwd_ms) : step_ms;
  }
  e.memory_bytes = static_cast<uint64_t>(std::ceil(memory.total));
  const double fixed = std::max(0.0, memory.total - memory.scaled);
  e.fixed_bytes = std::min(e.memory_bytes, static_cast<uint64_t>(std::floor(fixed)));
  e.feasible = static_cast<double>(e.memory_bytes) <= limit;
  e.time_ms = e.fwd_ms + e.bwd_ms + e.comm_ms;
  if (replicas > 1) {
    const double bandwidth = AllreduceBandwidth(links, replicas);
    auto reduce_ms = [&](double bytes) {
      return (links.allreduce_latency_s + bytes / bandwidth) * 1000.0;
    };
    const double trainable = static_cast<double>(sums.trainable_bytes);
    e.allreduce_ms = reduce_ms(trainable);
    if (options.overlap_allreduce) {
      // Hidden behind the last backward (recomputation included), but for the last bucket.
      const double last_bucket = reduce_ms(std::min(trainable, options.allreduce_bucket_bytes));
      e.allreduce_ms = std::max(e.allreduce_ms - e.bwd_ms, last_bucket);
    }
  }
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
  // Per parameter: the last block that read it (-1: none yet).
  std::vector<int> read_by(table.param_bytes.size(), -1);
  for (int b = begin; b < end; ++b) {
    double new_trainable = 0, reread_trainable = 0;
    for (int p : table.blocks[b].params) {
      if (p < 0 || p >= static_cast<int>(read_by.size()) || read_by[p] == b) continue;
      const bool trainable =
          p < static_cast<int>(table.param_trainable.size()) && table.param_trainable[p];
      const double bytes = trainable ? static_cast<double>(table.param_bytes[p]) : 0.0;
      if (read_by[p] < 0) {
        sums.param_bytes += table.param_bytes[p];
        if (trainable) sums.trainable_bytes += table.param_bytes[p];
        new_trainable += bytes;
      } else {
        reread_trainable += bytes;
      }
      read_by[p] = b;
    }
    internal::AddBlock(ProfileAt(table.blocks[b], mb), new_trainable, reread_trainable,
                       options.amp_cast_factor, &sums);
  }
  return internal::FinishStage(table, links, options, begin, end, replicas,
                               internal::Inflight(options.schedule, stages_after, micro_batches),
                               micro_batches, mb, sums);
}

double Objective(const std::vector<StageEval>& stages, int micro_batches) {
  double max_time = 0, sum_time = 0, max_per_step = 0;
  for (const StageEval& s : stages) {
    max_time = std::max(max_time, s.time_ms);
    sum_time += s.time_ms;
    max_per_step = std::max(max_per_step, s.per_step_ms());
  }
  return (micro_batches - 1) * max_time + sum_time + max_per_step;
}

}  // namespace planner
}  // namespace rannc
