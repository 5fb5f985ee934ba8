// Checks the step simulator against closed forms (uniform stages, one stage) and against a
// schedule traced by hand for heterogeneous stages.
#include "daemon/planner/schedule_sim.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <random>
#include <vector>

#include "daemon/planner/cost_eval.h"

namespace rannc {
namespace planner {
namespace {

using Catch::Matchers::WithinRel;

StageEval Stage(double fwd, double bwd, double comm, double allreduce) {
  StageEval e;
  e.feasible = true;
  e.fwd_ms = fwd;
  e.bwd_ms = bwd;
  e.comm_ms = comm;
  e.time_ms = fwd + bwd + comm;
  e.allreduce_ms = allreduce;
  return e;
}

TEST_CASE("Uniform stages take (m + S - 1) * t + all-reduce under both schedules",
          "[schedule_sim]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> ms(0.1, 5.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int S = 1 + trial % 7;
    const int m = 1 + (trial / 7) % 9;  // includes m < S
    const StageEval s = Stage(ms(rng), ms(rng), trial % 3 == 0 ? 0.0 : ms(rng), ms(rng));
    const std::vector<StageEval> stages(S, s);
    const double expected = (m + S - 1) * s.time_ms + s.allreduce_ms;
    INFO("S=" << S << " m=" << m);
    const double one_f_one_b = SimulateStep(stages, m, Schedule::k1F1B);
    const double gpipe = SimulateStep(stages, m, Schedule::kGPipe);
    CHECK_THAT(one_f_one_b, WithinRel(expected, 1e-12));
    CHECK_THAT(gpipe, WithinRel(expected, 1e-12));
    CHECK_THAT(one_f_one_b, WithinRel(gpipe, 1e-12));
    // The closed form the search minimises is exact here.
    CHECK_THAT(Objective(stages, m), WithinRel(expected, 1e-12));
  }
}

TEST_CASE("A single stage takes m * t + all-reduce and has no bubble", "[schedule_sim]") {
  for (Schedule sched : {Schedule::k1F1B, Schedule::kGPipe}) {
    SimResult r = Simulate({Stage(1.5, 2.5, 1.0, 0.0)}, 6, sched);
    CHECK_THAT(r.step_ms, WithinRel(6 * 5.0, 1e-12));
    CHECK(r.bubble_fraction == Approx(0.0).margin(1e-12));
    CHECK_THAT(SimulateStep({Stage(1.5, 2.5, 1.0, 4.0)}, 6, sched), WithinRel(34.0, 1e-12));
  }
}

TEST_CASE("Heterogeneous 1F1B matches a hand-traced schedule", "[schedule_sim]") {
  // Stage 0 (F=1, B=2) runs F0 F1 B0 B1; stage 1 (F=3, B=1) runs F0 B0 F1 B1.
  //   s0: F0 [0,1]  F1 [1,2]                     B0 [5,7]           B1 [9,11]
  //   s1:           F0 [1,4] B0 [4,5] F1 [5,8] B1 [8,9]
  // Stage 0 ends at 11 (+0.5 all-reduce), stage 1 at 9 (+3): the step is 12.
  std::vector<StageEval> stages = {Stage(1, 2, 0, 0.5), Stage(3, 1, 0, 3)};
  SimResult r = Simulate(stages, 2, Schedule::k1F1B);
  CHECK_THAT(r.step_ms, WithinRel(12.0, 1e-12));
  REQUIRE(r.finish_ms.size() == 2);
  CHECK_THAT(r.finish_ms[0], WithinRel(11.0, 1e-12));
  CHECK_THAT(r.finish_ms[1], WithinRel(9.0, 1e-12));
  REQUIRE(r.busy_ms.size() == 2);
  CHECK_THAT(r.busy_ms[0], WithinRel(6.0, 1e-12));
  CHECK_THAT(r.busy_ms[1], WithinRel(8.0, 1e-12));
  CHECK_THAT(r.bubble_fraction, WithinRel(1.0 - 14.0 / 24.0, 1e-12));
}

TEST_CASE("Heterogeneous GPipe matches a hand-traced schedule", "[schedule_sim]") {
  // s1: F0 [1,4] F1 [4,7] B1 [7,8] B0 [8,9]; s0: F0 [0,1] F1 [1,2] B1 [8,10] B0 [10,12].
  std::vector<StageEval> stages = {Stage(1, 2, 0, 0.5), Stage(3, 1, 0, 3)};
  SimResult r = Simulate(stages, 2, Schedule::kGPipe);
  CHECK_THAT(r.step_ms, WithinRel(12.5, 1e-12));
  CHECK_THAT(r.finish_ms[1], WithinRel(9.0, 1e-12));
}

TEST_CASE("Communication is split evenly between forward and backward", "[schedule_sim]") {
  // Two stages, one micro-batch: F(0) 1+1, F(1) 1+2, B(1) 1+2, B(0) 1+1 run back to back.
  std::vector<StageEval> stages = {Stage(1, 1, 2, 0), Stage(1, 1, 4, 0)};
  CHECK_THAT(SimulateStep(stages, 1, Schedule::k1F1B), WithinRel(10.0, 1e-12));
}

TEST_CASE("Heterogeneous pipelines respect the step's lower and upper bounds",
          "[schedule_sim]") {
  // The closed form Objective() is exact only for uniform stages: with different F/B ratios
  // per stage it can be below or above the simulated step. What always holds: a stage's step
  // includes its own m ops and all-reduce; micro-batch 0 passes through every F and B in a
  // chain; and some op runs at every instant before the last backward ends (in-order stages
  // cannot all wait on each other without deadlock), so the step is at most all ops back to
  // back plus the longest all-reduce.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> ms(0.1, 5.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int S = 1 + trial % 5;
    const int m = 1 + trial % 8;
    std::vector<StageEval> stages;
    double sum_t = 0, all_ops = 0, max_ar = 0, lower = 0;
    for (int s = 0; s < S; ++s) {
      stages.push_back(Stage(ms(rng), ms(rng), ms(rng), ms(rng)));
      sum_t += stages.back().time_ms;
      all_ops += m * stages.back().time_ms;
      max_ar = std::max(max_ar, stages.back().allreduce_ms);
      lower = std::max(lower, m * stages.back().time_ms + stages.back().allreduce_ms);
    }
    for (Schedule sched : {Schedule::k1F1B, Schedule::kGPipe}) {
      SimResult r = Simulate(stages, m, sched);
      CHECK(r.step_ms >= lower * (1 - 1e-12));
      CHECK(r.step_ms >= sum_t * (1 - 1e-12));
      CHECK(r.step_ms <= (all_ops + max_ar) * (1 + 1e-12));
      for (int s = 0; s < S; ++s) CHECK_THAT(r.busy_ms[s], WithinRel(m * stages[s].time_ms, 1e-12));
      CHECK(r.bubble_fraction >= -1e-12);
      CHECK(r.bubble_fraction < 1.0);
    }
  }
}

TEST_CASE("An empty pipeline simulates to zero", "[schedule_sim]") {
  CHECK(SimulateStep({}, 4, Schedule::k1F1B) == 0.0);
  CHECK(SimulateStep({Stage(1, 1, 0, 0)}, 0, Schedule::k1F1B) == 0.0);
}

}  // namespace
}  // namespace planner
}  // namespace rannc
