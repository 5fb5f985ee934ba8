#include "daemon/common/periodic.h"

#include <atomic>
#include <memory>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// Counts calls; a test waits for the count instead of sleeping for a guessed time.
class Calls {
 public:
  void Add() {
    std::lock_guard<std::mutex> lock(mu_);
    times_.push_back(steady_clock::now());
    changed_.notify_all();
  }
  // True once `n` calls were made; false after `timeout` (a failure: the tests wait far less).
  bool WaitFor(size_t n, milliseconds timeout = milliseconds(10000)) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, timeout, [&] { return times_.size() >= n; });
  }
  std::vector<steady_clock::time_point> times() {
    std::lock_guard<std::mutex> lock(mu_);
    return times_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<steady_clock::time_point> times_;
};

const milliseconds kLong(3600 * 1000);  // never reached by a passing test
const milliseconds kPrompt(2000);       // generous for a loaded CI machine, far below kLong

TEST_CASE("Periodic calls its function again and again", "[periodic]") {
  Calls calls;
  Periodic periodic(milliseconds(1), [&] { calls.Add(); });
  CHECK(calls.WaitFor(5));
}

TEST_CASE("Periodic keeps calls an interval apart", "[periodic]") {
  Calls calls;
  const milliseconds interval(20);
  const steady_clock::time_point start = steady_clock::now();
  {
    Periodic periodic(interval, [&] { calls.Add(); });
    REQUIRE(calls.WaitFor(3));
  }
  std::vector<steady_clock::time_point> t = calls.times();
  // Call i starts an interval after call i - 1 started, as Periodic reads the clock; the test's
  // times are read later, inside the call, by a delay a loaded machine can stretch (one call
  // seen late makes the next gap look short: ASan beside a fuzzer saw it). Delays only move the
  // times later, so each is bounded from the start: call i comes no sooner than i + 1 intervals
  // (kAfterInterval: the first waits one). Calls back to back, or a shorter period, fail.
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i] - start >= static_cast<int64_t>(i + 1) * interval);
  }
}

TEST_CASE("Periodic with First::kNow calls at once, not after the interval", "[periodic]") {
  Calls calls;
  const steady_clock::time_point start = steady_clock::now();
  Periodic periodic(kLong, [&] { calls.Add(); }, Periodic::First::kNow);
  REQUIRE(calls.WaitFor(1));
  CHECK(steady_clock::now() - start < kPrompt);
  CHECK(calls.times().size() == 1);
}

TEST_CASE("Periodic stops promptly in the middle of a long interval", "[periodic]") {
  Calls calls;
  SECTION("before the first call") {
    auto periodic = std::make_unique<Periodic>(kLong, [&] { calls.Add(); });
    const steady_clock::time_point before = steady_clock::now();
    periodic.reset();
    CHECK(steady_clock::now() - before < kPrompt);
    CHECK(calls.times().empty());
  }
  SECTION("between calls, by Stop, which is idempotent") {
    Periodic periodic(kLong, [&] { calls.Add(); }, Periodic::First::kNow);
    REQUIRE(calls.WaitFor(1));
    const steady_clock::time_point before = steady_clock::now();
    periodic.Stop();
    CHECK(steady_clock::now() - before < kPrompt);
    periodic.Stop();
    CHECK(calls.times().size() == 1);
  }
}

TEST_CASE("Periodic's destructor waits for a call in progress", "[periodic]") {
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, release = false;
  std::atomic<bool> destroyed{false};
  std::atomic<bool> destroyed_during_call{false};
  auto periodic = std::make_unique<Periodic>(kLong, [&] {
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
    destroyed_during_call = destroyed.load();
  }, Periodic::First::kNow);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered; });
  }
  std::thread destroyer([&] {
    periodic.reset();
    destroyed = true;
  });
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  destroyer.join();
  CHECK(destroyed);
  CHECK(!destroyed_during_call);
}

}  // namespace
}  // namespace rannc
