#include "daemon/common/periodic.h"

#include <utility>

namespace rannc {

Periodic::Periodic(std::chrono::milliseconds interval, std::function<void()> fn, First first)
    : interval_(interval), fn_(std::move(fn)), thread_([this, first] { Run(first); }) {}

Periodic::~Periodic() { Stop(); }

void Periodic::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
}

void Periodic::Run(First first) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point next = Clock::now();
  if (first == First::kAfterInterval) next += interval_;
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_until(lock, next, [this] { return stopping_; })) {
    lock.unlock();
    // From the call's start, so that the period does not stretch by the call's length.
    next = Clock::now() + interval_;
    fn_();
    lock.lock();
  }
}

}  // namespace rannc
