// Small statistics of measurements (timings of repeated runs): the daemon's profiler and the
// benchmarks report medians.
#ifndef RANNC_DAEMON_COMMON_STATS_H_
#define RANNC_DAEMON_COMMON_STATS_H_

#include <algorithm>
#include <vector>

namespace rannc {

// The median of `v`: its middle value, the mean of the middle two for an even count; 0 when
// empty.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_STATS_H_
