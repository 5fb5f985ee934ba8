#include "daemon/common/wire_dtype.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("DTypeSize and DTypeName cover every wire dtype", "[wire_dtype]") {
  CHECK(DTypeSize(v1::FLOAT64) == 8);
  CHECK(DTypeSize(v1::INT64) == 8);
  CHECK(DTypeSize(v1::FLOAT32) == 4);
  CHECK(DTypeSize(v1::INT32) == 4);
  CHECK(DTypeSize(v1::FLOAT16) == 2);
  CHECK(DTypeSize(v1::BFLOAT16) == 2);
  CHECK(DTypeSize(v1::INT16) == 2);
  CHECK(DTypeSize(v1::INT8) == 1);
  CHECK(DTypeSize(v1::UINT8) == 1);
  CHECK(DTypeSize(v1::BOOL) == 1);
  CHECK(DTypeSize(v1::DTYPE_UNSPECIFIED) == 0);
  CHECK(DTypeSize(static_cast<v1::DType>(99)) == 0);
  CHECK(std::string(DTypeName(v1::BFLOAT16)) == "bfloat16");
  CHECK(std::string(DTypeName(static_cast<v1::DType>(99))) == "unspecified");
  CHECK(DescribeTensor(v1::FLOAT32, {2, 3}) == "float32[2, 3]");
  CHECK(DescribeTensor(v1::INT64, {}) == "int64[]");
}

TEST_CASE("DenseBytes counts bytes and refuses what no memory holds", "[wire_dtype]") {
  CHECK(*DenseBytes(v1::FLOAT32, {2, 3}, "x") == 24);
  CHECK(*DenseBytes(v1::INT64, {}, "x") == 8);  // a scalar
  CHECK(*DenseBytes(v1::FLOAT16, {0, 1 << 30}, "x") == 0);

  absl::StatusOr<size_t> unknown = DenseBytes(v1::DTYPE_UNSPECIFIED, {2}, "input 'x'");
  CHECK(unknown.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(unknown.status().message() == "input 'x': unknown tensor dtype 0");

  absl::StatusOr<size_t> negative = DenseBytes(v1::FLOAT32, {-2, 3}, "input 'x'");
  CHECK(negative.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(negative.status().message() == "input 'x': negative dimension in shape [-2, 3]");

  absl::StatusOr<size_t> huge = DenseBytes(v1::FLOAT32, {int64_t{1} << 40, int64_t{1} << 40},
                                           "input 'x'");
  CHECK(huge.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(huge.status().message() ==
        "input 'x': shape [1099511627776, 1099511627776] has too many elements");
}

}  // namespace
}  // namespace rannc
