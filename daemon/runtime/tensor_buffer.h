// The communicator's view of a tensor: its dtype as a comm::DataType and its memory as a
// comm::Buffer (data pointer, element count, dtype, device). Shared by the pipeline engine's
// transfers and the gradient reducer's buckets. Free functions, safe from any thread.
#ifndef RANNC_DAEMON_RUNTIME_TENSOR_BUFFER_H_
#define RANNC_DAEMON_RUNTIME_TENSOR_BUFFER_H_

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"

namespace rannc {

// UNIMPLEMENTED for a dtype no communicator carries (complex, quantized); bool travels as bytes.
absl::StatusOr<comm::DataType> CommDataType(at::ScalarType type);

// `t`'s memory, which the caller keeps alive until the operation completes. INTERNAL for a
// non-contiguous tensor; UNIMPLEMENTED for a dtype CommDataType refuses or a device other than
// CPU and CUDA.
absl::StatusOr<comm::Buffer> BufferOf(const at::Tensor& t);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_TENSOR_BUFFER_H_
