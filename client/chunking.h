// Splitting large payloads into stream messages and putting them back together: model bytes for
// CreateJob/AddMode, and state_dict tensors as rannc.v1.StateDictChunk (StateDict, LoadStateDict).
// Owns nothing beyond what it returns; the string_views from SplitBytes point into the caller's
// buffer and live as long as it does.
//
// Thread-safety: the free functions are pure. A HostStateDictAssembler is used by one thread.
//
// Example:
//   for (std::string_view piece : rannc::SplitBytes(model, 1 << 20)) Send(piece);
//
//   rannc::HostStateDictAssembler assembler;
//   while (reader->Read(&chunk)) RETURN_IF_ERROR(assembler.Add(chunk));
//   absl::StatusOr<rannc::NamedTensors> state = std::move(assembler).Finish();
#ifndef RANNC_CLIENT_CHUNKING_H_
#define RANNC_CLIENT_CHUNKING_H_

#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/host_tensor.h"
#include "daemon/common/chunk_assembler.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// Tensors by name, ordered so that iteration (and hence streaming) is deterministic.
using NamedTensors = std::map<std::string, HostTensor>;

// Consecutive pieces of `bytes`, each at most `max_chunk` (> 0) bytes; none for empty input.
std::vector<std::string_view> SplitBytes(std::string_view bytes, size_t max_chunk);

// The StateDictChunks that carry one tensor, each with at most `max_chunk` (> 0) data bytes.
// A tensor with no elements still yields one chunk, so that its name and shape arrive.
std::vector<v1::StateDictChunk> ToStateDictChunks(const std::string& name,
                                                  const HostTensor& tensor, bool is_buffer,
                                                  size_t max_chunk);

// Rebuilds named host tensors (the daemon's StateDictAssembler makes at::Tensors) from
// StateDictChunks, with ChunkAssembler's checks
// (daemon/common/chunk_assembler.h): chunks of different tensors may interleave; the chunks of
// one tensor arrive in offset order with no gap or overlap and agree on dtype, shape and
// total_bytes. A malformed stream is DATA_LOSS. Each tensor's bytes are allocated at its first
// chunk and the chunks copied into them.
class HostStateDictAssembler {
 public:
  HostStateDictAssembler();
  HostStateDictAssembler(const HostStateDictAssembler&) = delete;
  HostStateDictAssembler& operator=(const HostStateDictAssembler&) = delete;

  absl::Status Add(const v1::StateDictChunk& chunk) { return chunks_.Add(chunk); }

  // Fails if any tensor is incomplete. Names whose chunks had is_buffer set are in buffers().
  absl::StatusOr<NamedTensors> Finish() &&;

  const std::set<std::string>& buffers() const { return chunks_.buffers(); }

 private:
  absl::StatusOr<char*> Allocate(const ChunkAssembler::Entry& entry);

  NamedTensors tensors_;
  ChunkAssembler chunks_;  // allocates into tensors_
};

}  // namespace rannc

#endif  // RANNC_CLIENT_CHUNKING_H_
