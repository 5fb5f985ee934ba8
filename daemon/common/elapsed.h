// Seconds elapsed on the steady clock: the phase timings the daemon logs.
#ifndef RANNC_DAEMON_COMMON_ELAPSED_H_
#define RANNC_DAEMON_COMMON_ELAPSED_H_

#include <chrono>

namespace rannc {

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_ELAPSED_H_
