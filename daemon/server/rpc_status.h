// absl::Status -> grpc::Status, once, at the RPC boundary (STYLE.md habit 4); and the log line
// a failed call leaves.
#ifndef RANNC_DAEMON_SERVER_RPC_STATUS_H_
#define RANNC_DAEMON_SERVER_RPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace rannc {

grpc::Status ToGrpcStatus(const absl::Status& status);
// Logs "`rpc` failed: ..." (a warning) and returns the status for gRPC.
grpc::Status FailRpc(const char* rpc, const absl::Status& status);

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_RPC_STATUS_H_
