#include "daemon/server/job_metrics.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

using Catch::WithinAbs;

TEST_CASE("JobMetrics: an iteration's wall time, busy time, tokens and bubble", "[metrics]") {
  JobMetrics::Clock::time_point now{};
  JobMetrics m([&] { return now; });
  m.SetPlan(0.2, 0.25);
  m.SetState("DEPLOYED");
  m.SetSteps(10);  // resumed at step 10

  // The first step only starts the first iteration.
  m.AddForward(8, 8 * 16);
  m.AddBusy(0.1, JobMetrics::Call::kForward);
  m.SetMemory({100}, {150});
  m.EndStep(11, /*compute_ns=*/1000, /*schedule_ns=*/2000);
  JobMetrics::Snapshot s = m.Read();
  CHECK(s.steps == 11);
  CHECK(s.samples == 8);
  CHECK(s.tokens == 128);
  CHECK(s.step_count == 0);
  CHECK(s.step_s == 0);
  CHECK(s.device_bytes == std::vector<int64_t>{100});
  CHECK(s.peak_device_bytes == std::vector<int64_t>{150});

  // Two forwards (gradient accumulation) and a step, 0.5 s later, 0.3 s of it busy here; the
  // engine computed 600 of its 800 ns of schedule time.
  now += std::chrono::milliseconds(500);
  m.AddForward(8, 100);
  m.AddForward(8, 100);
  m.AddBusy(0.2, JobMetrics::Call::kForward);
  m.AddBusy(0.05, JobMetrics::Call::kBackward);
  m.AddBusy(0.04, JobMetrics::Call::kStep);
  m.AddBusy(0.01, JobMetrics::Call::kOther);
  m.SetMemory({100}, {160});
  m.EndStep(12, 1600, 2800);
  s = m.Read();
  CHECK(s.steps == 12);
  CHECK(s.samples == 24);
  CHECK(s.tokens == 328);
  CHECK(s.step_count == 1);
  CHECK_THAT(s.step_s, WithinAbs(0.5, 1e-9));
  CHECK_THAT(s.step_sum_s, WithinAbs(0.5, 1e-9));
  CHECK_THAT(s.busy_s, WithinAbs(0.3, 1e-9));
  // By kind of call: the first iteration's forward (before this one began) is not among them.
  CHECK_THAT(s.busy_by_call_s[static_cast<int>(JobMetrics::Call::kForward)], WithinAbs(0.2, 1e-9));
  CHECK_THAT(s.busy_by_call_s[static_cast<int>(JobMetrics::Call::kBackward)],
             WithinAbs(0.05, 1e-9));
  CHECK_THAT(s.busy_by_call_s[static_cast<int>(JobMetrics::Call::kStep)], WithinAbs(0.04, 1e-9));
  CHECK_THAT(s.busy_by_call_s[static_cast<int>(JobMetrics::Call::kOther)], WithinAbs(0.01, 1e-9));
  CHECK(std::string(JobMetrics::CallName(JobMetrics::Call::kStep)) == "step");
  CHECK_THAT(s.tokens_per_s, WithinAbs(400, 1e-6));
  CHECK_THAT(s.bubble, WithinAbs(0.25, 1e-9));
  CHECK(s.planned_step_s == 0.2);
  CHECK(s.planned_bubble == 0.25);
  CHECK(s.state == "DEPLOYED");

  // Buckets are cumulative: 0.5 s falls in 0.5 and every larger bound.
  const std::vector<double>& bounds = JobMetrics::StepBuckets();
  REQUIRE(s.step_buckets.size() == bounds.size());
  for (size_t i = 0; i < bounds.size(); ++i) {
    INFO("bound " << bounds[i]);
    CHECK(s.step_buckets[i] == (bounds[i] >= 0.5 ? 1u : 0u));
  }

  // A slow iteration (40 s) lands only in the larger buckets; one past the last bound only in
  // the count (+Inf).
  now += std::chrono::seconds(40);
  m.EndStep(13, 1600, 2800);
  now += std::chrono::seconds(1000);
  m.EndStep(14, 1600, 2800);
  s = m.Read();
  CHECK(s.step_count == 3);
  CHECK(s.step_buckets.back() == 2);  // 0.5 s and 40 s are <= 300 s
  CHECK(s.step_buckets[bounds.size() - 2] == 2);  // <= 60 s
  CHECK(s.step_buckets[bounds.size() - 3] == 1);  // <= 30 s
  CHECK(s.bubble == 0);  // no schedule time in those iterations: no bubble measured
  CHECK(s.tokens_per_s == 0);
}

TEST_CASE("JobMetrics: memory outside steps and checkpoint time", "[metrics]") {
  JobMetrics m;
  m.SetMemory({1, 2}, {3, 4});
  m.AddCheckpointBlocked(0.25);
  m.AddCheckpointBlocked(0.5);
  m.SetState("UNDEPLOYED");
  JobMetrics::Snapshot s = m.Read();
  CHECK(s.device_bytes == std::vector<int64_t>{1, 2});
  CHECK(s.peak_device_bytes == std::vector<int64_t>{3, 4});
  CHECK(s.checkpoint_blocked_s == 0.75);
  CHECK(s.state == "UNDEPLOYED");
}

}  // namespace
}  // namespace rannc
