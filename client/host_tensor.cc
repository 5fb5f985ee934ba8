#include "client/host_tensor.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// IEEE binary16, round to nearest even, as PyTorch's c10::Half does.
uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: inf
  if (abs < 0x38800000u) {                         // below the smallest normal half
    if (abs < 0x33000000u) return sign;            // rounds to zero
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t midpoint = 1u << (shift - 1u);
    if (rest > midpoint || (rest == midpoint && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24, exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t FloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // a quiet NaN
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

template <typename T>
void Put(std::string& data, size_t index, T value) {
  std::memcpy(data.data() + index * sizeof(T), &value, sizeof(T));
}

template <typename T>
T Get(const std::string& data, size_t index) {
  T value;
  std::memcpy(&value, data.data() + index * sizeof(T), sizeof(T));
  return value;
}

// Integer dtypes take the value truncated toward zero and wrapped, like a C cast through int64.
void PutDouble(v1::DType dtype, std::string& data, size_t i, double v) {
  switch (dtype) {
    case v1::FLOAT32: Put<float>(data, i, static_cast<float>(v)); break;
    case v1::FLOAT64: Put<double>(data, i, v); break;
    case v1::FLOAT16: Put<uint16_t>(data, i, FloatToHalf(static_cast<float>(v))); break;
    case v1::BFLOAT16: Put<uint16_t>(data, i, FloatToBFloat16(static_cast<float>(v))); break;
    case v1::INT64: Put<int64_t>(data, i, static_cast<int64_t>(v)); break;
    case v1::INT32: Put<int32_t>(data, i, static_cast<int32_t>(static_cast<int64_t>(v))); break;
    case v1::INT16: Put<int16_t>(data, i, static_cast<int16_t>(static_cast<int64_t>(v))); break;
    case v1::INT8: Put<int8_t>(data, i, static_cast<int8_t>(static_cast<int64_t>(v))); break;
    case v1::UINT8: Put<uint8_t>(data, i, static_cast<uint8_t>(static_cast<int64_t>(v))); break;
    case v1::BOOL: Put<uint8_t>(data, i, v != 0.0 ? 1 : 0); break;
    default: break;
  }
}

double GetDouble(v1::DType dtype, const std::string& data, size_t i) {
  switch (dtype) {
    case v1::FLOAT32: return Get<float>(data, i);
    case v1::FLOAT64: return Get<double>(data, i);
    case v1::FLOAT16: return HalfToFloat(Get<uint16_t>(data, i));
    case v1::BFLOAT16: return BFloat16ToFloat(Get<uint16_t>(data, i));
    case v1::INT64: return static_cast<double>(Get<int64_t>(data, i));
    case v1::INT32: return Get<int32_t>(data, i);
    case v1::INT16: return Get<int16_t>(data, i);
    case v1::INT8: return Get<int8_t>(data, i);
    case v1::UINT8: return Get<uint8_t>(data, i);
    case v1::BOOL: return Get<uint8_t>(data, i) != 0 ? 1.0 : 0.0;
    default: return 0.0;
  }
}

absl::StatusOr<std::string> ReadShm(const v1::ShmRef& ref) {
  const int fd = ::open(ref.path().c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot open the daemon's shared-memory file ", ref.path(), ": ", std::strerror(errno),
        " (shared memory works only when client and daemon share a host)"));
  }
  std::string bytes(ref.length(), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done,
                              static_cast<off_t>(ref.offset() + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "file too short";
      ::close(fd);
      return absl::DataLossError(absl::StrCat("reading ", ref.length(), " bytes at offset ",
                                              ref.offset(), " of ", ref.path(), ": ", why));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return bytes;
}

}  // namespace

int64_t HostTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d < 0 ? 0 : d;
  return n;
}

absl::Status HostTensor::Validate() const {
  const size_t element = DTypeSize(dtype);
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor has no valid dtype (", static_cast<int>(dtype), ")"));
  }
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor shape [", absl::StrJoin(shape, ", "),
                                                     "] has a negative dimension"));
    }
  }
  const uint64_t expected = static_cast<uint64_t>(NumElements()) * element;
  if (data.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(DebugString(), " needs ", expected,
                                                   " bytes of data but holds ", data.size()));
  }
  return absl::OkStatus();
}

HostTensor HostTensor::Full(v1::DType dtype, std::vector<int64_t> shape, double value) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const size_t n = static_cast<size_t>(t.NumElements());
  t.data.assign(n * DTypeSize(dtype), '\0');
  for (size_t i = 0; i < n; ++i) PutDouble(dtype, t.data, i, value);
  return t;
}

absl::StatusOr<HostTensor> HostTensor::FromDoubles(v1::DType dtype,
                                                   const std::vector<double>& values,
                                                   std::vector<int64_t> shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  if (DTypeSize(dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("no such dtype: ", static_cast<int>(dtype)));
  }
  if (static_cast<size_t>(t.NumElements()) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", t.DebugString(), " holds ",
                                                   t.NumElements(), " elements, not ",
                                                   values.size()));
  }
  t.data.assign(values.size() * DTypeSize(dtype), '\0');
  for (size_t i = 0; i < values.size(); ++i) PutDouble(dtype, t.data, i, values[i]);
  return t;
}

absl::StatusOr<std::vector<double>> HostTensor::ToDoubles() const {
  if (absl::Status s = Validate(); !s.ok()) return s;
  std::vector<double> out(static_cast<size_t>(NumElements()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = GetDouble(dtype, data, i);
  return out;
}

std::string HostTensor::DebugString() const {
  return DescribeTensor(dtype, shape);
}

void ToProto(const HostTensor& tensor, v1::Tensor* out) {
  out->Clear();
  out->set_dtype(tensor.dtype);
  out->mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
  out->set_data(tensor.data);
}

v1::Tensor ToProto(const HostTensor& tensor) {
  v1::Tensor out;
  ToProto(tensor, &out);
  return out;
}

absl::StatusOr<HostTensor> FromProto(const v1::Tensor& tensor) {
  HostTensor t;
  t.dtype = tensor.dtype();
  t.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (tensor.has_shm() && tensor.data().empty()) {
    absl::StatusOr<std::string> bytes = ReadShm(tensor.shm());
    if (!bytes.ok()) return bytes.status();
    t.data = *std::move(bytes);
  } else {
    t.data = tensor.data();
  }
  if (absl::Status s = t.Validate(); !s.ok()) {
    return absl::DataLossError(absl::StrCat("the daemon sent a malformed tensor: ", s.message()));
  }
  return t;
}

}  // namespace rannc
