#include "daemon/cluster/cluster_service.h"

#include <map>
#include <mutex>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace cluster {
namespace {

void DevicesToProto(const std::vector<DeviceSummary>& devices,
                    google::protobuf::RepeatedPtrField<v1::DeviceInfo>* out) {
  for (const DeviceSummary& d : devices) {
    v1::DeviceInfo* device = out->Add();
    device->set_name(d.name);
    device->set_type(d.type);
    device->set_memory_bytes(d.memory_bytes);
  }
}

v1::MemberState StateToProto(MemberState state) {
  switch (state) {
    case MemberState::kUp: return v1::MEMBER_UP;
    case MemberState::kDown: return v1::MEMBER_DOWN;
    case MemberState::kUnknown: break;
  }
  return v1::MEMBER_UNKNOWN;
}

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

class GrpcTransport final : public PeerTransport {
 public:
  std::vector<absl::StatusOr<PeerReport>> HeartbeatAll(
      const std::vector<std::string>& addresses, const PeerReport& self,
      std::chrono::milliseconds deadline) override {
    v1::HeartbeatRequest request;
    ToProto(self, request.mutable_sender());
    struct Call {
      grpc::ClientContext context;
      v1::HeartbeatResponse response;
      grpc::Status status;
      std::unique_ptr<grpc::ClientAsyncResponseReader<v1::HeartbeatResponse>> reader;
    };
    // All calls in flight at once on one completion queue: a round takes one deadline at most,
    // however many peers are unreachable.
    grpc::CompletionQueue queue;
    std::vector<std::unique_ptr<Call>> calls;
    const auto until = std::chrono::system_clock::now() + deadline;
    for (size_t i = 0; i < addresses.size(); ++i) {
      calls.push_back(std::make_unique<Call>());
      Call& call = *calls.back();
      call.context.set_deadline(until);
      call.reader = Stub(addresses[i]).AsyncHeartbeat(&call.context, request, &queue);
      call.reader->Finish(&call.response, &call.status, reinterpret_cast<void*>(i));
    }
    for (size_t done = 0; done < calls.size(); ++done) {
      void* tag = nullptr;
      bool ok = false;
      if (!queue.Next(&tag, &ok)) break;
    }
    queue.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue.Next(&tag, &ok)) {
    }
    std::vector<absl::StatusOr<PeerReport>> answers;
    for (const std::unique_ptr<Call>& call : calls) {
      if (call->status.ok()) {
        answers.push_back(FromProto(call->response.responder()));
      } else {
        answers.push_back(FromGrpc(call->status));
      }
    }
    return answers;
  }

 private:
  v1::ClusterService::Stub& Stub(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    std::unique_ptr<v1::ClusterService::Stub>& stub = stubs_[address];
    if (!stub) {
      grpc::ChannelArguments args;
      // gRPC's default backoff grows to 2 minutes, far past any peer timeout.
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
      // Not a backoff: each connection attempt's deadline (gRPC's default, 20 s). At 200 ms a
      // loaded machine's handshake missed it (client/rannc_client.h); a call still ends by its
      // own deadline.
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      stub = v1::ClusterService::NewStub(
          security::PeerChannel(address, args));
    }
    return *stub;
  }

  std::mutex mu_;
  std::map<std::string, std::unique_ptr<v1::ClusterService::Stub>> stubs_;
};

}  // namespace

grpc::Status ClusterServiceImpl::Heartbeat(grpc::ServerContext* context,
                                           const v1::HeartbeatRequest* request,
                                           v1::HeartbeatResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.ClusterService/Heartbeat");
  if (!denied.ok()) return denied;
  Cluster* cluster = cluster_.load();
  if (cluster == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "ranncd is starting; try again");
  }
  absl::StatusOr<PeerReport> self = cluster->HandleHeartbeat(FromProto(request->sender()));
  if (!self.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(self.status().code()),
                        std::string(self.status().message()));
  }
  ToProto(*self, response->mutable_responder());
  return grpc::Status::OK;
}

std::unique_ptr<PeerTransport> MakeGrpcTransport() { return std::make_unique<GrpcTransport>(); }

void ToProto(const PeerReport& report, v1::MemberReport* proto) {
  proto->set_address(report.address);
  proto->set_rank(report.rank);
  proto->set_incarnation(report.incarnation);
  DevicesToProto(report.devices, proto->mutable_devices());
  proto->set_hostname(report.hostname);
  proto->set_version(report.version);
  for (const std::string& m : report.members) proto->add_members(m);
}

PeerReport FromProto(const v1::MemberReport& proto) {
  PeerReport report;
  report.address = proto.address();
  report.rank = proto.rank();
  report.incarnation = proto.incarnation();
  for (const v1::DeviceInfo& d : proto.devices()) {
    report.devices.push_back({d.name(), d.type(), d.memory_bytes()});
  }
  report.hostname = proto.hostname();
  report.version = proto.version();
  report.members.assign(proto.members().begin(), proto.members().end());
  return report;
}

void ToProto(const MemberInfo& member, Clock::time_point now, v1::ClusterMember* proto) {
  proto->set_address(member.address);
  proto->set_rank(member.rank);
  proto->set_state(StateToProto(member.state));
  proto->set_incarnation(member.incarnation);
  DevicesToProto(member.devices, proto->mutable_devices());
  proto->set_hostname(member.hostname);
  proto->set_version(member.version);
  int64_t ago = -1;
  if (member.self) {
    ago = 0;
  } else if (member.last_seen) {
    ago = std::chrono::duration_cast<std::chrono::milliseconds>(now - *member.last_seen).count();
  }
  proto->set_last_seen_ms_ago(ago);
  proto->set_self(member.self);
}

}  // namespace cluster
}  // namespace rannc
