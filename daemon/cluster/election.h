// Election: this daemon standing in one etcd election for as long as the object lives, e.g. for
// the cluster's coordinator (ranncd --cluster-store): it leads whenever no one else does, and
// always knows who leads.
//
//   auto coordinator = Election::Start(etcd, lease, "/rannc/coordinator", "10.0.0.1:7411");
//   std::string who = (*coordinator)->leader();  // "10.0.0.2:7411", or "" while none leads
//
// Protocol: etcd's (EtcdClient::TryLead): the candidate whose key `name`/<lease> was created first
// leads, under its lease; the others withdraw their keys at once and stand again when the
// leader's key goes (its lease ended: stopped, killed, or cut off from etcd for the TTL). They
// learn that from a watch of the election's keys, and a rescan every `rescan` catches anything a
// watch missed. At most one candidate leads at any time; `leader()` may lag the truth by one
// watch event.
//
// Thread-safe. `etcd` must outlive the election; the destructor resigns if it leads, so another
// daemon takes over at once instead of after the lease's TTL.
#ifndef RANNC_DAEMON_CLUSTER_ELECTION_H_
#define RANNC_DAEMON_CLUSTER_ELECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/cluster/etcd_client.h"
#include "daemon/common/periodic.h"

namespace rannc {
namespace cluster {

class Election {
 public:
  // Stands now (one round: leads, or learns who does) and keeps standing. Fails only when etcd
  // cannot be read at all.
  static absl::StatusOr<std::unique_ptr<Election>> Start(
      EtcdClient* etcd, int64_t lease, std::string name, std::string value,
      std::chrono::milliseconds rescan = std::chrono::seconds(1));
  ~Election();
  Election(const Election&) = delete;
  Election& operator=(const Election&) = delete;

  // The leader's value (what it announced); "" while none leads, or etcd cannot be reached.
  std::string leader() const;
  bool leads() const;

  // One round, as the watch and the rescan run it: who leads? none: try to.
  absl::Status Round();

 private:
  Election(EtcdClient* etcd, int64_t lease, std::string name, std::string value);

  EtcdClient* const etcd_;
  const int64_t lease_;
  const std::string name_;
  const std::string value_;
  std::atomic<bool> stopping_{false};  // set by the destructor: a round in flight stands no more
  std::mutex round_mu_;  // one round at a time
  mutable std::mutex mu_;
  std::string leader_;                   // guarded by mu_
  std::optional<Leadership> leadership_;  // guarded by mu_; set while this one leads
  std::string last_error_;               // guarded by round_mu_: each error logged once
  std::unique_ptr<EtcdClient::Watch> watch_;
  std::unique_ptr<Periodic> rescan_;  // last: stopped first
};

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_ELECTION_H_
