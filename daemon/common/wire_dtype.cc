#include "daemon/common/wire_dtype.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT64:
    case v1::INT64: return 8;
    case v1::FLOAT32:
    case v1::INT32: return 4;
    case v1::FLOAT16:
    case v1::BFLOAT16:
    case v1::INT16: return 2;
    case v1::INT8:
    case v1::UINT8:
    case v1::BOOL: return 1;
    default: return 0;
  }
}

const char* DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32: return "float32";
    case v1::FLOAT64: return "float64";
    case v1::FLOAT16: return "float16";
    case v1::BFLOAT16: return "bfloat16";
    case v1::INT64: return "int64";
    case v1::INT32: return "int32";
    case v1::INT16: return "int16";
    case v1::INT8: return "int8";
    case v1::UINT8: return "uint8";
    case v1::BOOL: return "bool";
    default: return "unspecified";
  }
}

std::string DescribeTensor(v1::DType dtype, const std::vector<int64_t>& shape) {
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<size_t> DenseBytes(v1::DType dtype, const std::vector<int64_t>& shape,
                                  absl::string_view what) {
  // Counted in bytes, so the element size cannot overflow the product either.
  int64_t bytes = static_cast<int64_t>(DTypeSize(dtype));
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unknown tensor dtype ", static_cast<int>(dtype)));
  }
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension in shape [", absl::StrJoin(shape, ", "), "]"));
    }
    if (d > 0 && bytes > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": shape [", absl::StrJoin(shape, ", "), "] has too many elements"));
    }
    bytes *= d;
  }
  return static_cast<size_t>(bytes);
}

}  // namespace rannc
