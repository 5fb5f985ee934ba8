// The wire's element types (rannc.v1.DType) without LibTorch: bytes per element, the names users
// know, and the byte count of a dense tensor. The one dtype table that both ranncd (tensor_codec.h
// maps DType to at::ScalarType) and the torch-free C++ SDK (client/host_tensor.h) use.
//
//   DTypeSize(v1::BFLOAT16)                               // 2
//   DescribeTensor(v1::FLOAT32, {2, 3})                   // "float32[2, 3]"
//   DenseBytes(v1::FLOAT32, {2, 3}, "input 'x'")          // 24
//
// Pure free functions, safe from any thread.
#ifndef RANNC_DAEMON_COMMON_WIRE_DTYPE_H_
#define RANNC_DAEMON_COMMON_WIRE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or an unknown value.
size_t DTypeSize(v1::DType dtype);

// "float32", "int64", ...: the names PyTorch prints; "unspecified" for an unknown value.
const char* DTypeName(v1::DType dtype);

// "float32[2, 3]".
std::string DescribeTensor(v1::DType dtype, const std::vector<int64_t>& shape);

// Bytes of a dense tensor of `dtype` and `shape`. INVALID_ARGUMENT, naming `what`, for an
// unknown dtype, a negative dimension or a size past int64's range (never allocatable).
absl::StatusOr<size_t> DenseBytes(v1::DType dtype, const std::vector<int64_t>& shape,
                                  absl::string_view what);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_WIRE_DTYPE_H_
