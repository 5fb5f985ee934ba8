#include "daemon/planner/search.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/planner/cost_eval_internal.h"
#include "daemon/planner/schedule_sim.h"

namespace rannc {
namespace planner {
namespace {

using internal::StageSums;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Pruning keeps anything whose lower bound is within this of the best plan so far, so plans
// that tie with it (up to rounding) survive to the tie-breaking.
constexpr double kPruneTol = 1e-9;
// Objectives this close (relative) are ties, decided by stage count, micro-batches, devices.
constexpr double kTieTol = 1e-12;

// The failure message's exact memory search costs about this many stage evaluations at most;
// beyond it a cheaper per-block lower bound is reported instead.
constexpr double kMaxMemorySearchWork = 3e8;

struct Limits {
  int n = 0;        // blocks
  int devices = 0;  // num_devices
  int max_stages = 0;
  int r_min = 1, r_max = 1;    // replicas per stage
  std::vector<int> micro_batches;  // the m to try, ascending
};

double GiB(double bytes) { return bytes / static_cast<double>(1ull << 30); }

absl::Status Validate(const CostTable& t, const SearchOptions& o, Limits* lim) {
  const int n = static_cast<int>(t.blocks.size());
  if (n == 0) return absl::InvalidArgumentError("the cost table has no blocks; profile the model first");
  if (t.param_trainable.size() != t.param_bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cost table: param_trainable has ", t.param_trainable.size(), " entries but param_bytes has ",
        t.param_bytes.size(), "; they must describe the same tensors"));
  }
  if (t.cut_bytes_per_sample.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cost table: cut_bytes_per_sample has ", t.cut_bytes_per_sample.size(),
        " entries but there are ", n, " blocks; it needs one per block (index 0 unused)"));
  }
  for (int b = 0; b < n; ++b) {
    for (int p : t.blocks[b].params) {
      if (p < 0 || p >= static_cast<int>(t.param_bytes.size())) {
        return absl::InvalidArgumentError(absl::StrCat("cost table: block ", b, " reads param ", p,
                                                       " but there are only ",
                                                       t.param_bytes.size(), " params"));
      }
    }
  }
  if (o.batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", o.batch_size));
  }
  if (o.num_devices < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_devices must be >= 1, got ", o.num_devices));
  }
  if (o.device_memory_bytes == 0) {
    return absl::InvalidArgumentError("device_memory_bytes must be > 0");
  }
  if (!(o.mem_margin >= 0 && o.mem_margin < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mem_margin must be in [0, 1) (a fraction of device memory), got ", o.mem_margin));
  }
  if (!(o.optimizer_state_factor >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer_state_factor must be >= 0 (0 SGD, 1 momentum, 2 Adam), got ",
        o.optimizer_state_factor));
  }
  if (o.partition_num < 0 || o.partition_num > n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition_num ", o.partition_num, " is impossible: the model has ", n,
        " blocks, so use 1..", n, " stages (or 0 to search)"));
  }
  if (o.partition_num > o.num_devices) {
    return absl::InvalidArgumentError(absl::StrCat("partition_num ", o.partition_num,
                                                   " needs at least that many devices but num_devices is ",
                                                   o.num_devices));
  }
  if (o.replica_num < 0 || o.replica_num > o.num_devices) {
    return absl::InvalidArgumentError(absl::StrCat("replica_num ", o.replica_num,
                                                   " is impossible with num_devices ", o.num_devices,
                                                   " (use 1..", o.num_devices, ", or 0 to search)"));
  }
  if (o.replica_num > 0 && o.partition_num > 0 &&
      static_cast<int64_t>(o.replica_num) * o.partition_num > o.num_devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_num ", o.replica_num, " * partition_num ", o.partition_num, " = ",
        static_cast<int64_t>(o.replica_num) * o.partition_num, " devices but num_devices is ",
        o.num_devices));
  }
  if (o.pipeline_num < 0 || o.pipeline_num > o.batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_num ", o.pipeline_num, " is impossible with batch_size ", o.batch_size,
        ": every micro-batch needs at least one sample (use 1..", o.batch_size, ", or 0 to search)"));
  }
  if (o.pipeline_num > 0 && o.replica_num > 0 &&
      static_cast<int64_t>(o.pipeline_num) * o.replica_num > o.batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_num ", o.pipeline_num, " * replica_num ", o.replica_num,
        " exceeds batch_size ", o.batch_size, ": every replica of every micro-batch needs a sample"));
  }
  if (o.pipeline_num == 0 && o.max_pipeline < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_pipeline must be >= 1, got ", o.max_pipeline));
  }

  lim->n = n;
  lim->devices = o.num_devices;
  lim->max_stages = o.partition_num > 0 ? o.partition_num : std::min(n, o.num_devices);
  lim->r_min = o.replica_num > 0 ? o.replica_num : 1;
  lim->r_max = o.replica_num > 0 ? o.replica_num : o.num_devices;
  if (o.replica_num > 0) {
    lim->max_stages = std::min(lim->max_stages, o.num_devices / o.replica_num);
  }
  if (o.use_all_devices && o.replica_num > 0) {
    const int stages = o.num_devices / o.replica_num;
    const bool divides = o.num_devices % o.replica_num == 0;
    const bool allowed = o.partition_num > 0 ? stages == o.partition_num : stages <= n;
    if (!divides || !allowed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "use_all_devices with replica_num ", o.replica_num, " needs a stage count s with s * ",
          o.replica_num, " = num_devices ", o.num_devices,
          o.partition_num > 0 ? absl::StrCat(" and s = partition_num ", o.partition_num)
                              : absl::StrCat(" and s <= ", n, " blocks"),
          "; change replica_num or drop use_all_devices"));
    }
  }
  if (o.pipeline_num > 0) {
    lim->micro_batches = {o.pipeline_num};
  } else {
    const int64_t top = std::min<int64_t>(o.max_pipeline, o.batch_size);
    for (int m = 1; m <= top; ++m) lim->micro_batches.push_back(m);
  }
  return absl::OkStatus();
}

// ProfileAt of every block, cached per micro-batch size (the search asks for few sizes, often).
class ProfileCache {
 public:
  explicit ProfileCache(const CostTable& t) : table_(t) {}
  const std::vector<BlockProfile>& At(int64_t mb) {
    auto it = cache_.find(mb);
    if (it != cache_.end()) return it->second;
    std::vector<BlockProfile>& v = cache_[mb];
    v.reserve(table_.blocks.size());
    for (const Block& b : table_.blocks) v.push_back(ProfileAt(b, mb));
    return v;
  }

 private:
  const CostTable& table_;
  std::unordered_map<int64_t, std::vector<BlockProfile>> cache_;
};

// A stage's sums as it grows one block at a time; adds blocks in the same order as
// EvaluateStage, so the results are identical to it.
class StageGrower {
 public:
  StageGrower(const CostTable& t, double cast_factor)
      : table_(t), cast_factor_(cast_factor), seen_(t.param_bytes.size(), 0),
        read_(t.param_bytes.size(), 0) {}
  void Start() {
    sums_ = StageSums{};
    ++stamp_;
  }
  void Add(int block, const BlockProfile& p) {
    ++block_stamp_;
    double new_trainable = 0, reread_trainable = 0;
    for (int q : table_.blocks[block].params) {
      if (read_[q] == block_stamp_) continue;
      read_[q] = block_stamp_;
      const double bytes =
          table_.param_trainable[q] ? static_cast<double>(table_.param_bytes[q]) : 0.0;
      if (seen_[q] != stamp_) {
        seen_[q] = stamp_;
        sums_.param_bytes += table_.param_bytes[q];
        if (table_.param_trainable[q]) sums_.trainable_bytes += table_.param_bytes[q];
        new_trainable += bytes;
      } else {
        reread_trainable += bytes;
      }
    }
    internal::AddBlock(p, new_trainable, reread_trainable, cast_factor_, &sums_);
  }
  const StageSums& sums() const { return sums_; }

 private:
  const CostTable& table_;
  double cast_factor_;
  std::vector<uint64_t> seen_;  // == stamp_: read by an earlier block of this stage
  std::vector<uint64_t> read_;  // == block_stamp_: counted for the block being added
  uint64_t stamp_ = 0;
  uint64_t block_stamp_ = 0;
  StageSums sums_;
};

// Fronts indexed by (first block of the suffix, devices the suffix uses, stages in it).
class StateIndex {
 public:
  StateIndex(int n, int devices, int stages) : d_(devices + 1), k_(stages + 1) {
    size_ = static_cast<size_t>(n + 1) * d_ * k_;
  }
  size_t operator()(int b, int d, int k) const {
    return (static_cast<size_t>(b) * d_ + d) * k_ + k;
  }
  size_t size() const { return size_; }

 private:
  size_t d_, k_, size_;
};

// A suffix of the pipeline: its slowest stage time, sum of stage times, slowest all-reduce and
// stage count, and how it was built (its first stage is blocks [b, end) on `replicas` devices,
// followed by entry `child` of the state (end, d - replicas, ...)).
struct Entry {
  double max_t, sum_t, max_ar;
  int stages;
  int end, replicas, child;
};

bool Dominates(const Entry& a, const Entry& b) {
  return a.max_t <= b.max_t && a.sum_t <= b.sum_t && a.max_ar <= b.max_ar &&
         a.stages <= b.stages;
}

// Why dropping a dominated suffix is exact: the objective is non-decreasing in max_t, sum_t
// and max_ar, and fewer stages win ties. Prepending the same stage to both keeps the order:
// fewer stages after it mean fewer micro-batches in flight (1F1B), so the stage needs no more
// memory and recomputes no more often. So whatever plan the dominated suffix completes, the
// dominating one completes at least as well.
void InsertPareto(std::vector<Entry>* front, const Entry& x) {
  for (const Entry& y : *front) {
    if (Dominates(y, x)) return;
  }
  size_t kept = 0;
  for (size_t i = 0; i < front->size(); ++i) {
    if (!Dominates(x, (*front)[i])) (*front)[kept++] = (*front)[i];
  }
  front->resize(kept);
  front->push_back(x);
}

struct Best {
  bool found = false;
  double objective = kInf;
  int stages = 0, micro_batches = 0, devices = 0;
  std::vector<StagePlan> plan;  // begin, end, replicas
};

bool Better(double obj, int stages, int m, int devices, const Best& best) {
  if (!best.found) return true;
  if (obj < best.objective * (1 - kTieTol)) return true;
  if (obj > best.objective * (1 + kTieTol)) return false;
  if (stages != best.stages) return stages < best.stages;
  if (m != best.micro_batches) return m < best.micro_batches;
  return devices > best.devices;
}

// Param and trainable bytes of each block alone (a tensor it reads twice counts once).
struct BlockParams {
  double params = 0, trainable = 0;
};

std::vector<BlockParams> ParamsPerBlock(const CostTable& table) {
  std::vector<BlockParams> out(table.blocks.size());
  std::vector<int> seen(table.param_bytes.size(), -1);
  for (size_t j = 0; j < table.blocks.size(); ++j) {
    for (int p : table.blocks[j].params) {
      if (seen[p] == static_cast<int>(j)) continue;
      seen[p] = static_cast<int>(j);
      out[j].params += static_cast<double>(table.param_bytes[p]);
      if (table.param_trainable[p]) out[j].trainable += static_cast<double>(table.param_bytes[p]);
    }
  }
  return out;
}

// What any stage holding a block needs at least, on r replicas with `inflight` of m
// micro-batches in flight: the device memory (cost_eval.h's model) of the block alone without
// an input boundary, keeping its activations (`keep`) or recomputing them (`recompute`). The
// model is non-decreasing in every byte count and in the micro-batches in flight, and a stage
// adds other blocks' bytes and its input to these, so it never needs less.
struct BlockMemory {
  double keep, recompute;
};

BlockMemory LeastBlockMemory(const SearchOptions& o, const BlockParams& bp,
                             const BlockProfile& prof, int r, int inflight, int m) {
  internal::MemoryTerms t;
  t.params = bp.params;
  t.trainable = bp.trainable;
  t.act = static_cast<double>(prof.act_bytes);
  t.casts = bp.trainable * o.amp_cast_factor;
  // No later blocks' gradients, no earlier blocks' activations: each a lower bound of a
  // stage's order-dependent peaks at this block.
  t.act_peak_scaled = t.act + static_cast<double>(prof.peak_bytes);
  t.act_peak = t.act_peak_scaled + t.casts;
  t.grad_act_peak = t.act_peak + t.trainable;
  auto memory = [&](bool recompute) {
    return internal::StageDeviceMemory(o, t, r, inflight, m, recompute).total;
  };
  return {memory(false), memory(true)};
}

// The smallest usable memory per device with which some plan would fit (the least, over plans,
// of their largest stage estimate), for the message when nothing fits. Exact when affordable,
// else a lower bound from single blocks.
// Returns kInf when no plan shape exists at all.
double LeastMemoryNeeded(const CostTable& table, const Links& links, const SearchOptions& o,
                         const Limits& lim) {
  const int n = lim.n, D = lim.devices, K = lim.max_stages;
  ProfileCache cache(table);
  StageGrower grower(table, o.amp_cast_factor);
  const double work = static_cast<double>(lim.micro_batches.size()) * n * n / 2.0 *
                      (lim.r_max - lim.r_min + 1) * K * (D + 1);
  if (work > kMaxMemorySearchWork) {
    // Every plan holds each block in some stage, which needs at least that block alone.
    const std::vector<BlockParams> bp = ParamsPerBlock(table);
    double need = 0;
    for (int b = 0; b < n; ++b) {
      double least = kInf;
      for (int m : lim.micro_batches) {
        for (int r = lim.r_min; r <= lim.r_max; ++r) {
          const int64_t mb = internal::MicroBatchPerDevice(o.batch_size, m, r);
          if (mb == 0) break;
          const BlockMemory mem = LeastBlockMemory(o, bp[b], cache.At(mb)[b], r,
                                                   internal::Inflight(o.schedule, 0, m), m);
          least = std::min(least, o.allow_recompute ? mem.recompute : mem.keep);
        }
      }
      need = std::max(need, least);
    }
    return need;
  }

  StateIndex idx(n, D, K);
  std::vector<double> need(idx.size());
  double best = kInf;
  for (int m : lim.micro_batches) {
    std::fill(need.begin(), need.end(), kInf);
    need[idx(n, 0, 0)] = 0;
    for (int b = n - 1; b >= 0; --b) {
      for (int r = lim.r_min; r <= lim.r_max; ++r) {
        const int64_t mb = internal::MicroBatchPerDevice(o.batch_size, m, r);
        if (mb == 0) break;
        const std::vector<BlockProfile>& prof = cache.At(mb);
        grower.Start();
        for (int e = b + 1; e <= n; ++e) {
          grower.Add(e - 1, prof[e - 1]);
          const int k_lo = e == n ? 1 : 2;
          const int k_hi = e == n ? 1 : std::min({K, 1 + (n - e), 1 + (D - r) / lim.r_min});
          for (int k = k_lo; k <= k_hi; ++k) {
            const StageEval ev = internal::FinishStage(
                table, links, o, b, e, r, internal::Inflight(o.schedule, k - 1, m), m, mb,
                grower.sums());
            const double mem = static_cast<double>(ev.memory_bytes);
            for (int dc = (k - 1) * lim.r_min; dc + r <= D; ++dc) {
              const double child = need[idx(e, dc, k - 1)];
              if (child == kInf) continue;
              double& parent = need[idx(b, dc + r, k)];
              parent = std::min(parent, std::max(mem, child));
            }
          }
        }
      }
    }
    for (int k = 1; k <= K; ++k) {
      if (o.partition_num > 0 && k != o.partition_num) continue;
      for (int d = 1; d <= D; ++d) {
        if (o.use_all_devices && d != D) continue;
        best = std::min(best, need[idx(0, d, k)]);
      }
    }
  }
  return best;
}

absl::Status NothingFits(const CostTable& table, const Links& links, const SearchOptions& o,
                         const Limits& lim) {
  const double usable = static_cast<double>(o.device_memory_bytes) * (1 - o.mem_margin);
  const double need = LeastMemoryNeeded(table, links, o, lim);
  if (need == kInf) {
    return absl::ResourceExhaustedError(
        "no plan exists for these options (too few devices or samples for the forced "
        "partition_num / replica_num / pipeline_num); relax the forced values");
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "no plan fits in device memory: the model needs at least %.3f GiB per device but only "
      "%.3f GiB is usable (device_memory_bytes %.3f GiB less mem_margin %.0f%%; it would take "
      "device_memory_bytes >= %.3f GiB); raise device_memory_bytes, add devices, lower "
      "batch_size or mem_margin%s%s",
      GiB(need), GiB(usable), GiB(static_cast<double>(o.device_memory_bytes)),
      100 * o.mem_margin, GiB(need / (1 - o.mem_margin)),
      o.allow_recompute ? "" : ", allow recompute",
      o.zero ? "" : ", or shard optimizer state (zero)"));
}

// Lower bounds, for one micro-batch count m, on what the blocks before b add to a plan when the
// stages holding them have q devices in all. Each such block costs at least least_j(q), its
// cheapest time over the replica counts r <= q, and occupies r devices for at least r * time:
// its least "work" w_j(q). So the stages before b add at least time[q][b] = sum_{j<b}
// least_j(q) to the sum of stage times, and the slowest of them takes at least
// work[q][b] / q (the devices are shared out) and time[q][b] / (their stage count).
//
// A block's time with r replicas is forward + backward, plus the forward again when even the
// block alone would not fit without recompute, and infinite when it would not fit at all:
// any stage holding the block needs at least the block's own memory (LeastBlockMemory), so it
// fails (or must recompute) whenever the block alone does.
class PrefixBounds {
 public:
  PrefixBounds(const CostTable& table, const SearchOptions& o, const Limits& lim, int m,
               ProfileCache* cache)
      : n_(lim.n), r_min_(lim.r_min) {
    const int D = lim.devices;
    const double limit =
        static_cast<double>(o.device_memory_bytes) * (1.0 - o.mem_margin);
    const int min_inflight = internal::Inflight(o.schedule, 0, m);
    const std::vector<BlockParams> bp = ParamsPerBlock(table);
    time_.assign(D + 1, std::vector<double>(n_ + 1, kInf));
    work_.assign(D + 1, std::vector<double>(n_ + 1, kInf));
    std::vector<double> least(n_, kInf), least_work(n_, kInf);
    for (int q = 0; q <= D; ++q) {
      const int r = q;  // the replica count newly allowed at q
      if (r >= lim.r_min && r <= lim.r_max) {
        const int64_t mb = internal::MicroBatchPerDevice(o.batch_size, m, r);
        if (mb > 0) {
          const std::vector<BlockProfile>& prof = cache->At(mb);
          for (int j = 0; j < n_; ++j) {
            const BlockMemory mem = LeastBlockMemory(o, bp[j], prof[j], r, min_inflight, m);
            const bool keeps = mem.keep <= limit;
            const bool recomputes = o.allow_recompute && mem.recompute <= limit;
            if (!keeps && !recomputes) continue;
            const double t = prof[j].fwd_ms + prof[j].bwd_ms + (keeps ? 0.0 : prof[j].fwd_ms);
            least[j] = std::min(least[j], t);
            least_work[j] = std::min(least_work[j], r * t);
          }
        }
      }
      time_[q][0] = work_[q][0] = 0;
      for (int j = 0; j < n_; ++j) {
        time_[q][j + 1] = time_[q][j] + least[j];
        work_[q][j + 1] = work_[q][j] + least_work[j];
      }
    }
  }
  // Whether blocks [0, b) can be placed at all on q devices.
  bool Possible(int b, int q) const { return b == 0 || time_[q][b] < kInf; }
  double SumTime(int b, int q) const { return time_[q][b]; }
  double MaxTime(int b, int q) const {
    if (b == 0) return 0;
    const int most_stages = std::min(b, q / r_min_);
    return std::max(work_[q][b] / q, time_[q][b] / most_stages);
  }
  // sum over blocks [e, n) of their cheapest time on any replica count.
  double SuffixTime(int e) const { return time_.back()[n_] - time_.back()[e]; }

 private:
  int n_, r_min_;
  std::vector<std::vector<double>> time_, work_;  // [q][b]
};

// For each micro-batch count in lim.micro_batches, the best objective of a few simple plans
// (balanced stages, devices shared out evenly) that meet every constraint; kInf where none is
// feasible. They give the pruning a starting bound (the search then only explores plans that
// could beat it) and the order in which to try the micro-batch counts.
std::vector<double> SimplePlansBound(const CostTable& table, const Links& links,
                                     const SearchOptions& o, const Limits& lim,
                                     ProfileCache* cache) {
  const int n = lim.n, D = lim.devices;
  std::vector<double> bounds;
  std::vector<StageEval> evals;
  for (int m : lim.micro_batches) {
    double& bound = bounds.emplace_back(kInf);
    for (int S = 1; S <= lim.max_stages; ++S) {
      if (o.partition_num > 0 && S != o.partition_num) continue;
      std::vector<int> reps(S);
      if (o.replica_num > 0) {
        if (S * o.replica_num > D || (o.use_all_devices && S * o.replica_num != D)) continue;
        std::fill(reps.begin(), reps.end(), o.replica_num);
      } else {
        if (S > D) continue;
        for (int s = 0; s < S; ++s) reps[s] = D / S + (s < D % S ? 1 : 0);
      }
      const int64_t mb = internal::MicroBatchPerDevice(o.batch_size, m, reps.back());
      if (mb == 0) continue;
      const std::vector<BlockProfile>& prof = cache->At(mb);
      std::vector<double> cum(n + 1, 0);
      for (int j = 0; j < n; ++j) cum[j + 1] = cum[j] + prof[j].fwd_ms + prof[j].bwd_ms;
      evals.clear();
      int begin = 0;
      bool ok = true;
      for (int s = 0; s < S && ok; ++s) {
        int end = begin + 1;
        while (end < n - (S - s - 1) && cum[end] < cum[n] * (s + 1) / S) ++end;
        if (s == S - 1) end = n;
        evals.push_back(EvaluateStage(table, links, o, begin, end, reps[s], S - 1 - s, m));
        ok = evals.back().feasible;
        begin = end;
      }
      if (ok) bound = std::min(bound, Objective(evals, m));
    }
  }
  return bounds;
}

}  // namespace

absl::StatusOr<Plan> SearchPlan(const CostTable& table, const Links& links,
                                const SearchOptions& options) {
  Limits lim;
  if (absl::Status s = Validate(table, options, &lim); !s.ok()) return s;
  const int n = lim.n, D = lim.devices;
  const SearchOptions& o = options;

  ProfileCache cache(table);
  StageGrower grower(table, o.amp_cast_factor);
  // With a forced stage count the fronts are kept per exact count (k = stages in the suffix);
  // otherwise the count is one more Pareto dimension and every suffix shares k = 0.
  const bool by_count = o.partition_num > 0;
  const int P = o.partition_num;
  StateIndex idx(n, D, by_count ? P : 0);
  std::vector<std::vector<Entry>> fronts(idx.size());
  Best best;
  // Try the micro-batch counts whose simple plans are best first: a good plan found early
  // tightens the bound for all the others.
  const std::vector<double> simple = SimplePlansBound(table, links, o, lim, &cache);
  const double initial_bound = *std::min_element(simple.begin(), simple.end());
  std::vector<int> order(lim.micro_batches.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&simple](int x, int y) { return simple[x] < simple[y]; });
  // Evaluations of the stage being grown, per in-flight count, computed on first use.
  std::vector<StageEval> evals;
  std::vector<uint64_t> eval_stamp;
  uint64_t stamp = 0;

  for (int mi : order) {
    const int m = lim.micro_batches[mi];
    for (auto& f : fronts) f.clear();
    fronts[idx(n, 0, 0)].push_back(Entry{0, 0, 0, 0, -1, -1, -1});
    const PrefixBounds lb(table, o, lim, m, &cache);
    if (!lb.Possible(n, D)) continue;  // this m leaves a device without samples
    const double bound = (best.found ? best.objective : initial_bound) * (1 + kPruneTol);
    const int min_inflight = internal::Inflight(o.schedule, 0, m);
    evals.assign(m + 1, StageEval{});
    eval_stamp.assign(m + 1, 0);
    // The part of the objective a suffix already fixes; fronts are sorted by it so that the
    // scan over a child front can stop at the first entry that cannot lead below the bound.
    auto key = [m](const Entry& c) { return (m - 1) * c.max_t + c.sum_t + c.max_ar; };

    // Suffixes are built from the last stage backwards, so when a stage is put in front of a
    // suffix, its stages_after (and so its in-flight micro-batches) is known.
    for (int b = n - 1; b >= 0; --b) {
      // Devices that must stay free for the stages before b.
      const int reserve = b > 0 ? lim.r_min : 0;
      for (int r = lim.r_min; r <= lim.r_max && r + reserve <= D; ++r) {
        const int64_t mb = internal::MicroBatchPerDevice(o.batch_size, m, r);
        if (mb == 0) break;  // larger r leave devices without samples too
        const std::vector<BlockProfile>& prof = cache.At(mb);
        // Bounds for the most devices the stages before b could have (the weakest bounds).
        const double pre_sum = lb.SumTime(b, D - r), pre_max = lb.MaxTime(b, D - r);
        grower.Start();
        for (int e = b + 1; e <= n; ++e) {
          grower.Add(e - 1, prof[e - 1]);
          const StageSums& sums = grower.sums();
          // Stage time only grows with e: the stage alone runs m micro-batches.
          const double least_t = sums.fwd_ms + sums.bwd_ms;
          if ((m - 1) * std::max(least_t, pre_max) + least_t + pre_sum + lb.SuffixTime(e) >
              bound) {
            break;
          }
          ++stamp;
          auto eval_at = [&](int inflight) -> const StageEval& {
            if (eval_stamp[inflight] != stamp) {
              evals[inflight] =
                  internal::FinishStage(table, links, o, b, e, r, inflight, m, mb, sums);
              eval_stamp[inflight] = stamp;
            }
            return evals[inflight];
          };
          // The fewest micro-batches in flight: the least memory and time this stage can have.
          const StageEval& first = eval_at(min_inflight);
          // A stage's memory never shrinks as it grows, so no longer stage from b fits either.
          if (!first.feasible) break;
          const double t_min = first.time_ms;
          if ((m - 1) * std::max(t_min, pre_max) + t_min + first.per_step_ms() + pre_sum +
                  lb.SuffixTime(e) >
              bound) {
            continue;
          }
          const int k_lo = by_count ? (e == n ? 1 : 2) : 0;
          const int k_hi = by_count ? (e == n ? 1 : P) : 0;
          for (int kp = k_lo; kp <= k_hi; ++kp) {
            const int kc = by_count ? kp - 1 : 0;
            for (int dc = 0; dc + r + reserve <= D; ++dc) {
              const std::vector<Entry>& child = fronts[idx(e, dc, kc)];
              if (child.empty()) continue;
              const int q = D - dc - r;  // devices left for the stages before b
              if (!lb.Possible(b, q)) continue;
              const double q_sum = lb.SumTime(b, q), q_max = lb.MaxTime(b, q);
              std::vector<Entry>& parent = fronts[idx(b, dc + r, kp)];
              for (size_t ci = 0; ci < child.size(); ++ci) {
                const Entry& c = child[ci];
                if (key(c) + t_min + q_sum > bound) break;
                const StageEval& ev = eval_at(internal::Inflight(o.schedule, c.stages, m));
                if (!ev.feasible) continue;
                const double t = ev.time_ms, ar = ev.per_step_ms();
                Entry x{std::max(t, c.max_t), t + c.sum_t, std::max(ar, c.max_ar), c.stages + 1,
                        e, r, static_cast<int>(ci)};
                if ((m - 1) * std::max(x.max_t, q_max) + x.sum_t + q_sum + x.max_ar > bound) {
                  continue;
                }
                InsertPareto(&parent, x);
              }
            }
          }
        }
      }
      // Block b's fronts are complete; sort them for the scans above (b's parents only refer
      // to them by index after this).
      for (int d = 0; d <= D; ++d) {
        for (int k = 0; k <= (by_count ? P : 0); ++k) {
          std::vector<Entry>& f = fronts[idx(b, d, k)];
          std::sort(f.begin(), f.end(),
                    [&key](const Entry& x, const Entry& y) { return key(x) < key(y); });
        }
      }
    }

    for (int d = 1; d <= D; ++d) {
      if (o.use_all_devices && d != D) continue;
      const std::vector<Entry>& front = fronts[idx(0, d, by_count ? P : 0)];
      for (size_t i = 0; i < front.size(); ++i) {
        const Entry& en = front[i];
        const double obj = key(en);
        if (!Better(obj, en.stages, m, d, best)) continue;
        best.found = true;
        best.objective = obj;
        best.stages = en.stages;
        best.micro_batches = m;
        best.devices = d;
        best.plan.clear();
        int at_b = 0, at_d = d, at_k = by_count ? P : 0, at = static_cast<int>(i);
        while (at_b < n) {
          const Entry& step = fronts[idx(at_b, at_d, at_k)][at];
          StagePlan sp;
          sp.begin = at_b;
          sp.end = step.end;
          sp.replicas = step.replicas;
          best.plan.push_back(sp);
          at_b = step.end;
          at_d -= step.replicas;
          if (by_count) --at_k;
          at = step.child;
        }
      }
    }
  }

  if (!best.found) return NothingFits(table, links, o, lim);

  Plan plan;
  plan.micro_batches = best.micro_batches;
  plan.schedule = o.schedule;
  plan.stages = best.plan;
  std::vector<StageEval> stage_evals;
  const int S = static_cast<int>(plan.stages.size());
  for (int s = 0; s < S; ++s) {
    StagePlan& sp = plan.stages[s];
    sp.eval = EvaluateStage(table, links, o, sp.begin, sp.end, sp.replicas, S - 1 - s,
                            plan.micro_batches);
    stage_evals.push_back(sp.eval);
    plan.devices_used += sp.replicas;
  }
  plan.objective_ms = Objective(stage_evals, plan.micro_batches);
  const SimResult simulated = Simulate(stage_evals, plan.micro_batches, plan.schedule);
  plan.simulated_ms = simulated.step_ms;
  plan.simulated_bubble = simulated.bubble_fraction;
  return plan;
}

}  // namespace planner
}  // namespace rannc
