#include "daemon/cluster/etcd_transport.h"

#include <map>
#include <set>
#include <mutex>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/cluster/cluster_service.h"

namespace rannc {
namespace cluster {
namespace {

class EtcdTransport final : public PeerTransport {
 public:
  EtcdTransport(EtcdClient* etcd, int64_t lease) : etcd_(etcd), lease_(lease) {}

  absl::Status Start() {
    int64_t revision = 0;
    absl::StatusOr<std::vector<KeyValue>> now = etcd_->GetPrefix(kEtcdMembersPrefix, &revision);
    if (!now.ok()) return now.status();
    for (const KeyValue& kv : *now) Seen(kv.key, kv.value);
    watch_ = etcd_->WatchPrefix(
        kEtcdMembersPrefix, revision + 1,
        [this](const WatchEvent& e) {
          if (e.type == WatchEvent::Type::kPut) {
            Seen(e.kv.key, e.kv.value);
          } else {
            const std::string address = e.kv.key.substr(sizeof(kEtcdMembersPrefix) - 1);
            std::lock_guard<std::mutex> lock(mu_);
            reports_.erase(address);
            lost_.emplace_back(address, absl::StrCat(
                "its member key in etcd (", e.kv.key, ") was deleted at revision ",
                e.kv.mod_revision, ": its lease ended (stopped, or not kept alive)"));
          }
        },
        [](const absl::Status& s) {
          spdlog::error("cluster: the watch of etcd's members ended: {}", s.ToString());
        });
    return absl::OkStatus();
  }

  std::vector<std::string> Discovered() override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::vector<std::string>(found_.begin(), found_.end());
  }

  std::vector<std::pair<std::string, std::string>> TakeLost() override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(lost_, {});
  }

  std::vector<absl::StatusOr<PeerReport>> HeartbeatAll(
      const std::vector<std::string>& addresses, const PeerReport& self,
      std::chrono::milliseconds /*deadline*/) override {
    // This daemon's own report, current (its rank and member list), under its lease.
    v1::MemberReport proto;
    ToProto(self, &proto);
    absl::Status put = etcd_->Put(absl::StrCat(kEtcdMembersPrefix, self.address),
                                  proto.SerializeAsString(), lease_).status();
    if (!put.ok() && put.ToString() != last_put_error_) {
      spdlog::warn("cluster: writing this daemon's member report to etcd: {}", put.ToString());
    }
    last_put_error_ = put.ok() ? "" : put.ToString();
    std::vector<absl::StatusOr<PeerReport>> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& address : addresses) {
      auto it = reports_.find(address);
      if (it != reports_.end()) {
        out.emplace_back(it->second);
      } else {
        out.emplace_back(absl::UnavailableError(absl::StrCat(
            address, " has no member key in etcd (", kEtcdMembersPrefix, address,
            "): not started, stopped, or its lease expired")));
      }
    }
    return out;
  }

 private:
  void Seen(const std::string& key, const std::string& value) {
    v1::MemberReport proto;
    if (!absl::StartsWith(key, kEtcdMembersPrefix) || !proto.ParseFromString(value)) {
      spdlog::warn("cluster: etcd key {} is not a member report; ignored", key);
      return;
    }
    const std::string address = key.substr(sizeof(kEtcdMembersPrefix) - 1);
    std::lock_guard<std::mutex> lock(mu_);
    reports_[address] = FromProto(proto);
    found_.insert(address);
  }

  EtcdClient* const etcd_;
  const int64_t lease_;
  std::string last_put_error_;  // the heartbeat thread's
  std::mutex mu_;
  std::map<std::string, PeerReport> reports_;  // by address: what etcd holds now
  std::set<std::string> found_;                // every address that has had a key
  std::vector<std::pair<std::string, std::string>> lost_;  // deleted since TakeLost
  std::unique_ptr<EtcdClient::Watch> watch_;   // destroyed first
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerTransport>> MakeEtcdTransport(EtcdClient* etcd,
                                                                 int64_t lease) {
  auto transport = std::make_unique<EtcdTransport>(etcd, lease);
  absl::Status started = transport->Start();
  if (!started.ok()) return started;
  return std::unique_ptr<PeerTransport>(std::move(transport));
}

}  // namespace cluster
}  // namespace rannc
