// 1F1B (PipeDream-flush): stage s of S first runs min(S - s - 1, m) forwards, then alternates
// one forward and one backward, then runs the remaining backwards. At most min(S - s, m)
// micro-batches are in flight on stage s, whatever m is.
#ifndef RANNC_DAEMON_RUNTIME_SCHEDULE_1F1B_H_
#define RANNC_DAEMON_RUNTIME_SCHEDULE_1F1B_H_

#include <vector>

#include "daemon/runtime/schedule.h"

namespace rannc {

std::vector<PipelineOp> OneFOneBOps(int stage, int num_stages, int micro_batches);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_SCHEDULE_1F1B_H_
