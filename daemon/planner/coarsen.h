// Coarsening of a model's atomic nodes (ops, in one topological order) into the blocks the
// partition search works on (planner/search.h). The search's cost grows with the number of
// blocks, so a large graph is first cut into a few dozen contiguous blocks of about equal time,
// each cut placed where few bytes cross: in a transformer that is between layers, where only
// the residual stream is live, rather than inside attention, where many tensors are.
//
// Pure function; safe to call from any thread.
//
//   std::vector<double> node_ms = ...;    // measured time of each node
//   std::vector<double> cut_bytes = ...;  // cut_bytes[i]: bytes per sample live before node i
//   std::vector<int> starts = CoarsenToBlocks(node_ms, cut_bytes, /*target_blocks=*/32);
//   // block k is nodes [starts[k], k + 1 < starts.size() ? starts[k + 1] : node_ms.size())
#ifndef RANNC_DAEMON_PLANNER_COARSEN_H_
#define RANNC_DAEMON_PLANNER_COARSEN_H_

#include <vector>

namespace rannc {
namespace planner {

// Splits nodes 0..n-1 (n = node_ms.size()) into at most `target_blocks` contiguous, non-empty
// blocks and returns the first node of each: starts with 0, strictly increasing, all < n.
//
// node_ms[i]: time of node i (negative or NaN counts as 0; if all are 0, every node counts
// the same). cut_bytes[i], i in 1..n-1: bytes per sample live across the boundary just before
// node i (index 0 is unused; missing entries count as 0).
//
// Method: for each of the target_blocks - 1 ideal cut points (equal shares of the total time),
// the boundaries whose cumulative time lies within half a block's time of it are candidates;
// the one with the fewest cut_bytes wins, ties going to the one nearest the ideal point, then
// to the earlier one. Only boundaries after the previous cut are considered, so blocks are
// never empty; if none lies in the window, the nearest boundary after the previous cut is
// taken; if none is left, fewer blocks are returned. With n <= target_blocks every node is a
// block. n == 0 gives an empty result; target_blocks < 1 counts as 1.
std::vector<int> CoarsenToBlocks(const std::vector<double>& node_ms,
                                 const std::vector<double>& cut_bytes, int target_blocks);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COARSEN_H_
