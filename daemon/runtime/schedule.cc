#include "daemon/runtime/schedule.h"

#include <algorithm>

#include "daemon/runtime/schedule_1f1b.h"
#include "daemon/runtime/schedule_gpipe.h"

namespace rannc {

std::vector<PipelineOp> StageOps(ScheduleKind kind, int stage, int num_stages, int micro_batches) {
  if (num_stages < 1 || stage < 0 || stage >= num_stages || micro_batches < 1) return {};
  switch (kind) {
    case ScheduleKind::k1F1B: return OneFOneBOps(stage, num_stages, micro_batches);
    case ScheduleKind::kGPipe: return GPipeOps(micro_batches);
  }
  return {};
}

int MaxInFlight(ScheduleKind kind, int stage, int num_stages, int micro_batches) {
  int in_flight = 0, most = 0;
  for (const PipelineOp& op : StageOps(kind, stage, num_stages, micro_batches)) {
    in_flight += op.backward ? -1 : 1;
    most = std::max(most, in_flight);
  }
  return most;
}

}  // namespace rannc
