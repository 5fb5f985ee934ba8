// Pieces of EvaluateStage shared with the search, which builds a stage's sums incrementally
// (one block at a time as the stage grows) instead of re-summing every range. Both paths add
// the blocks in the same order, so they give bit-identical StageEvals. Not a public API: only
// planner code includes this.
//
// Pure functions; safe from any thread.
//
//   StageSums sums;
//   for (int b = begin; b < end; ++b) {
//     ... add the params block b reads first to sums.param_bytes / trainable_bytes ...
//     AddBlock(ProfileAt(table.blocks[b], mb), new_trainable, reread_trainable,
//              options.amp_cast_factor, &sums);
//   }
//   StageEval e = FinishStage(table, links, options, begin, end, replicas, inflight,
//                             micro_batches, mb, sums);
#ifndef RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_
#define RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <vector>

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
  // What depends on the blocks' order, over the stage's blocks i so far (see EvaluateStage):
  // with A_<=i the activations of blocks up to i, X_<=i those plus the AMP weight copies made
  // by then, W_i block i's working memory and G_>=i the gradients of parameters that block i
  // or a later one reads,
  double casts = 0;            // the AMP weight copies of all the blocks (X - A)
  double grad_act_peak = 0;    // max_i G_>=i + X_<=i + W_i: the first backward's peak
  double act_peak = 0;         // max_i X_<=i + W_i: one micro-batch's peak, gradients apart
  double act_peak_scaled = 0;  // max_i A_<=i + W_i: the part of act_peak the batch scales
};

// Adds the next block: its profile and the trainable bytes of the parameters it reads that
// the stage's earlier blocks do not (`new_trainable`, already added to trainable_bytes by the
// caller) and do (`reread_trainable`). A re-read parameter's gradient is allocated at its last
// reader's backward, before the blocks between its readers; it is added to every earlier
// block's G_>=i, which over-counts it for blocks before its previous reader (an upper bound).
inline void AddBlock(const BlockProfile& p, double new_trainable, double reread_trainable,
                     double cast_factor, StageSums* sums) {
  sums->fwd_ms += p.fwd_ms;
  sums->bwd_ms += p.bwd_ms;
  sums->act_bytes += p.act_bytes;
  if (p.peak_bytes > sums->peak_bytes) sums->peak_bytes = p.peak_bytes;
  sums->casts += cast_factor * new_trainable;
  const double act = static_cast<double>(sums->act_bytes);
  const double work = static_cast<double>(p.peak_bytes);
  const double here = act + sums->casts + work;
  sums->grad_act_peak = std::max(sums->grad_act_peak, here) + new_trainable + reread_trainable;
  sums->act_peak = std::max(sums->act_peak, here);
  sums->act_peak_scaled = std::max(sums->act_peak_scaled, act + work);
}

// ceil(batch / (micro_batches * replicas)), or 0 when the batch cannot give every replica of
// every micro-batch at least one sample.
int64_t MicroBatchPerDevice(int64_t batch_size, int micro_batches, int replicas);

// Micro-batches whose activations a stage holds at once.
int Inflight(Schedule schedule, int stages_after, int micro_batches);

// cut_bytes_per_sample[boundary], 0 when the table has no entry (index 0, or a short vector).
double CutBytes(const CostTable& table, int boundary);

// What StageDeviceMemory reads, per device and micro-batch (bytes): StageSums' fields and the
// input boundary.
struct MemoryTerms {
  double params = 0;
  double trainable = 0;
  double act = 0;
  double casts = 0;
  double input = 0;
  double grad_act_peak = 0;
  double act_peak = 0;
  double act_peak_scaled = 0;
  // Offload's streaming (StreamedBlocks): the trainable bytes of the largest runtime block (B
  // above; 0: not streamed), of the two consecutive blocks whose parameters are on the device
  // at once (one computing, the next prefetched) and of the three whose gradients may be (one
  // block's backward and two earlier ones' copies to the host) at their largest.
  double streamed_block = 0;
  double streamed_params = 0;
  double streamed_grads = 0;
  // The trainable bytes a streamed stage holds the whole step, parameters and gradients, as
  // their masters have them (StreamedBlocks::resident).
  double streamed_resident = 0;
  // Streamed with recomputation, which the runtime does block by block (each block keeps its
  // input, and one block's forward is rerun at a time): the block inputs a micro-batch keeps
  // besides the stage's, and one block's activations and working memory at their most
  // (StreamedRecompute).
  double streamed_kept = 0;
  double streamed_act_peak = 0;
};

// The blocks offload's runtime streams stage [begin, end) in: graph/subgraph.h's
// ParamBlockStarts replayed over the stage's Block::param_reads (a block without them as one
// read of its params at its start, its boundary's cut before it), a block ending where the next
// node's parameters not yet in it would take it past `max_bytes`. `count` 1: not streamed.
// The blocks' streamed bytes leave out what the runtime does not stream (SetUpStreaming): a
// tensor that several of the blocks read, or a block of another stage.
struct StreamedBlocks {
  int count = 0;
  double largest = 0;  // streamed trainable bytes of the largest block, as its masters have them
  // The trainable bytes on the device (CostTable::param_streamed_bytes) of two consecutive
  // blocks, and of three, at their most.
  double largest_pair = 0;
  double largest_triple = 0;
  // The trainable bytes not streamed, as their masters have them: uploaded whole before the
  // stage's first forward of a step, with their gradients on the device until its end.
  double resident = 0;
  // Per tensor of the cost table: true where the runtime does not stream it.
  std::vector<bool> not_streamed;
  // Bytes per sample of the blocks' inputs after the first one's (the stage's), which a
  // micro-batch recomputed block by block keeps.
  double inputs_per_sample = 0;
};
StreamedBlocks StreamedBlocksOf(const CostTable& table, int begin, int end, double max_bytes);

// StreamedRecompute's estimate, per micro-batch of `mb` samples, for stage [begin, end)
// streamed in blocks of at most `block_bytes` trainable bytes whose inputs take
// `inputs_per_sample`: a runtime block's activations are taken as those of a window of
// block_bytes parameter bytes starting or ending at a planning block's edge, the planning
// blocks it covers in part counted by the share of their bytes (those without parameters
// whole), with the most working memory of them; a planning block's activations without the
// low-precision copies of parameters a streamed block holds in that dtype
// (CostTable::param_streamed_bytes; not those `not_streamed` marks, StreamedBlocks). `kept` 0
// and `act_peak` 0 when the stage is one planning block.
struct StreamedRecomputeTerms {
  double kept = 0;
  double act_peak = 0;
  // Per planning block i of the stage: the most activations and working memory of a window
  // that starts at i (act_peak is the largest).
  std::vector<double> act_peak_from;
};
StreamedRecomputeTerms StreamedRecompute(const CostTable& table, double cast_factor, int begin,
                                         int end, int64_t mb, double block_bytes,
                                         double inputs_per_sample,
                                         const std::vector<bool>& not_streamed = {});

// A streamed stage's backward per planning block i of [begin, end), for what the parameters
// kept on the device add to it: `act`, the activations and working memory the device holds
// while the backward runs block i (recomputed: the largest window that starts at i, from
// StreamedRecompute's act_peak_from; otherwise X_<=i + W_i), and the trainable bytes of the
// parameters the blocks before i read first (`first_before`) and last (`last_before`), and
// those up to i and i included read first (`first_through`), of those no block outside the
// stage reads (another stage's too, the runtime never keeps them); *keepable: the trainable
// bytes of all those. A parameter's gradient is allocated at its last reader's backward, and
// the kept parameters are the ones read first (the runtime keeps whole parameters in that
// order): when the backward reaches block i, the kept gradients allocated are at most
// min(kept, first_before - last_before + max(0, kept - first_before)).
struct BlockBackward {
  double act = 0;
  double first_before = 0;
  double last_before = 0;
  double first_through = 0;
};
std::vector<BlockBackward> StreamedBackward(const CostTable& table, double cast_factor,
                                            int begin, int end, int64_t mb,
                                            const std::vector<double>& recomputed_act_peak_from,
                                            double* keepable);

// Streamed with offload_keep_on_device: the trainable bytes kept on the device, at most
// `trainable`, and the device's memory `memory` then; `total` is its memory without them, `act`
// the activations term of total that each of `blocks`' act replaces while the backward runs
// that block, `limit` what memory may reach. A kept byte is its master's and state_factor of
// optimizer state on the device for good, and its gradient's from its last reader's backward
// to the step. `blocks` empty: the gradients counted throughout (a step of several
// micro-batches holds the first one's in every later one).
//
// The backward of a runtime block whose parameters are all kept fetches and sends nothing:
// there the device holds `streaming` less than `total` counts (the streamed blocks' parameters
// and gradients, less the two blocks' gradients whose copies to the host may still be under
// way; at least the streamed gradients `total` counts, which no forward holds). A planning
// block i is taken to be in such a runtime block when the kept bytes reach first_through +
// `block` (the largest runtime block's trainable bytes: any runtime block with a parameter
// that i reads first ends within that) or `trainable` (nothing streams). As memory then falls
// where a block turns kept, the kept bytes are the largest that every block's backward has
// room for, found among each block's largest with and without `streaming`.
struct KeptTerms {
  double bytes = 0;
  double memory = 0;
};
KeptTerms KeepOnDevice(const std::vector<BlockBackward>& blocks, double act, double total,
                       double trainable, double limit, double state_factor,
                       double streaming = 0, double block = 0);

// One device's memory (EvaluateStage's model): `total` at its peak, and `scaled`, the most it
// grows per unit of micro-batch size (activations, inputs and working memory). Non-decreasing
// in every term and in `inflight`, for fixed micro_batches, which the search's pruning relies
// on.
struct DeviceMemory {
  double total = 0;
  double scaled = 0;
  // Streamed: the gradients of the streamed blocks among total's (three blocks' at most).
  double streamed_grads = 0;
};
DeviceMemory StageDeviceMemory(const SearchOptions& options, const MemoryTerms& terms,
                               int replicas, int inflight, int micro_batches, bool recompute);

// The StageEval of blocks [begin, end) whose per-block sums at `mb` are `sums`, with `inflight`
// of `micro_batches` in flight. mb must be > 0.
StageEval FinishStage(const CostTable& table, const Links& links, const SearchOptions& options,
                      int begin, int end, int replicas, int inflight, int micro_batches,
                      int64_t mb, const StageSums& sums);

}  // namespace internal
}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COST_EVAL_INTERNAL_H_
