// The partition search: splits a model's blocks into contiguous pipeline stages, gives each
// stage a number of data-parallel replicas, and picks the micro-batch count, minimising the
// step time of the cost model in cost_eval.h (Objective()) over every plan whose stages fit
// in device memory. The search is exact for that objective: for each micro-batch count, a
// dynamic program over suffixes of the block list (built from the last stage backwards, so
// each stage knows how many stages follow it) keeps, per (first block, devices used), the
// Pareto front of (slowest stage time, sum of stage times, slowest all-reduce, stage count);
// a suffix that cannot beat the best plan found so far, by a lower bound on what the blocks
// before it must add, is dropped. Typical cost on one core: 48 blocks / 16 devices in a few
// tens of ms; 64 blocks / 64 devices well under a second with 1F1B, a few seconds with GPipe
// when memory is tight.
//
// Pure function of its arguments; safe to call from any thread.
//
//   SearchOptions opt;
//   opt.batch_size = 64;  opt.num_devices = 8;  opt.device_memory_bytes = 80ull << 30;
//   absl::StatusOr<Plan> plan = SearchPlan(table, links, opt);
//   if (!plan.ok()) return plan.status();  // INVALID_ARGUMENT or RESOURCE_EXHAUSTED
//   for (const StagePlan& s : plan->stages) { ... blocks [s.begin, s.end) on s.replicas ... }
#ifndef RANNC_DAEMON_PLANNER_SEARCH_H_
#define RANNC_DAEMON_PLANNER_SEARCH_H_

#include <vector>

#include "absl/status/statusor.h"
#include "daemon/planner/cost_eval.h"
#include "daemon/planner/cost_table.h"

namespace rannc {
namespace planner {

struct StagePlan {
  int begin = 0;     // first block of the stage
  int end = 0;       // one past the last block
  int replicas = 0;  // devices running the stage data-parallel
  StageEval eval;    // EvaluateStage() of this stage in this plan
};

struct Plan {
  std::vector<StagePlan> stages;  // in pipeline order; together they cover every block once
  int micro_batches = 0;          // per step
  Schedule schedule = Schedule::k1F1B;
  double objective_ms = 0;   // Objective() of the stages: the step time the search minimised
  double simulated_ms = 0;   // SimulateStep() of the same stages (schedule_sim.h)
  double simulated_bubble = 0;  // the simulation's bubble_fraction
  int devices_used = 0;      // sum of the stages' replicas
};

// The plan with the smallest Objective() among all feasible (micro-batch count, stage count,
// partition, replicas per stage) allowed by `options`. Ties go to fewer stages, then fewer
// micro-batches, then more devices.
// Errors: INVALID_ARGUMENT for a malformed table or options (including forced values that no
// plan can meet), naming the field; RESOURCE_EXHAUSTED when no plan fits in memory, saying
// how much memory per device the least demanding plan needs.
absl::StatusOr<Plan> SearchPlan(const CostTable& table, const Links& links,
                                const SearchOptions& options);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_SEARCH_H_
