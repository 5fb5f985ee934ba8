#include "daemon/planner/schedule_sim.h"

#include <algorithm>
#include <cstddef>
#include <limits>

#include "daemon/runtime/schedule.h"

namespace rannc {
namespace planner {
namespace {

// The runtime's own order, so the estimate replays what the stage workers execute.
std::vector<PipelineOp> StageOrder(Schedule schedule, int stage, int num_stages, int m) {
  return StageOps(schedule == Schedule::kGPipe ? ScheduleKind::kGPipe : ScheduleKind::k1F1B,
                  stage, num_stages, m);
}

}  // namespace

SimResult Simulate(const std::vector<StageEval>& stages, int micro_batches, Schedule schedule) {
  SimResult result;
  const int S = static_cast<int>(stages.size());
  const int m = micro_batches;
  if (S == 0 || m < 1) return result;
  constexpr double kNotDone = -1;
  // f_end[s][i], b_end[s][i]: when F(s, i) / B(s, i) finished, kNotDone until then.
  std::vector<std::vector<double>> f_end(S, std::vector<double>(m, kNotDone));
  std::vector<std::vector<double>> b_end(S, std::vector<double>(m, kNotDone));
  std::vector<std::vector<PipelineOp>> order(S);
  for (int s = 0; s < S; ++s) order[s] = StageOrder(schedule, s, S, m);
  std::vector<size_t> next(S, 0);
  std::vector<double> free_at(S, 0);
  result.busy_ms.assign(S, 0);

  // Each stage runs its ops in order, so an op's start is fixed once its inputs are done: sweep
  // the stages, running every op whose inputs are ready, until all have run. Every sweep runs
  // at least one op for a valid schedule, so this ends after at most 2*S*m sweeps.
  size_t remaining = static_cast<size_t>(2) * S * m;
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < S; ++s) {
      while (next[s] < order[s].size()) {
        const PipelineOp& op = order[s][next[s]];
        const int i = op.micro_batch;
        double ready = free_at[s];
        double duration;
        if (!op.backward) {
          if (s > 0) {
            if (f_end[s - 1][i] == kNotDone) break;
            ready = std::max(ready, f_end[s - 1][i]);
          }
          duration = stages[s].fwd_ms + stages[s].comm_ms / 2;
        } else {
          if (f_end[s][i] == kNotDone) break;
          ready = std::max(ready, f_end[s][i]);
          if (s + 1 < S) {
            if (b_end[s + 1][i] == kNotDone) break;
            ready = std::max(ready, b_end[s + 1][i]);
          }
          duration = stages[s].bwd_ms + stages[s].comm_ms / 2;
        }
        const double end = ready + duration;
        (op.backward ? b_end : f_end)[s][i] = end;
        free_at[s] = end;
        result.busy_ms[s] += duration;
        ++next[s];
        --remaining;
        progressed = true;
      }
    }
    // The orders above never deadlock; this guards against an endless loop if one did.
    if (!progressed) {
      result.step_ms = std::numeric_limits<double>::infinity();
      return result;
    }
  }

  result.finish_ms = free_at;
  double busy = 0;
  for (int s = 0; s < S; ++s) {
    result.step_ms = std::max(result.step_ms, free_at[s] + stages[s].per_step_ms());
    busy += result.busy_ms[s];
  }
  if (result.step_ms > 0) result.bubble_fraction = 1.0 - busy / (S * result.step_ms);
  return result;
}

double SimulateStep(const std::vector<StageEval>& stages, int micro_batches, Schedule schedule) {
  return Simulate(stages, micro_batches, schedule).step_ms;
}

}  // namespace planner
}  // namespace rannc
