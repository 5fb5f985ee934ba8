#include "daemon/runtime/micro_batch.h"

#include <algorithm>

namespace rannc {

std::vector<int64_t> SplitSizes(int64_t total, int parts) {
  if (parts < 1 || total < 0) return {};
  std::vector<int64_t> sizes(parts, total / parts);
  for (int64_t i = 0; i < total % parts; ++i) ++sizes[i];
  return sizes;
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  return offsets;
}

std::vector<Transfer> Reshard(const std::vector<int64_t>& src_sizes,
                              const std::vector<int64_t>& dst_sizes) {
  std::vector<Transfer> moves;
  const std::vector<int64_t> src_at = Offsets(src_sizes);
  const std::vector<int64_t> dst_at = Offsets(dst_sizes);
  size_t s = 0, d = 0;
  while (s < src_sizes.size() && d < dst_sizes.size()) {
    const int64_t lo = std::max(src_at[s], dst_at[d]);
    const int64_t hi = std::min(src_at[s] + src_sizes[s], dst_at[d] + dst_sizes[d]);
    if (hi > lo) {
      moves.push_back({static_cast<int>(s), static_cast<int>(d), lo - src_at[s], lo - dst_at[d],
                       hi - lo});
    }
    // Advance whichever shard ends first (both when they end together).
    const int64_t src_end = src_at[s] + src_sizes[s];
    const int64_t dst_end = dst_at[d] + dst_sizes[d];
    if (src_end <= dst_end) ++s;
    if (dst_end <= src_end) ++d;
  }
  return moves;
}

}  // namespace rannc
