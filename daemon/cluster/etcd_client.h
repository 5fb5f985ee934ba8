// A client of etcd's v3 gRPC API (third_party/etcd: KV, Lease, Watch, Election), for state the
// daemons of a cluster share (ranncd --cluster-store etcd://HOST:PORT[,HOST:PORT...]): keys and
// revisions, leases that expire with a daemon, watches over a prefix, and elections whose
// leader holds a key only while its lease lives.
//
//   absl::StatusOr<std::unique_ptr<EtcdClient>> etcd =
//       EtcdClient::Connect(ParseEtcdUrl("etcd://127.0.0.1:2379").value(), seconds(5));
//   int64_t lease = (*etcd)->GrantLease(seconds(10)).value();
//   LeaseKeeper keeper(etcd->get(), lease, [] { /* lost: stop driving jobs */ });
//   (*etcd)->Put("/rannc/members/a", "...", lease);
//   auto watch = (*etcd)->WatchPrefix("/rannc/members/", rev + 1, on_event);
//
// Every call goes to the endpoint that last answered; one that is UNAVAILABLE moves to the next
// endpoint and is retried there, once per endpoint (etcd's members forward writes to their
// leader, so any member serves any call); one past its deadline is not retried (it may have
// been applied), but the next call goes to the next endpoint. Errors are gRPC's, as absl statuses, naming the call
// and the key.
//
// Thread-safe: calls may come from any thread; each watch and keeper runs a thread of its own.
#ifndef RANNC_DAEMON_CLUSTER_ETCD_CLIENT_H_
#define RANNC_DAEMON_CLUSTER_ETCD_CLIENT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cluster/peers.h"  // ParseEtcdUrl

namespace grpc {
class Channel;
class ChannelCredentials;
class ClientContext;
}  // namespace grpc
namespace etcdserverpb {
class TxnRequest;
}  // namespace etcdserverpb

namespace rannc {
namespace cluster {

// The smallest key after every key that starts with `prefix` (etcd's range_end of a prefix).
std::string PrefixEnd(const std::string& prefix);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

struct WatchEvent {
  enum class Type { kPut, kDelete } type = Type::kPut;
  KeyValue kv;  // for kDelete: the key and the revision of the deletion
};

// A leader's hold on an election (etcd's LeaderKey): its key lives as long as the lease.
struct Leadership {
  std::string name;
  std::string key;
  int64_t revision = 0;  // the key's creation revision: fences the leader's writes
  int64_t lease = 0;
};

class EtcdClient {
 public:
  // `credentials`: TLS to etcd (security::ChannelCredentials; etcd's --cert-file, and its
  // --trusted-ca-file with --client-cert-auth); null: plain text.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(
      std::vector<std::string> endpoints, std::chrono::milliseconds timeout,
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~EtcdClient();

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // How long each call may take (Connect's timeout); watches and campaigns are not bounded.
  std::chrono::milliseconds call_timeout() const { return timeout_; }

  // KV. Put returns the store's revision after it.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                              int64_t lease = 0);
  // The key's value, if any; `revision` (if given) gets the store's revision.
  absl::StatusOr<std::optional<KeyValue>> Get(const std::string& key,
                                              int64_t* revision = nullptr);
  // Every key under `prefix`, in key order; `revision` (if given) gets the store's revision.
  absl::StatusOr<std::vector<KeyValue>> GetPrefix(const std::string& prefix,
                                                  int64_t* revision = nullptr);
  absl::StatusOr<int64_t> Delete(const std::string& key);  // keys deleted (0 or 1)
  absl::StatusOr<int64_t> DeletePrefix(const std::string& prefix);
  // Transactions on one key: put only if the key does not exist / was last modified at
  // `mod_revision` (0: does not exist). False when the condition failed.
  absl::StatusOr<bool> PutIfAbsent(const std::string& key, const std::string& value,
                                   int64_t lease = 0);
  absl::StatusOr<bool> PutIfModRevision(const std::string& key, const std::string& value,
                                        int64_t mod_revision, int64_t lease = 0);
  // Fenced writes: put / delete `key` only while `fence_key` exists with creation revision
  // `fence_revision` (a Leadership's key and revision: only the leader's writes land). False when
  // the fence failed.
  absl::StatusOr<bool> PutIfFenced(const std::string& key, const std::string& value,
                                   const std::string& fence_key, int64_t fence_revision);
  absl::StatusOr<bool> DeleteIfFenced(const std::string& key, const std::string& fence_key,
                                      int64_t fence_revision);

  // Leases: granted with a TTL; NOT_FOUND once expired or revoked.
  absl::StatusOr<int64_t> GrantLease(std::chrono::seconds ttl);
  absl::Status RevokeLease(int64_t lease);
  // One keep-alive: the TTL the lease has again, in seconds. `timeout` (0: call_timeout())
  // bounds it.
  absl::StatusOr<int64_t> KeepAlive(
      int64_t lease, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  // Elections (etcd's v3election): Campaign waits until this caller leads `name` (or `timeout`
  // passes: DEADLINE_EXCEEDED), holding it with `lease` and announcing `value`. etcd withdraws
  // a campaign that timed out by deleting its key, which is named after the lease, perhaps
  // after a new campaign began: campaign again under another lease.
  absl::StatusOr<Leadership> Campaign(const std::string& name, int64_t lease,
                                      const std::string& value,
                                      std::chrono::milliseconds timeout);
  // Campaign without waiting, by the same protocol (this caller's key `name`/<lease in hex>
  // under `lease`; the key created first leads): the leadership if this caller leads now, else
  // nullopt, its key withdrawn. For many daemons racing to take one job over: one wins, the
  // others go on at once.
  absl::StatusOr<std::optional<Leadership>> TryLead(const std::string& name, int64_t lease,
                                                    const std::string& value);
  absl::Status Resign(const Leadership& leadership);
  // The current leader's announcement; NOT_FOUND when none leads.
  absl::StatusOr<KeyValue> Leader(const std::string& name);

  // Events on the keys under `prefix` from `start_revision` (0: from now), delivered in order on
  // the watch's own thread until it is destroyed. `on_error` (may be empty) hears why a watch
  // ended early (etcd unreachable, the revision compacted); the watch reconnects to the next
  // endpoint by itself first, from the revision after the last event.
  class Watch {
   public:
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    friend class EtcdClient;
    Watch() = default;
    void Run();
    EtcdClient* client_ = nullptr;
    std::string prefix_;
    int64_t next_revision_ = 0;
    std::function<void(const WatchEvent&)> on_event_;
    std::function<void(const absl::Status&)> on_error_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::shared_ptr<grpc::ClientContext> context_;  // the open stream's, for cancelling it
    bool stopping_ = false;
    std::thread thread_;
  };
  std::unique_ptr<Watch> WatchPrefix(const std::string& prefix, int64_t start_revision,
                                     std::function<void(const WatchEvent&)> on_event,
                                     std::function<void(const absl::Status&)> on_error = {});

 private:
  EtcdClient(std::vector<std::string> endpoints, std::chrono::milliseconds timeout,
             const std::shared_ptr<grpc::ChannelCredentials>& credentials);
  std::shared_ptr<grpc::Channel> Channel(size_t* index);
  // Keys in [key, end) (end "": `key` alone).
  absl::StatusOr<std::vector<KeyValue>> Range(const std::string& key, const std::string& end,
                                              int64_t* revision);
  absl::StatusOr<int64_t> DeleteRange(const std::string& key, const std::string& end);
  // One transaction: whether its compares held (its success ops ran).
  absl::StatusOr<bool> Txn(const std::string& what, const etcdserverpb::TxnRequest& req);
  void Failed(size_t index);
  // Runs `call` on the current endpoint's channel, moving on (once per endpoint) while it is
  // UNAVAILABLE.
  absl::Status Call(const std::string& what,
                    const std::function<absl::Status(const std::shared_ptr<grpc::Channel>&)>& call);

  const std::vector<std::string> endpoints_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  size_t current_ = 0;
};

// Keeps a lease alive (a keep-alive every third of its TTL) on a thread of its own, and knows
// until when the lease surely lives: `valid_until` is the send time of the last keep-alive etcd
// answered plus the TTL it gave, less a tenth of the TTL for clock rate differences. etcd expires
// the lease no sooner than TTL after it *received* that keep-alive, so while valid() holds no
// other daemon can hold what the lease holds (an election it won): a leader checks valid() before
// acting as one (the fence). Calls `on_lost` once, from the keeper's thread, when etcd says the
// lease is gone or valid_until passes without a renewal: a leader must stop acting as one then.
class LeaseKeeper {
 public:
  // `granted`: when the lease was asked for (its validity counts from then).
  LeaseKeeper(EtcdClient* client, int64_t lease, std::chrono::seconds ttl,
              std::function<void(const absl::Status&)> on_lost,
              std::chrono::steady_clock::time_point granted = std::chrono::steady_clock::now());
  ~LeaseKeeper();  // stops keeping it (the lease then expires unless revoked)
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  bool lost() const { return lost_; }
  int64_t lease() const { return lease_; }
  // Whether the lease surely still lives (see above).
  bool valid() const;
  std::chrono::steady_clock::time_point valid_until() const;

 private:
  void Run();
  EtcdClient* client_;
  const int64_t lease_;
  const std::chrono::seconds ttl_;
  std::function<void(const absl::Status&)> on_lost_;
  std::atomic<bool> lost_{false};
  std::atomic<int64_t> valid_until_ns_;  // steady_clock's, since its epoch
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_ETCD_CLIENT_H_
