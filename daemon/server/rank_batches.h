// How several client ranks' batches combine into the job's one (JobOptions.gather_inputs): the
// inputs concatenated in rank order, each rank given its rows of the batched outputs, and the
// gradients of the outputs put back together (those without a batch dimension, a loss, averaged
// over the ranks, as each rank differentiates the same value). Pure functions; thread-safe.
#ifndef RANNC_DAEMON_SERVER_RANK_BATCHES_H_
#define RANNC_DAEMON_SERVER_RANK_BATCHES_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/server/part_channel.h"

namespace rannc {

// Every input concatenated over the ranks (`all[rank][input]`); `rows` gets each rank's
// samples. INVALID_ARGUMENT when the ranks' inputs do not line up.
absl::StatusOr<std::vector<at::Tensor>> GatherRankInputs(
    const std::vector<std::vector<at::Tensor>>& all, std::vector<int64_t>* rows);

// Per rank, its rows of each output along `batch_dims[i]` (the whole output where it has none,
// or its size is not a multiple of the samples).
std::vector<std::vector<at::Tensor>> SplitRankOutputs(const std::vector<at::Tensor>& outputs,
                                                      const std::vector<int>& batch_dims,
                                                      const std::vector<int64_t>& rows);

// The ranks' output gradients (`all[rank]`) as the gathered batch's: batched ones concatenated
// (a rank that sent none gives zeros), the others averaged.
absl::StatusOr<OutputGrads> CombineRankGrads(const std::vector<OutputGrads>& all,
                                             const std::vector<int>& batch_dims,
                                             const std::vector<int64_t>& rows);

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_RANK_BATCHES_H_
