// GPipe: every forward of the step, then every backward in reverse micro-batch order (the
// order autograd would free activations in). All m micro-batches are in flight at once.
#ifndef RANNC_DAEMON_RUNTIME_SCHEDULE_GPIPE_H_
#define RANNC_DAEMON_RUNTIME_SCHEDULE_GPIPE_H_

#include <vector>

#include "daemon/runtime/schedule.h"

namespace rannc {

std::vector<PipelineOp> GPipeOps(int micro_batches);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_SCHEDULE_GPIPE_H_
