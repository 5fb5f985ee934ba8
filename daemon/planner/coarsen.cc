#include "daemon/planner/coarsen.h"

#include <cmath>
#include <cstddef>

namespace rannc {
namespace planner {

std::vector<int> CoarsenToBlocks(const std::vector<double>& node_ms,
                                 const std::vector<double>& cut_bytes, int target_blocks) {
  const int n = static_cast<int>(node_ms.size());
  if (n == 0) return {};
  const int target = target_blocks < 1 ? 1 : target_blocks;
  std::vector<int> starts;
  if (n <= target) {
    for (int i = 0; i < n; ++i) starts.push_back(i);
    return starts;
  }

  std::vector<double> weight(n);
  double total = 0;
  for (int i = 0; i < n; ++i) {
    weight[i] = node_ms[i] > 0 ? node_ms[i] : 0;  // also maps NaN to 0
    total += weight[i];
  }
  if (!(total > 0) || !std::isfinite(total)) {
    // Nothing measured: balance node counts instead.
    for (double& w : weight) w = 1;
    total = n;
  }
  // prefix[i]: time of nodes before boundary i.
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weight[i];
  auto cut = [&](int i) {
    return static_cast<size_t>(i) < cut_bytes.size() ? cut_bytes[i] : 0.0;
  };

  const double block_ms = total / target;
  // A hair of slack so that a boundary exactly half a block away is not lost to rounding.
  const double half = block_ms / 2 * (1 + 1e-12);
  starts.push_back(0);
  for (int j = 1; j < target; ++j) {
    const int prev = starts.back();
    if (prev + 1 >= n) break;  // no boundary left
    const double ideal = block_ms * j;
    int best = -1;
    double best_cut = 0, best_dist = 0;
    for (int i = prev + 1; i < n; ++i) {
      const double offset = prefix[i] - ideal;
      if (offset > half) break;  // prefix only grows
      const double dist = std::fabs(offset);
      if (dist > half) continue;
      const double c = cut(i);
      if (best < 0 || c < best_cut || (c == best_cut && dist < best_dist)) {
        best = i;
        best_cut = c;
        best_dist = dist;
      }
    }
    if (best < 0) {
      // A node longer than the window: take the nearest boundary instead.
      for (int i = prev + 1; i < n; ++i) {
        const double dist = std::fabs(prefix[i] - ideal);
        if (best < 0 || dist < best_dist) {
          best = i;
          best_dist = dist;
        }
      }
    }
    starts.push_back(best);
  }
  return starts;
}

}  // namespace planner
}  // namespace rannc
