// ChunkAssembler: the checks of a state_dict stream (rannc.v1.StateDictChunk), shared by every
// C++ side that reassembles one: ranncd's LoadStateDict into at::Tensor (StateDictAssembler in
// tensor_codec.h) and the C++ SDK's StateDict into HostTensor (client/chunking.h). It knows
// bytes only, not LibTorch: the caller allocates each entry's buffer when its first chunk
// arrives, and the assembler copies every chunk's bytes straight into it, once.
//
//   std::map<std::string, std::string> bytes;
//   ChunkAssembler assembler(absl::StatusCode::kDataLoss,
//                            [&](const ChunkAssembler::Entry& e) -> absl::StatusOr<char*> {
//                              std::string& b = bytes[e.name];
//                              b.resize(e.total_bytes);
//                              return b.data();
//                            });
//   while (reader->Read(&chunk)) RETURN_IF_ERROR(assembler.Add(chunk));
//   RETURN_IF_ERROR(assembler.Finish());
//
// What a stream must be: an entry's first chunk has offset 0, a known dtype, a shape with no
// negative dimension and a total_bytes equal to dtype size x elements; its later chunks repeat
// its dtype, shape and total_bytes and continue where the one before ended, with no byte past
// the total; no entry comes twice; at Finish every entry is complete. Chunks of different
// entries may interleave. Errors name the entry ("state_dict entry 'w': ...").
//
// Thread-safety: used by one thread at a time. The buffers belong to the caller and must stay
// where they are (and alive) until the last Add.
#ifndef RANNC_DAEMON_COMMON_CHUNK_ASSEMBLER_H_
#define RANNC_DAEMON_COMMON_CHUNK_ASSEMBLER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

class ChunkAssembler {
 public:
  // An entry as its first chunk announces it, checked as above.
  struct Entry {
    std::string name;
    v1::DType dtype = v1::DTYPE_UNSPECIFIED;
    std::vector<int64_t> shape;
    uint64_t total_bytes = 0;
  };
  // Where `entry`'s total_bytes go (any pointer, null too, when total_bytes is 0), or why there
  // is no room (Add returns that status as it is, e.g. RESOURCE_EXHAUSTED).
  using Allocate = std::function<absl::StatusOr<char*>(const Entry& entry)>;

  // `code`: the status code of a malformed stream: INVALID_ARGUMENT where a client sent it
  // (the daemon), DATA_LOSS where a daemon did (the SDK).
  ChunkAssembler(absl::StatusCode code, Allocate allocate);

  ChunkAssembler(const ChunkAssembler&) = delete;
  ChunkAssembler& operator=(const ChunkAssembler&) = delete;

  // Checks `chunk` and copies its bytes into its entry's buffer (allocated at the first chunk).
  absl::Status Add(const v1::StateDictChunk& chunk);

  // OK when every entry is complete; else names each incomplete one with the bytes it has.
  absl::Status Finish() const;

  // Names of entries any of whose chunks had is_buffer set.
  const std::set<std::string>& buffers() const { return buffers_; }

 private:
  struct Partial {
    Entry entry;
    char* buffer = nullptr;
    uint64_t filled = 0;
  };

  const absl::StatusCode code_;
  const Allocate allocate_;
  std::map<std::string, Partial> partial_;
  std::set<std::string> buffers_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_CHUNK_ASSEMBLER_H_
