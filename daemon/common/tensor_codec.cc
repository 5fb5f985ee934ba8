#include "daemon/common/tensor_codec.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/host_buffer_pool.h"
#include "daemon/common/status.h"
#include "daemon/common/wire_dtype.h"

namespace rannc {

absl::StatusOr<at::ScalarType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32: return at::kFloat;
    case v1::FLOAT64: return at::kDouble;
    case v1::FLOAT16: return at::kHalf;
    case v1::BFLOAT16: return at::kBFloat16;
    case v1::INT64: return at::kLong;
    case v1::INT32: return at::kInt;
    case v1::INT16: return at::kShort;
    case v1::INT8: return at::kChar;
    case v1::UINT8: return at::kByte;
    case v1::BOOL: return at::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor dtype ", static_cast<int>(dtype)));
  }
}

absl::StatusOr<v1::DType> ToProtoDType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return v1::FLOAT32;
    case at::kDouble: return v1::FLOAT64;
    case at::kHalf: return v1::FLOAT16;
    case at::kBFloat16: return v1::BFLOAT16;
    case at::kLong: return v1::INT64;
    case at::kInt: return v1::INT32;
    case at::kShort: return v1::INT16;
    case at::kChar: return v1::INT8;
    case at::kByte: return v1::UINT8;
    case at::kBool: return v1::BOOL;
    default:
      return absl::UnimplementedError(
          absl::StrCat("tensors of dtype ", c10::toString(type), " cannot be transferred"));
  }
}

std::string DTypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
  }
}

std::string DescribeTensor(at::ScalarType type, at::IntArrayRef shape) {
  return absl::StrCat(DTypeName(type), "[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto, absl::string_view what,
                                        const ShmDirectory* shm) {
  absl::StatusOr<at::ScalarType> type = FromProtoDType(proto.dtype());
  if (!type.ok()) return Annotate(type.status(), what);
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  absl::StatusOr<size_t> bytes = DenseBytes(proto.dtype(), shape, what);
  if (!bytes.ok()) return bytes.status();
  const size_t expected = *bytes;
  if (proto.has_shm() && shm == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": shared-memory tensors are not accepted here; send bytes inline"));
  }
  if (!proto.has_shm() && proto.data().size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", proto.data().size(), " bytes of data for ", DescribeTensor(*type, shape),
        ", which needs ", expected));
  }
  // A shared-memory reference is checked (the file, the region's size and bounds) before the
  // tensor is allocated: a shape that lies costs nothing.
  std::optional<ShmDirectory::Reader> region;
  if (proto.has_shm()) {
    absl::StatusOr<ShmDirectory::Reader> opened = shm->OpenRegion(proto.shm(), expected);
    if (!opened.ok()) return Annotate(opened.status(), what);
    region.emplace(std::move(*opened));
  }
  at::Tensor tensor;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, what, [&] {
    tensor = HostBufferPool::Default().Allocate(shape, *type);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (region.has_value()) {
    absl::Status read = region->Read(tensor.data_ptr());
    if (!read.ok()) return Annotate(read, what);
  } else if (expected > 0) {
    std::memcpy(tensor.data_ptr(), proto.data().data(), expected);
  }
  return tensor;
}

absl::Status EncodeTensor(const at::Tensor& tensor, v1::Tensor* proto,
                          ShmDirectory::Writer* reply) {
  absl::StatusOr<v1::DType> dtype = ToProtoDType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  proto->set_dtype(*dtype);
  proto->clear_shape();
  for (int64_t d : tensor.sizes()) proto->add_shape(d);
  at::Tensor host = tensor.detach();
  if (!host.device().is_cpu()) host = host.cpu();
  host = host.contiguous();
  const size_t bytes = host.numel() * host.element_size();
  if (reply != nullptr && bytes > 0 && reply->Write(host.data_ptr(), bytes, proto->mutable_shm())) {
    return absl::OkStatus();
  }
  proto->clear_shm();
  std::string* data = proto->mutable_data();
  data->resize(bytes);
  if (bytes > 0) std::memcpy(data->data(), host.data_ptr(), bytes);
  return absl::OkStatus();
}

void EncodeSpec(const at::Tensor& tensor, v1::TensorSpec* spec) {
  EncodeSpec(tensor.scalar_type(), tensor.sizes(), spec);
}

void EncodeSpec(at::ScalarType dtype, c10::IntArrayRef shape, v1::TensorSpec* spec) {
  absl::StatusOr<v1::DType> wire = ToProtoDType(dtype);
  spec->set_dtype(wire.ok() ? *wire : v1::DTYPE_UNSPECIFIED);
  for (int64_t d : shape) spec->add_shape(d);
}

absl::Status EncodeStateChunks(const std::string& name, const at::Tensor& tensor, bool is_buffer,
                               size_t chunk_bytes,
                               const std::function<bool(const v1::StateDictChunk&)>& write) {
  const at::Tensor t = tensor.contiguous();
  absl::StatusOr<v1::DType> dtype = ToProtoDType(t.scalar_type());
  if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat("state_dict '", name, "'"));
  const size_t total = t.numel() * t.element_size();
  const char* data = static_cast<const char*>(t.data_ptr());
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk_bytes, total - offset);
    v1::StateDictChunk chunk;
    chunk.set_name(name);
    chunk.set_dtype(*dtype);
    for (int64_t d : t.sizes()) chunk.add_shape(d);
    chunk.set_total_bytes(total);
    chunk.set_offset(offset);
    chunk.set_is_buffer(is_buffer);
    chunk.set_data(data + offset, n);
    if (!write(chunk)) return absl::CancelledError("the state_dict stream was closed");
    offset += n;
  } while (offset < total);
  return absl::OkStatus();
}

StateDictAssembler::StateDictAssembler()
    : chunks_(absl::StatusCode::kInvalidArgument,
              [this](const ChunkAssembler::Entry& entry) { return Allocate(entry); }) {}

absl::StatusOr<char*> StateDictAssembler::Allocate(const ChunkAssembler::Entry& entry) {
  absl::StatusOr<at::ScalarType> type = FromProtoDType(entry.dtype);
  if (!type.ok()) return type.status();
  at::Tensor tensor;
  absl::Status allocated = TorchCall(absl::StatusCode::kResourceExhausted,
                                     absl::StrCat("state_dict entry '", entry.name, "'"), [&] {
                                       tensor = at::empty(entry.shape, at::dtype(*type));
                                       return absl::OkStatus();
                                     });
  if (!allocated.ok()) return allocated;
  state_[entry.name] = tensor;
  return static_cast<char*>(tensor.data_ptr());
}

absl::StatusOr<std::map<std::string, at::Tensor>> StateDictAssembler::Finish() {
  absl::Status complete = chunks_.Finish();
  if (!complete.ok()) return complete;
  return std::move(state_);
}

}  // namespace rannc
