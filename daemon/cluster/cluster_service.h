// The gRPC side of the cluster: rannc.v1.ClusterService, which hands peers' heartbeats to a
// Cluster, and the PeerTransport that sends this daemon's heartbeats over gRPC. Translation
// only (STYLE.md habit 5): the decisions are Cluster's and Membership's.
//
//   auto cluster = Cluster::Create(options, MakeGrpcTransport());
//   ClusterServiceImpl service;            // registered before the server starts
//   builder.RegisterService(&service);
//   service.Attach(cluster->get());        // once the cluster exists (after the bind)
//
// Thread-safety: the service is called from gRPC's threads; before Attach it answers
// UNAVAILABLE. The attached Cluster must outlive the server. The transport is used by the
// heartbeat thread alone but is safe from any thread.
#ifndef RANNC_DAEMON_CLUSTER_CLUSTER_SERVICE_H_
#define RANNC_DAEMON_CLUSTER_CLUSTER_SERVICE_H_

#include <atomic>
#include <memory>

#include "daemon/cluster/cluster.h"
#include "daemon/security/auth.h"
#include "rannc/v1/cluster.grpc.pb.h"

namespace rannc {
namespace cluster {

class ClusterServiceImpl final : public v1::ClusterService::Service {
 public:
  void Attach(Cluster* cluster) { cluster_.store(cluster); }

  // Tokens (security/auth.h; not owned): callers must be daemons of the cluster. Unset: all.
  void set_authorizer(const security::Authorizer* auth) { auth_ = auth; }

  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;

 private:
  std::atomic<Cluster*> cluster_{nullptr};
  const security::Authorizer* auth_ = nullptr;
};

// Heartbeats over gRPC, one channel per peer, kept for the process's life. Channels retry a
// lost connection at least once a second, so a restarted peer is reached again quickly.
std::unique_ptr<PeerTransport> MakeGrpcTransport();

// Wire conversions.
void ToProto(const PeerReport& report, v1::MemberReport* proto);
PeerReport FromProto(const v1::MemberReport& proto);
// `now` turns last_seen into last_seen_ms_ago.
void ToProto(const MemberInfo& member, Clock::time_point now, v1::ClusterMember* proto);

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_CLUSTER_SERVICE_H_
