// Pieces of EvaluateStage shared with the search, which builds a stage's sums incrementally
// (one block at a time as the stage grows) instead of re-summing every range. Both paths add
// the blocks in the same order, so they give bit-identical StageEvals. Not a public API: only
// planner code includes this.
//
// Pure functions; safe from any thread.
//
//   StageSums sums;
//   for (int b = begin; b < end; ++b) AddBlockProfile(ProfileAt(table.blocks[b], mb), &sums);
//   ... add the union of the blocks' params to sums.param_bytes / trainable_bytes ...
//   StageEval e = FinishStage(table, links, options, begin, end, replicas, inflight, mb, sums);
#ifndef RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_
#define RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_

#include <cstdint>

#include "daemon/planner/cost_eval.h"
#include "daemon/planner/cost_table.h"

namespace rannc {
namespace planner {
namespace internal {

struct StageSums {
  double fwd_ms = 0;
  double bwd_ms = 0;
  uint64_t act_bytes = 0;
  uint64_t peak_bytes = 0;
  uint64_t param_bytes = 0;
  uint64_t trainable_bytes = 0;
};

inline void AddBlockProfile(const BlockProfile& p, StageSums* sums) {
  sums->fwd_ms += p.fwd_ms;
  sums->bwd_ms += p.bwd_ms;
  sums->act_bytes += p.act_bytes;
  if (p.peak_bytes > sums->peak_bytes) sums->peak_bytes = p.peak_bytes;
}

// ceil(batch / (micro_batches * replicas)), or 0 when the batch cannot give every replica of
// every micro-batch at least one sample.
int64_t MicroBatchPerDevice(int64_t batch_size, int micro_batches, int replicas);

// Micro-batches whose activations a stage holds at once.
int Inflight(Schedule schedule, int stages_after, int micro_batches);

// cut_bytes_per_sample[boundary], 0 when the table has no entry (index 0, or a short vector).
double CutBytes(const CostTable& table, int boundary);

// The StageEval of blocks [begin, end) whose per-block sums at `mb` are `sums`. mb must be > 0.
StageEval FinishStage(const CostTable& table, const Links& links, const SearchOptions& options,
                      int begin, int end, int replicas, int inflight, int64_t mb,
                      const StageSums& sums);

}  // namespace internal
}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_
