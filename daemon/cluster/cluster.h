// Cluster: this daemon's view of its cluster, kept current by heartbeats. Owned by Daemon.
//
//   ClusterOptions options;
//   options.peers = {"10.0.0.1:7411", "10.0.0.2:7411"};
//   options.advertise = "10.0.0.1:7411";
//   auto cluster = Cluster::Create(options, MakeGrpcTransport());
//   (*cluster)->OnMemberDown([](const MemberInfo& m, const std::string& why) { ... });
//   (*cluster)->Start();                         // the heartbeat thread
//   std::vector<MemberInfo> now = (*cluster)->Members();
//
// Every heartbeat interval, the heartbeat thread (Tick) sends this daemon's report to every
// other member at once, each call with a deadline of min(interval, 1 s), records the answers,
// and marks members silent for longer than the peer timeout DOWN (membership.h has the state
// machine). Heartbeats from peers arrive through HandleHeartbeat (ClusterService). With a DNS
// name for --peers, Tick first resolves it again until it yields every member; until then the
// cluster has no ranks (Members() lists self with rank -1) and peers' heartbeats are refused.
// Without peers (options.peers empty) the cluster is this daemon alone, rank 0, and Start
// starts no thread, unless it discovers its members (options.discover: etcd's member keys),
// starting alone and adding each member its transport finds (PeerTransport::Discovered).
//
// Thread-safety: every method may be called from any thread. OnMemberDown callbacks run on the
// thread calling Tick (the heartbeat thread once started), one at a time, in the order the
// failures were seen, with no lock held; they must not call Stop and should return quickly
// (a slow callback delays heartbeats). Stop returns within one heartbeat deadline (at most
// 1 s), or one DNS lookup while a name is still resolving.
#ifndef RANNC_DAEMON_CLUSTER_CLUSTER_H_
#define RANNC_DAEMON_CLUSTER_CLUSTER_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/peers.h"
#include "daemon/common/periodic.h"

namespace rannc {
namespace cluster {

struct ClusterOptions {
  // The --peers entries (ParsePeerList); empty: a cluster of this daemon alone, or of those
  // discovered.
  std::vector<std::string> peers;
  // No fixed list: the members are those the transport finds (--cluster-store without --peers).
  bool discover = false;
  // This daemon's address as the others know it; must be a member.
  std::string advertise;
  // Members a DNS name in `peers` must resolve to; 0 for a static list (see peers.h).
  int cluster_size = 0;
  // How often to heartbeat every other member. Default 1 s.
  std::chrono::milliseconds heartbeat_interval{1000};
  // Silence after which a member is DOWN. Default 10 s.
  std::chrono::milliseconds peer_timeout{10000};
  // What the heartbeats say about this daemon.
  std::vector<DeviceSummary> devices;
  std::string hostname;
  std::string version;
  // 0: a random one (the normal case); tests fix it.
  uint64_t incarnation = 0;
  // Injected for tests; empty: SystemResolver() and Clock::now.
  ResolveFn resolve;
  std::function<Clock::time_point()> now;
};

// How heartbeats reach the other members: gRPC in the daemon (cluster_service.h), direct calls
// in tests.
class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  // Sends `self` to every address concurrently and returns each one's answer, in order. Each
  // call fails (UNAVAILABLE, DEADLINE_EXCEEDED, or the peer's error) after `deadline` at most.
  virtual std::vector<absl::StatusOr<PeerReport>> HeartbeatAll(
      const std::vector<std::string>& addresses, const PeerReport& self,
      std::chrono::milliseconds deadline) = 0;
  // Members known gone since the last call, (address, why), without waiting for the peer
  // timeout (etcd: a member key deleted when its lease ended). None for heartbeats.
  virtual std::vector<std::pair<std::string, std::string>> TakeLost() { return {}; }
  // Every member address the transport has found so far (etcd: each that had a member key),
  // for a cluster that discovers its members. None for heartbeats, which need --peers.
  virtual std::vector<std::string> Discovered() { return {}; }
};

class Cluster {
 public:
  // `member` as it was when lost (its address, rank, incarnation, devices); `reason` says how.
  using MemberDownFn = std::function<void(const MemberInfo& member, const std::string& reason)>;

  // Checks the options and, for a static list, that `advertise` is a member (INVALID_ARGUMENT
  // naming both otherwise). A DNS name is resolved once here; an incomplete answer is fine.
  static absl::StatusOr<std::unique_ptr<Cluster>> Create(ClusterOptions options,
                                                         std::unique_ptr<PeerTransport> transport);
  ~Cluster();

  // Starts the heartbeat thread (none for a cluster of one). Call once.
  void Start();
  // Stops and joins the heartbeat thread; idempotent.
  void Stop();
  // One heartbeat round: resolve (if pending), heartbeat, expire, run callbacks. The thread
  // calls it every interval; tests call it directly with an injected clock.
  void Tick();

  // A peer's heartbeat (ClusterService): records it and returns this daemon's report, or why it
  // was refused (Membership::Heard; FAILED_PRECONDITION while a DNS name is still resolving).
  absl::StatusOr<PeerReport> HandleHeartbeat(const PeerReport& sender);

  // Every member in rank order; while a DNS name is still resolving, only self (rank -1).
  std::vector<MemberInfo> Members() const;
  // Whether the members are known and this daemon has its rank (false while a DNS name is still
  // resolving to --cluster-size addresses): the daemon's readiness.
  bool Joined() const;
  // Called for each member lost from UP: silent past the timeout, or restarted.
  void OnMemberDown(MemberDownFn fn);

  const std::string& address() const { return options_.advertise; }
  uint64_t incarnation() const { return self_.incarnation; }
  Clock::time_point Now() const { return options_.now(); }

 private:
  Cluster(ClusterOptions options, std::unique_ptr<PeerTransport> transport);
  // Resolves --peers again; installs the membership once complete. Heartbeat thread only.
  void TryResolve();
  // Logs events and queues the DOWN ones for the callbacks. Requires mu_.
  void Record(std::vector<MemberEvent> events);

  const ClusterOptions options_;
  const std::unique_ptr<PeerTransport> transport_;
  PeerReport self_;  // without rank and members until the membership is known

  mutable std::mutex mu_;
  std::optional<Membership> membership_;  // empty while a DNS name is resolving
  std::vector<MemberEvent> pending_downs_;          // for the callbacks
  std::vector<MemberDownFn> callbacks_;
  std::map<std::string, std::string> last_error_;  // per peer, so each error is logged once
  std::string last_resolve_error_;

  std::mutex tick_mu_;  // one Tick at a time, so callbacks run in order
  std::mutex thread_mu_;
  bool stopped_ = false;                 // guarded by thread_mu_; Start after Stop starts nothing
  std::unique_ptr<Periodic> heartbeat_;  // guarded by thread_mu_; calls Tick
};

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_CLUSTER_H_
