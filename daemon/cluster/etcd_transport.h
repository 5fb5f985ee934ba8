// Membership through etcd (ranncd --cluster-store): a PeerTransport (cluster.h) for which a
// "heartbeat" is a read of etcd, not a call to each peer. Each daemon's report (the wire
// MemberReport) lives under /rannc/members/<address>, written under the daemon's lease at every
// heartbeat interval; every daemon watches that prefix and answers HeartbeatAll from what it
// has seen. A member whose key is there answers; one whose key goes (its lease ended:
// stopped, revoked at once; killed, or cut off from etcd, after its TTL) is DOWN at the next
// heartbeat round (TakeLost), without waiting for the peer timeout. No daemon calls another to
// learn it is alive. Every address that has had a key is a member found (Discovered): without
// --peers, that is the member list.
//
//   auto cluster = Cluster::Create(options, MakeEtcdTransport(etcd, lease));
//
// Thread-safe; `etcd` must outlive the transport.
#ifndef RANNC_DAEMON_CLUSTER_ETCD_TRANSPORT_H_
#define RANNC_DAEMON_CLUSTER_ETCD_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/cluster/cluster.h"
#include "daemon/cluster/etcd_client.h"

namespace rannc {
namespace cluster {

inline constexpr char kEtcdMembersPrefix[] = "/rannc/members/";

// Reads the members already registered, then watches for the rest.
absl::StatusOr<std::unique_ptr<PeerTransport>> MakeEtcdTransport(EtcdClient* etcd,
                                                                 int64_t lease);

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_ETCD_TRANSPORT_H_
