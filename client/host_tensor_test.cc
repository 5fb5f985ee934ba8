#include "client/host_tensor.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>

namespace rannc {
namespace {

uint16_t Bits16(const HostTensor& t, size_t i) {
  uint16_t b;
  std::memcpy(&b, t.data.data() + 2 * i, 2);
  return b;
}

TEST_CASE("HostTensor round-trips typed vectors", "[host_tensor]") {
  HostTensor f = HostTensor::FromVector<float>({1.5f, -2.f, 3.25f, 0.f, 7.f, 8.f}, {2, 3});
  CHECK(f.dtype == v1::FLOAT32);
  CHECK(f.shape == std::vector<int64_t>{2, 3});
  CHECK(f.data.size() == 24);
  CHECK(f.Validate().ok());
  CHECK(*f.ToVector<float>() == std::vector<float>{1.5f, -2.f, 3.25f, 0.f, 7.f, 8.f});
  CHECK(*f.ToDoubles() == std::vector<double>{1.5, -2, 3.25, 0, 7, 8});

  HostTensor i = HostTensor::FromVector<int64_t>({-1, 1LL << 40, 3});
  CHECK(i.shape == std::vector<int64_t>{3});
  CHECK(*i.ToVector<int64_t>() == std::vector<int64_t>{-1, 1LL << 40, 3});

  HostTensor b = HostTensor::FromVector<bool>({true, false, true});
  CHECK(b.data == std::string("\x01\x00\x01", 3));
  CHECK(*b.ToVector<bool>() == std::vector<bool>{true, false, true});

  HostTensor s = HostTensor::Scalar(2.5);
  CHECK(s.shape.empty());
  CHECK(s.NumElements() == 1);
  CHECK(*s.ToVector<double>() == std::vector<double>{2.5});
}

TEST_CASE("HostTensor::Validate rejects inconsistent tensors", "[host_tensor]") {
  HostTensor t = HostTensor::FromVector<float>({1, 2, 3, 4}, {2, 2});
  REQUIRE(t.Validate().ok());

  HostTensor wrong_size = t;
  wrong_size.shape = {3, 2};
  CHECK(wrong_size.Validate().code() == absl::StatusCode::kInvalidArgument);

  HostTensor negative = t;
  negative.shape = {-2, -2};
  CHECK(!negative.Validate().ok());

  HostTensor no_dtype = t;
  no_dtype.dtype = v1::DTYPE_UNSPECIFIED;
  CHECK(!no_dtype.Validate().ok());

  CHECK(t.ToVector<int64_t>().status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(!wrong_size.ToVector<float>().ok());
  CHECK(!wrong_size.ToDoubles().ok());
}

TEST_CASE("HostTensor::Full converts to half precision as PyTorch does", "[host_tensor]") {
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, 1.0), 0) == 0x3c00);
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, -2.0), 0) == 0xc000);
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, 65504.0), 0) == 0x7bff);
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, 65520.0), 0) == 0x7c00);  // overflows to inf
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, std::ldexp(1.0, -24)), 0) == 0x0001);
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, std::ldexp(1.0, -25)), 0) == 0x0000);  // tie->even
  CHECK(Bits16(HostTensor::Full(v1::FLOAT16, {}, 1.0 / 3.0), 0) == 0x3555);
  CHECK(Bits16(HostTensor::Full(v1::BFLOAT16, {}, 1.0), 0) == 0x3f80);
  CHECK(Bits16(HostTensor::Full(v1::BFLOAT16, {}, 1.0 / 3.0), 0) == 0x3eab);
  CHECK(Bits16(HostTensor::Full(v1::BFLOAT16, {}, std::nan("")), 0) == 0x7fc0);

  HostTensor ints = HostTensor::Full(v1::INT32, {2, 2}, -3.7);
  CHECK(*ints.ToVector<int32_t>() == std::vector<int32_t>{-3, -3, -3, -3});
}

TEST_CASE("every finite float16 and bfloat16 survives a round trip through double",
          "[host_tensor]") {
  for (v1::DType dtype : {v1::FLOAT16, v1::BFLOAT16}) {
    std::vector<uint16_t> all;
    for (uint32_t b = 0; b < 65536; ++b) {
      const uint16_t bits = static_cast<uint16_t>(b);
      const bool nan = dtype == v1::FLOAT16 ? ((bits & 0x7c00) == 0x7c00 && (bits & 0x3ff))
                                            : ((bits & 0x7f80) == 0x7f80 && (bits & 0x7f));
      if (!nan) all.push_back(bits);
    }
    HostTensor t;
    t.dtype = dtype;
    t.shape = {static_cast<int64_t>(all.size())};
    t.data.assign(reinterpret_cast<const char*>(all.data()), all.size() * 2);
    absl::StatusOr<std::vector<double>> values = t.ToDoubles();
    REQUIRE(values.ok());
    CHECK((*values)[0] == 0.0);
    absl::StatusOr<HostTensor> back = HostTensor::FromDoubles(dtype, *values, t.shape);
    REQUIRE(back.ok());
    size_t mismatches = 0;
    for (size_t i = 0; i < all.size(); ++i) mismatches += Bits16(*back, i) != all[i];
    CHECK(mismatches == 0);
  }
}

TEST_CASE("HostTensor::FromDoubles checks the element count", "[host_tensor]") {
  CHECK(!HostTensor::FromDoubles(v1::FLOAT32, {1, 2, 3}, {2, 2}).ok());
  CHECK(!HostTensor::FromDoubles(v1::DTYPE_UNSPECIFIED, {1}, {1}).ok());
  absl::StatusOr<HostTensor> u8 = HostTensor::FromDoubles(v1::UINT8, {0, 255, 7}, {3});
  REQUIRE(u8.ok());
  CHECK(*u8->ToVector<uint8_t>() == std::vector<uint8_t>{0, 255, 7});
}

TEST_CASE("HostTensor converts to and from the wire", "[host_tensor]") {
  HostTensor t = HostTensor::FromVector<int32_t>({4, 5, 6, 7, 8, 9}, {3, 2});
  v1::Tensor wire = ToProto(t);
  CHECK(wire.dtype() == v1::INT32);
  CHECK(wire.shape_size() == 2);
  CHECK(wire.data() == t.data);
  absl::StatusOr<HostTensor> back = FromProto(wire);
  REQUIRE(back.ok());
  CHECK(back->dtype == t.dtype);
  CHECK(back->shape == t.shape);
  CHECK(back->data == t.data);

  wire.mutable_data()->pop_back();
  CHECK(FromProto(wire).status().code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("FromProto reads a shared-memory reference", "[host_tensor]") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp ? tmp : "/tmp") + "/host_tensor_shm_" +
                           std::to_string(::getpid());
  HostTensor t = HostTensor::FromVector<float>({1, 2, 3});
  {
    std::ofstream f(path, std::ios::binary);
    f << "prefix!!" << t.data << "suffix";
  }
  v1::Tensor wire;
  wire.set_dtype(v1::FLOAT32);
  wire.add_shape(3);
  wire.mutable_shm()->set_path(path);
  wire.mutable_shm()->set_offset(8);
  wire.mutable_shm()->set_length(12);
  absl::StatusOr<HostTensor> back = FromProto(wire);
  REQUIRE(back.ok());
  CHECK(*back->ToVector<float>() == std::vector<float>{1, 2, 3});

  wire.mutable_shm()->set_offset(100);
  CHECK(!FromProto(wire).ok());
  wire.mutable_shm()->set_path(path + ".missing");
  CHECK(FromProto(wire).status().code() == absl::StatusCode::kUnavailable);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace rannc
