#include "daemon/runtime/schedule_gpipe.h"

namespace rannc {

std::vector<PipelineOp> GPipeOps(int micro_batches) {
  std::vector<PipelineOp> ops;
  ops.reserve(2 * micro_batches);
  for (int i = 0; i < micro_batches; ++i) ops.push_back({false, i});
  for (int i = micro_batches - 1; i >= 0; --i) ops.push_back({true, i});
  return ops;
}

}  // namespace rannc
