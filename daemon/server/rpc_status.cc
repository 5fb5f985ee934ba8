#include "daemon/server/rpc_status.h"

#include <string>

#include <spdlog/spdlog.h>

namespace rannc {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::Status FailRpc(const char* rpc, const absl::Status& status) {
  spdlog::warn("{} failed: {}", rpc, status.ToString());
  return ToGrpcStatus(status);
}

}  // namespace rannc
