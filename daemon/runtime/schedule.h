// Pipeline schedules: the order in which one stage runs the forwards and backwards of a step's
// micro-batches. The runtime's stage workers execute exactly this order, and the planner's
// step simulator (planner/schedule_sim.h) replays it, so estimates and execution agree.
// One schedule per file: schedule_1f1b.h, schedule_gpipe.h.
//
//   for (const PipelineOp& op : StageOps(ScheduleKind::k1F1B, stage, num_stages, m)) ...
//
// Pure functions; safe from any thread.
#ifndef RANNC_DAEMON_RUNTIME_SCHEDULE_H_
#define RANNC_DAEMON_RUNTIME_SCHEDULE_H_

#include <vector>

namespace rannc {

enum class ScheduleKind {
  k1F1B,   // warm-up forwards, then one forward / one backward: bounded in-flight activations
  kGPipe,  // every forward, then every backward
};

struct PipelineOp {
  bool backward = false;
  int micro_batch = 0;
  bool operator==(const PipelineOp& o) const {
    return backward == o.backward && micro_batch == o.micro_batch;
  }
};

// The ops of `stage` (0-based, of `num_stages`) for `micro_batches` micro-batches: each
// micro-batch's forward, then later its backward. Empty for invalid arguments.
std::vector<PipelineOp> StageOps(ScheduleKind kind, int stage, int num_stages, int micro_batches);

// The most micro-batches whose activations `stage` holds at once under `kind` (forward done,
// backward not yet): what the planner's memory model multiplies activations by.
int MaxInFlight(ScheduleKind kind, int stage, int num_stages, int micro_batches);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_SCHEDULE_H_
