#include "daemon/server/job_registry.h"

#include <chrono>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"

namespace rannc {
namespace {

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string ElectionKey(const std::string& name) {
  return absl::StrCat(JobRegistry::kElections, name);
}

std::string EntryKey(const std::string& name) { return absl::StrCat(JobRegistry::kEntries, name); }

}  // namespace

JobRegistry::JobRegistry(cluster::EtcdClient* etcd, const cluster::LeaseKeeper* keeper,
                         std::string self)
    : etcd_(etcd), keeper_(keeper), self_(std::move(self)) {}

JobRegistry::~JobRegistry() { StopWatching(); }

bool JobRegistry::stopping() const {
  std::lock_guard<std::mutex> lock(wake_mu_);
  return stopping_;
}

void JobRegistry::StopWatching() {
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  watch_.reset();
  if (orphans_thread_.joinable()) orphans_thread_.join();
}

absl::Status JobRegistry::Lead(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(name);
    if (it != held_.end()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "a job named '", name, "' runs on this daemon already (",
          it->second.entry ? it->second.entry->job_id() : "starting",
          "); delete it, or name this one otherwise (RANNC_JOB)"));
    }
  }
  absl::StatusOr<std::optional<cluster::Leadership>> led =
      etcd_->TryLead(ElectionKey(name), keeper_->lease(), self_);
  if (!led.ok()) return Annotate(led.status(), absl::StrCat("registering job '", name, "'"));
  if (!led->has_value()) {
    absl::StatusOr<cluster::KeyValue> leader = etcd_->Leader(ElectionKey(name));
    return absl::AlreadyExistsError(absl::StrCat(
        "a job named '", name, "' runs in this cluster, led by the daemon at ",
        leader.ok() ? leader->value : "(unknown)", "; drive it there (LocateJob), delete it, "
        "or name this one otherwise (RANNC_JOB)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  held_[name] = Held{**led, std::nullopt};
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::RegisteredJob>> JobRegistry::TakeOver(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_.count(name)) return std::nullopt;  // led here already
  }
  absl::StatusOr<std::optional<cluster::Leadership>> led =
      etcd_->TryLead(ElectionKey(name), keeper_->lease(), self_);
  if (!led.ok()) return led.status();
  if (!led->has_value()) return std::nullopt;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_[name] = Held{**led, std::nullopt};
  }
  absl::StatusOr<v1::RegisteredJob> entry = Find(name);
  if (!entry.ok()) {
    Abandon(name);
    if (entry.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
    return entry.status();
  }
  return *entry;
}

absl::Status JobRegistry::Publish(v1::RegisteredJob entry) {
  cluster::Leadership leadership;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(entry.name());
    if (it == held_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("this daemon does not lead job '", entry.name(), "'"));
    }
    leadership = it->second.leadership;
  }
  entry.set_leader(self_);
  entry.set_leader_revision(leadership.revision);
  entry.set_updated_unix_ms(NowUnixMs());
  absl::StatusOr<bool> put = etcd_->PutIfFenced(EntryKey(entry.name()), entry.SerializeAsString(),
                                                leadership.key, leadership.revision);
  if (!put.ok()) {
    return Annotate(put.status(), absl::StrCat("registering job '", entry.name(), "'"));
  }
  if (!*put) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon leads job '", entry.name(), "' no more (its leadership in etcd is gone)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  held_[entry.name()].entry = std::move(entry);
  return absl::OkStatus();
}

void JobRegistry::Abandon(const std::string& name) {
  std::optional<cluster::Leadership> leadership;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(name);
    if (it == held_.end()) return;
    leadership = it->second.leadership;
    held_.erase(it);
  }
  absl::StatusOr<int64_t> deleted = etcd_->Delete(leadership->key);
  if (!deleted.ok()) {
    spdlog::warn("job '{}': withdrawing this daemon's leadership from etcd failed ({}); it goes "
                 "with the daemon's lease", name, deleted.status().ToString());
  }
}

std::optional<v1::RegisteredJob> JobRegistry::Release(const std::string& job_id) {
  std::string name;
  cluster::Leadership leadership;
  std::optional<v1::RegisteredJob> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (it->second.entry && it->second.entry->job_id() == job_id) {
        name = it->first;
        leadership = it->second.leadership;
        entry = std::move(it->second.entry);
        held_.erase(it);
        break;
      }
    }
  }
  if (name.empty()) return std::nullopt;
  // The entry first: a job without a leader but with an entry would be taken over.
  absl::StatusOr<bool> deleted =
      etcd_->DeleteIfFenced(EntryKey(name), leadership.key, leadership.revision);
  if (!deleted.ok()) {
    spdlog::warn("job {} '{}': deleting its entry from the registry failed ({}); another daemon "
                 "may bring it back once this one's lease ends", job_id, name,
                 deleted.status().ToString());
    return std::nullopt;  // the leadership stays while this daemon lives: no one takes it
  }
  etcd_->Delete(leadership.key).IgnoreError();
  spdlog::info("job {} '{}' left the cluster's registry", job_id, name);
  return entry;
}

absl::Status JobRegistry::Fence() const {
  if (keeper_->valid()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "this daemon (", self_, ") cannot be sure it still leads the job: its etcd lease was not "
      "renewed in time, so another daemon may take the job over; find where it runs with "
      "LocateJob"));
}

std::optional<v1::RegisteredJob> JobRegistry::EntryOf(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, held] : held_) {
    if (held.entry && held.entry->job_id() == job_id) return held.entry;
  }
  return std::nullopt;
}

absl::StatusOr<v1::RegisteredJob> JobRegistry::Find(const std::string& name) const {
  absl::StatusOr<std::optional<cluster::KeyValue>> kv = etcd_->Get(EntryKey(name));
  if (!kv.ok()) return kv.status();
  if (!kv->has_value()) {
    return absl::NotFoundError(absl::StrCat("no job named '", name, "' in the cluster's registry"));
  }
  v1::RegisteredJob entry;
  if (!entry.ParseFromString((*kv)->value)) {
    return absl::DataLossError(absl::StrCat("the registry's entry ", EntryKey(name),
                                            " does not parse as a RegisteredJob"));
  }
  return entry;
}

std::vector<std::string> JobRegistry::Orphans() const {
  absl::StatusOr<std::vector<cluster::KeyValue>> entries = etcd_->GetPrefix(kEntries);
  absl::StatusOr<std::vector<cluster::KeyValue>> candidates = etcd_->GetPrefix(kElections);
  if (!entries.ok() || !candidates.ok()) {
    spdlog::warn("reading the job registry failed: {}",
                 (entries.ok() ? candidates.status() : entries.status()).ToString());
    return {};
  }
  std::set<std::string> led;
  const size_t skip = std::string(kElections).size();
  for (const cluster::KeyValue& kv : *candidates) {
    const size_t slash = kv.key.rfind('/');
    if (slash > skip) led.insert(kv.key.substr(skip, slash - skip));
  }
  std::vector<std::string> out;
  const size_t entry_skip = std::string(kEntries).size();
  for (const cluster::KeyValue& kv : *entries) {
    const std::string name = kv.key.substr(entry_skip);
    if (!led.count(name)) out.push_back(name);
  }
  return out;
}

void JobRegistry::WatchOrphans(std::function<void(const std::string& name)> orphaned,
                               std::chrono::milliseconds rescan) {
  orphaned_ = std::move(orphaned);
  rescan_ = rescan;
  // A leader's key that goes wakes the scan at once.
  watch_ = etcd_->WatchPrefix(kElections, 0, [this](const cluster::WatchEvent& e) {
    if (e.type != cluster::WatchEvent::Type::kDelete) return;
    {
      std::lock_guard<std::mutex> lock(wake_mu_);
      woken_ = true;
    }
    wake_.notify_all();
  });
  orphans_thread_ = std::thread([this] { RunOrphans(); });
}

void JobRegistry::RunOrphans() {
  while (true) {
    for (const std::string& name : Orphans()) {
      {
        std::lock_guard<std::mutex> lock(wake_mu_);
        if (stopping_) return;
      }
      orphaned_(name);
    }
    std::unique_lock<std::mutex> lock(wake_mu_);
    wake_.wait_for(lock, rescan_, [&] { return stopping_ || woken_; });
    if (stopping_) return;
    woken_ = false;
  }
}

}  // namespace rannc
