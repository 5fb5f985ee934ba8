#include "daemon/runtime/schedule_1f1b.h"

#include <algorithm>

namespace rannc {

std::vector<PipelineOp> OneFOneBOps(int stage, int num_stages, int micro_batches) {
  std::vector<PipelineOp> ops;
  ops.reserve(2 * micro_batches);
  const int warmup = std::min(num_stages - stage - 1, micro_batches);
  int next_f = 0, next_b = 0;
  for (; next_f < warmup; ++next_f) ops.push_back({false, next_f});
  while (next_f < micro_batches) {
    ops.push_back({false, next_f++});
    ops.push_back({true, next_b++});
  }
  while (next_b < micro_batches) ops.push_back({true, next_b++});
  return ops;
}

}  // namespace rannc
