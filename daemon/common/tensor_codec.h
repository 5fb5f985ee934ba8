// Conversion between the wire's rannc.v1.Tensor (dtype + shape + raw bytes) and at::Tensor.
//
// Decoding validates everything a client can get wrong (unknown dtype, negative dims, a byte
// count that does not match the shape) and names the tensor in the error, since clients send
// several per request. Decoding copies the bytes once into a fresh CPU tensor the caller owns;
// encoding copies once out of a (possibly non-contiguous, possibly device) tensor. Stateless
// and thread-safe.
#ifndef RANNC_DAEMON_COMMON_TENSOR_CODEC_H_
#define RANNC_DAEMON_COMMON_TENSOR_CODEC_H_

#include <functional>
#include <map>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/common/chunk_assembler.h"
#include "daemon/common/shm_transfer.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

absl::StatusOr<at::ScalarType> FromProtoDType(v1::DType dtype);
absl::StatusOr<v1::DType> ToProtoDType(at::ScalarType type);

// "float32", "int64", ... as users write them in Python. (The wire's DType has its own, in
// wire_dtype.h, with DTypeSize and DenseBytes.)
std::string DTypeName(at::ScalarType type);
// "float32[8, 16]".
std::string DescribeTensor(at::ScalarType type, at::IntArrayRef shape);

// `what` names the tensor in errors, e.g. "input 'x' (#0)". Bytes given by Tensor.shm are read
// through `shm`; without one they are refused.
absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto, absl::string_view what,
                                        const ShmDirectory* shm = nullptr);

// With a `reply` region that has room, the bytes go there (Tensor.shm); else inline.
absl::Status EncodeTensor(const at::Tensor& tensor, v1::Tensor* proto,
                          ShmDirectory::Writer* reply = nullptr);

void EncodeSpec(const at::Tensor& tensor, v1::TensorSpec* spec);
void EncodeSpec(at::ScalarType dtype, c10::IntArrayRef shape, v1::TensorSpec* spec);

// One state_dict entry as StateDictChunks of at most `chunk_bytes` of data each (at least one,
// also for an empty tensor), handed to `write` in order; stops when `write` returns false
// (CANCELLED). INVALID_ARGUMENT for a dtype the wire cannot carry.
absl::Status EncodeStateChunks(const std::string& name, const at::Tensor& tensor, bool is_buffer,
                               size_t chunk_bytes,
                               const std::function<bool(const v1::StateDictChunk&)>& write);

// Reassembles state_dict entries from StateDictChunks (EncodeStateChunks' output) into CPU
// tensors, with ChunkAssembler's checks (chunk_assembler.h; a malformed stream is
// INVALID_ARGUMENT, a tensor that cannot be allocated RESOURCE_EXHAUSTED). Each entry's tensor
// is allocated at its first chunk and the chunks' bytes are copied straight into it. One thread.
class StateDictAssembler {
 public:
  StateDictAssembler();
  StateDictAssembler(const StateDictAssembler&) = delete;
  StateDictAssembler& operator=(const StateDictAssembler&) = delete;

  absl::Status Add(const v1::StateDictChunk& chunk) { return chunks_.Add(chunk); }
  // Fails if any entry is incomplete; else hands the tensors over.
  absl::StatusOr<std::map<std::string, at::Tensor>> Finish();

 private:
  absl::StatusOr<char*> Allocate(const ChunkAssembler::Entry& entry);

  std::map<std::string, at::Tensor> state_;
  ChunkAssembler chunks_;  // allocates into state_
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_TENSOR_CODEC_H_
