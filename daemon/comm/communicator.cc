#include "daemon/comm/communicator.h"

namespace rannc {
namespace comm {

size_t ElementSize(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
  }
  return 0;
}

const char* DataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt64: return "int64";
    case DataType::kInt32: return "int32";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
  }
  return "unknown";
}

}  // namespace comm
}  // namespace rannc
