// PartChannels over gRPC: rannc.v1.JobPartService (job_part.proto) on each member daemon, one
// channel per member, kept for the daemon's lifetime. Transport failures (the member gone or
// cut off) come back UNAVAILABLE naming it; the part's own errors keep their codes.
//
// Thread-safe, as part_channel.h says.
#ifndef RANNC_DAEMON_SERVER_GRPC_PART_CHANNEL_H_
#define RANNC_DAEMON_SERVER_GRPC_PART_CHANNEL_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "daemon/server/part_channel.h"
#include "rannc/v1/job_part.grpc.pb.h"

namespace rannc {

class GrpcPartChannels final : public PartChannels {
 public:
  absl::StatusOr<std::unique_ptr<PartChannel>> CreatePart(
      const std::string& address, const v1::JobSpec& spec, const v1::PartSpec& part,
      const std::string& model_bytes) override;

 private:
  std::shared_ptr<v1::JobPartService::Stub> Stub(const std::string& address);

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<v1::JobPartService::Stub>> stubs_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_GRPC_PART_CHANNEL_H_
