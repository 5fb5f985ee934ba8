// The optimizer's state on the wire: one StateDictChunk stream (training.proto's
// OptimizerState/LoadOptimizerState, job_part.proto's between daemons), each chunk naming its
// parameter (`name`) and key (`state_key`), tensors cut as EncodeStateChunks cuts them.
//
//   EncodeOptimizerState(state, 4 << 20, [&](const v1::StateDictChunk& c) { return w->Write(c); });
//   OptimizerStateAssembler assembler;  // assembler.Add(chunk) for each, then Finish()
//
// Pure functions and a single-threaded assembler.
#ifndef RANNC_DAEMON_SERVER_OPTIMIZER_STATE_CODEC_H_
#define RANNC_DAEMON_SERVER_OPTIMIZER_STATE_CODEC_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/server/part_channel.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// CANCELLED when `write` returns false.
absl::Status EncodeOptimizerState(const std::vector<OptimizerEntry>& state, size_t chunk_bytes,
                                  const std::function<bool(const v1::StateDictChunk&)>& write);

class OptimizerStateAssembler {
 public:
  // INVALID_ARGUMENT for a chunk without a state_key, or as StateDictAssembler::Add.
  absl::Status Add(v1::StateDictChunk chunk);
  absl::StatusOr<std::vector<OptimizerEntry>> Finish();

 private:
  StateDictAssembler tensors_;  // by "param[key]" (no parameter name holds a '[')
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_OPTIMIZER_STATE_CODEC_H_
