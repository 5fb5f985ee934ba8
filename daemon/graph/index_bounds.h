// The ranges a model's integer inputs must stay in: a user input whose values index a table of
// fixed size (token ids into an embedding, class targets of a loss, indices of index_select or
// gather), found in the IR by following the input through ops that only rearrange its values
// (view, reshape, slice, select, transpose, ...).
//
// The daemon checks each batch against them on the host before any device runs it
// (runtime/model_runner.h CheckInputs). On a GPU an out-of-range index is a device-side assert,
// which leaves the daemon's CUDA context unusable for every job; refused on the host, the bad
// batch is an INVALID_ARGUMENT for its client only.
//
//   std::vector<IndexBound> bounds = FindIndexBounds(ir);
#ifndef RANNC_DAEMON_GRAPH_INDEX_BOUNDS_H_
#define RANNC_DAEMON_GRAPH_INDEX_BOUNDS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "daemon/graph/ir.h"

namespace rannc {

struct IndexBound {
  int input = 0;      // the user input
  int64_t limit = 0;  // every value must be in [0, limit) ...
  std::optional<int64_t> ignore;  // ... or equal this (a loss's ignore_index)
  // What the values index, for messages: "the rows of embedding tok.weight (64 rows)".
  std::string what;
};

// One bound per (input, use); an input used twice (ids into two tables) has two.
std::vector<IndexBound> FindIndexBounds(const IrGraph& ir);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_INDEX_BOUNDS_H_
