// HostTensor: a dense tensor held in host memory as raw bytes, the form in which the C++ SDK and
// the `rannc` CLI move tensors to and from ranncd. It owns its bytes (a std::string) and knows
// nothing of LibTorch: clients that do not link LibTorch build, fill and read tensors with the
// helpers below, and the conversion to the wire's rannc.v1.Tensor is a copy of the bytes.
//
// Layout: contiguous, row-major, little-endian (the wire's layout; this SDK only builds on
// little-endian hosts). A scalar has an empty shape and one element.
//
// Thread-safety: a plain value type; concurrent reads are safe, writes need external locking.
//
// Example:
//   rannc::HostTensor x = rannc::HostTensor::FromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
//   absl::StatusOr<std::vector<float>> v = x.ToVector<float>();   // {1, 2, 3, 4, 5, 6}
//   absl::StatusOr<std::vector<double>> d = x.ToDoubles();        // any dtype, widened
//   rannc::HostTensor one = rannc::HostTensor::Full(rannc::v1::BFLOAT16, {}, 1.0);
#ifndef RANNC_CLIENT_HOST_TENSOR_H_
#define RANNC_CLIENT_HOST_TENSOR_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/wire_dtype.h"
#include "rannc/v1/training.pb.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the rannc wire format is little-endian; this SDK copies bytes as they are in memory"
#endif

namespace rannc {

// DTypeSize (bytes per element) and DTypeName ("float32", ...) come from wire_dtype.h.

// Maps a C++ element type to its wire dtype; unsupported types fail to compile.
template <typename T>
constexpr v1::DType DTypeOf() {
  if constexpr (std::is_same_v<T, float>) return v1::FLOAT32;
  else if constexpr (std::is_same_v<T, double>) return v1::FLOAT64;
  else if constexpr (std::is_same_v<T, int64_t>) return v1::INT64;
  else if constexpr (std::is_same_v<T, int32_t>) return v1::INT32;
  else if constexpr (std::is_same_v<T, int16_t>) return v1::INT16;
  else if constexpr (std::is_same_v<T, int8_t>) return v1::INT8;
  else if constexpr (std::is_same_v<T, uint8_t>) return v1::UINT8;
  else if constexpr (std::is_same_v<T, bool>) return v1::BOOL;
  else static_assert(sizeof(T) == 0, "no rannc dtype for this C++ type");
}

struct HostTensor {
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  std::string data;

  // Product of `shape` (1 for a scalar). Negative dimensions count as 0.
  int64_t NumElements() const;

  // OK when the dtype is known and `data` holds exactly NumElements() elements of it.
  absl::Status Validate() const;

  // Copies `values` in as a 1-D tensor.
  template <typename T>
  static HostTensor FromVector(const std::vector<T>& values) {
    return FromVector(values, {static_cast<int64_t>(values.size())});
  }

  // Copies `values` in with `shape`; the product of `shape` should equal values.size()
  // (Validate() checks it).
  template <typename T>
  static HostTensor FromVector(const std::vector<T>& values, std::vector<int64_t> shape) {
    HostTensor t;
    t.dtype = DTypeOf<T>();
    t.shape = std::move(shape);
    if constexpr (std::is_same_v<T, bool>) {
      // std::vector<bool> is packed; the wire wants one byte per element.
      t.data.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) t.data[i] = values[i] ? 1 : 0;
    } else {
      t.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
    }
    return t;
  }

  // A scalar (empty shape) of `value`.
  template <typename T>
  static HostTensor Scalar(T value) {
    return FromVector<T>(std::vector<T>{value}, {});
  }

  // A tensor of `dtype` and `shape` with every element `value`, converted as PyTorch's
  // `tensor.to(dtype)` would (round to nearest even for float16/bfloat16, truncation toward
  // zero for integers).
  static HostTensor Full(v1::DType dtype, std::vector<int64_t> shape, double value);

  // Converts `values` into a tensor of `dtype`, as Full() converts one value.
  static absl::StatusOr<HostTensor> FromDoubles(v1::DType dtype, const std::vector<double>& values,
                                                std::vector<int64_t> shape);

  // The elements as T; fails unless dtype is exactly DTypeOf<T>() and Validate() passes.
  template <typename T>
  absl::StatusOr<std::vector<T>> ToVector() const {
    if (dtype != DTypeOf<T>()) {
      return absl::InvalidArgumentError(std::string("tensor has dtype ") +
                                        std::string(DTypeName(dtype)) + ", not " +
                                        std::string(DTypeName(DTypeOf<T>())));
    }
    if (absl::Status s = Validate(); !s.ok()) return s;
    std::vector<T> out(static_cast<size_t>(NumElements()));
    if constexpr (std::is_same_v<T, bool>) {
      for (size_t i = 0; i < out.size(); ++i) out[i] = data[i] != 0;
    } else {
      std::memcpy(out.data(), data.data(), data.size());
    }
    return out;
  }

  // The elements of any dtype widened to double (float16/bfloat16 included).
  absl::StatusOr<std::vector<double>> ToDoubles() const;

  // "float32[2, 3]".
  std::string DebugString() const;
};

// Wire conversion. ToProto copies the bytes into `data`. FromProto accepts `data` or, for a
// same-host daemon, a shared-memory reference, which it reads before returning.
v1::Tensor ToProto(const HostTensor& tensor);
void ToProto(const HostTensor& tensor, v1::Tensor* out);
absl::StatusOr<HostTensor> FromProto(const v1::Tensor& tensor);

}  // namespace rannc

#endif  // RANNC_CLIENT_HOST_TENSOR_H_
