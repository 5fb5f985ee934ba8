#include "daemon/runtime/tensor_buffer.h"

#include "absl/strings/str_cat.h"

namespace rannc {

absl::StatusOr<comm::DataType> CommDataType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return comm::DataType::kFloat32;
    case at::kDouble: return comm::DataType::kFloat64;
    case at::kHalf: return comm::DataType::kFloat16;
    case at::kBFloat16: return comm::DataType::kBFloat16;
    case at::kLong: return comm::DataType::kInt64;
    case at::kInt: return comm::DataType::kInt32;
    case at::kChar: return comm::DataType::kInt8;
    case at::kByte: return comm::DataType::kUInt8;
    case at::kBool: return comm::DataType::kUInt8;
    default:
      return absl::UnimplementedError(
          absl::StrCat("no communicator dtype for ", c10::toString(type)));
  }
}

absl::StatusOr<comm::Buffer> BufferOf(const at::Tensor& t) {
  absl::StatusOr<comm::DataType> type = CommDataType(t.scalar_type());
  if (!type.ok()) return type.status();
  if (!t.is_contiguous()) return absl::InternalError("communicating a non-contiguous tensor");
  const at::Device device = t.device();
  if (!device.is_cpu() && !device.is_cuda()) {
    return absl::UnimplementedError(absl::StrCat("no communicator for ", device.str()));
  }
  return comm::Buffer{t.data_ptr(), static_cast<size_t>(t.numel()), *type,
                      device.is_cuda() ? comm::DeviceKind::kCuda : comm::DeviceKind::kCpu,
                      device.has_index() ? device.index() : 0};
}

}  // namespace rannc
