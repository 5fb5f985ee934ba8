// How a step's batch is divided: into micro-batches, each micro-batch over a stage's replicas,
// and how samples move between two stages whose replica counts differ (a re-split along the
// batch dimension). Sizes only; the runtime applies them to tensors with narrow/cat.
//
//   std::vector<int64_t> micro = SplitSizes(/*total=*/10, /*parts=*/4);  // {3, 3, 2, 2}
//   std::vector<Transfer> moves = Reshard(SplitSizes(8, 2), SplitSizes(8, 3));
//
// Pure functions; safe from any thread.
#ifndef RANNC_DAEMON_RUNTIME_MICRO_BATCH_H_
#define RANNC_DAEMON_RUNTIME_MICRO_BATCH_H_

#include <cstdint>
#include <vector>

namespace rannc {

// `total` samples in `parts` contiguous shards as even as possible, larger shards first (the
// planner sizes memory by the largest: ceil(total / parts)). Shards may be 0 when
// total < parts.
std::vector<int64_t> SplitSizes(int64_t total, int parts);

// Offsets of the shards SplitSizes describes (prefix sums, starting at 0).
std::vector<int64_t> Offsets(const std::vector<int64_t>& sizes);

// Samples [offset, offset + count) of the sequence go from shard `src` (at `src_offset` within
// it) to shard `dst` (at `dst_offset` within it).
struct Transfer {
  int src = 0;
  int dst = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t count = 0;
  bool operator==(const Transfer& o) const {
    return src == o.src && dst == o.dst && src_offset == o.src_offset &&
           dst_offset == o.dst_offset && count == o.count;
  }
};

// The copies that turn one sharding of a sequence of samples into another (both must cover the
// same total): one Transfer per overlapping pair of shards, in sample order.
std::vector<Transfer> Reshard(const std::vector<int64_t>& src_sizes,
                              const std::vector<int64_t>& dst_sizes);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_MICRO_BATCH_H_
