// A discrete-event simulation of one training step of a pipeline: each stage (a group of
// data-parallel replicas, which run in lockstep and so act as one device) executes its list
// of forward (F) and backward (B) ops in a fixed order, each op starting once its inputs are
// ready and the stage is free. It checks the closed form Objective() in cost_eval.h and shows
// where the bubbles are for heterogeneous stages, where the closed form is only an estimate.
//
// Model:
//  - F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i) and F(s, i).
//  - A stage's comm_ms is split evenly between its forward and backward op (F lasts
//    fwd_ms + comm_ms/2, B lasts bwd_ms + comm_ms/2), and a transfer adds no separate delay.
//    This mirrors how Objective() charges communication (inside time_ms) so the two agree
//    exactly for uniform stages; it models blocking sends and receives that occupy the stage.
//  - Each stage's op order is the runtime's own (runtime/schedule.h): 1F1B runs
//    w = min(S-s-1, m) warm-up forwards, then alternates one F and one B, then the remaining
//    Bs; GPipe runs all m forwards, then all m backwards in reverse micro-batch order.
//  - A stage's all-reduce starts after its last backward; the step ends when every stage's
//    all-reduce has ended.
//
// Pure functions; safe to call from any thread.
//
//   std::vector<StageEval> stages = ...;  // from EvaluateStage
//   SimResult r = Simulate(stages, /*micro_batches=*/8, Schedule::k1F1B);
//   printf("step %.1f ms, bubble %.0f%%\n", r.step_ms, 100 * r.bubble_fraction);
#ifndef RANNC_DAEMON_PLANNER_SCHEDULE_SIM_H_
#define RANNC_DAEMON_PLANNER_SCHEDULE_SIM_H_

#include <vector>

#include "daemon/planner/cost_eval.h"

namespace rannc {
namespace planner {

struct SimResult {
  double step_ms = 0;              // time of one step, all-reduces included
  std::vector<double> busy_ms;     // per stage: time spent in F and B ops (comm included)
  std::vector<double> finish_ms;   // per stage: end of its last backward (before all-reduce)
  double bubble_fraction = 0;      // 1 - sum(busy_ms) / (stages * step_ms); 0 for an empty step
};

// Simulates one step of `stages` (in pipeline order) with `micro_batches` (>= 1) micro-batches.
// No stages, or micro_batches < 1, gives an all-zero result.
SimResult Simulate(const std::vector<StageEval>& stages, int micro_batches, Schedule schedule);

// Simulate(...).step_ms.
double SimulateStep(const std::vector<StageEval>& stages, int micro_batches, Schedule schedule);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_SCHEDULE_SIM_H_
