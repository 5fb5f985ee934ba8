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

// Blocks of a model with repeated parts, and the pieces they are made of. A piece is what the
// profiler runs; a block (what the search places) is one or more consecutive pieces, costed as
// the sum of its pieces' times and activations, the largest of their working memories: the
// same rule by which the cost model adds blocks into a stage.
struct Coarsening {
  std::vector<int> blocks;  // first node of each block: as CoarsenToBlocks returns
  std::vector<int> pieces;  // first node of each piece; every block start is a piece start
};

// Like CoarsenToBlocks, but first looks for a repeated part: the longest (by time) stretch of
// at least two back-to-back copies of one sequence of node classes (node_class[i]: equal for
// nodes of the same structure, e.g. Profiler::node_classes()), such as the layers of a
// transformer. Its copies ("units") are cut at the same offset, the one with the fewest
// cut_bytes, so that they are alike, and get the blocks in proportion to their share of the
// time:
//  - more units than those blocks: each block is a run of whole units, as even as possible
//    (72 layers in 30 blocks: 12 of 3 layers and 18 of 2), each unit one piece;
//  - fewer: each unit is split the same way into ceil(blocks / units) pieces (CoarsenToBlocks
//    on one unit), and pieces are grouped into the blocks.
// So all units are cut alike, and the profiler measures one unit's pieces for all of them.
// What lies before and after the repeated part is coarsened the same way (it may repeat
// too) with the rest of the blocks; without a repeat covering a quarter of the time, blocks
// are CoarsenToBlocks's and each block is one piece. With n <= target_blocks every node is a
// block. node_class shorter than node_ms counts as all distinct.
Coarsening CoarsenRepeated(const std::vector<double>& node_ms,
                           const std::vector<double>& cut_bytes,
                           const std::vector<int>& node_class, int target_blocks);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COARSEN_H_
