// Periodic: a thread of its own that calls a function every `interval` until the Periodic is
// stopped or destroyed. The one "do this every N seconds" loop of the daemon (the lease reaper,
// the cluster's heartbeats) and of the SDK (LeaseKeeper).
//
//   class Reaper {
//     ...
//     JobManager* jobs_;
//     Periodic periodic_{std::chrono::seconds(1), [this] { jobs_->RemoveExpired(); }};
//   };
//
// Schedule: calls start `interval` apart, the first one `interval` after construction
// (First::kAfterInterval) or at once (First::kNow). A call that outlasts the interval is followed
// by the next one at once; calls never overlap and missed ones are not made up. Steady time.
//
// Thread-safety and lifetime: `fn` runs on the Periodic's thread only, one call at a time.
// Stop() and the destructor may be called from any thread but that one (from `fn` they would
// wait for themselves); they wake the thread at once, wait for a call in progress to return and
// join, so they return within one call of `fn`, never a whole interval. Everything `fn` uses
// must outlive the Periodic: declare it after those members, so that it is destroyed first.
// To test what `fn` does, call it directly; this class only adds the thread.
#ifndef RANNC_DAEMON_COMMON_PERIODIC_H_
#define RANNC_DAEMON_COMMON_PERIODIC_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace rannc {

class Periodic {
 public:
  enum class First { kAfterInterval, kNow };

  // Starts the thread. `interval` > 0.
  Periodic(std::chrono::milliseconds interval, std::function<void()> fn,
           First first = First::kAfterInterval);
  // Stop().
  ~Periodic();

  Periodic(const Periodic&) = delete;
  Periodic& operator=(const Periodic&) = delete;

  // No call starts after this; returns once the thread has ended. Idempotent.
  void Stop();

 private:
  void Run(First first);

  const std::chrono::milliseconds interval_;
  const std::function<void()> fn_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;  // guarded by mu_
  std::mutex join_mu_;     // one joiner at a time
  std::thread thread_;     // last: starts once everything above is constructed
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_PERIODIC_H_
