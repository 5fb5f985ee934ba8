// Test helper: Catch2 assertions from several threads. Catch2 v2's assertions are not
// thread-safe (TSan reports its counters racing), so threads assert through these, under one
// lock, taken once the condition is evaluated (which may wait for other threads: evaluating it
// under the lock could deadlock).
//
//   THREAD_CHECK(values[i] == i);
//   THREAD_REQUIRE_OK(comm.Send(...));  // an absl::Status, printed when it is not OK
#ifndef RANNC_DAEMON_COMMON_CATCH_THREADS_H_
#define RANNC_DAEMON_COMMON_CATCH_THREADS_H_

#include <mutex>

#include <catch2/catch.hpp>

namespace rannc::testing {

inline std::mutex& CatchMutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace rannc::testing

#define THREAD_CHECK(...)                                                \
  do {                                                                   \
    const bool thread_check_ok = static_cast<bool>(__VA_ARGS__);         \
    std::lock_guard<std::mutex> catch_lock(::rannc::testing::CatchMutex()); \
    INFO(#__VA_ARGS__);                                                  \
    CHECK(thread_check_ok);                                              \
  } while (0)

#define THREAD_REQUIRE_OK(status)                                        \
  do {                                                                   \
    const absl::Status thread_status = (status);                         \
    std::lock_guard<std::mutex> catch_lock(::rannc::testing::CatchMutex()); \
    INFO(thread_status.ToString());                                      \
    REQUIRE(thread_status.ok());                                         \
  } while (0)

#endif  // RANNC_DAEMON_COMMON_CATCH_THREADS_H_
