#include "daemon/cluster/election.h"

#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace cluster {

absl::StatusOr<std::unique_ptr<Election>> Election::Start(EtcdClient* etcd, int64_t lease,
                                                          std::string name, std::string value,
                                                          std::chrono::milliseconds rescan) {
  std::unique_ptr<Election> election(
      new Election(etcd, lease, std::move(name), std::move(value)));
  int64_t revision = 0;
  absl::StatusOr<std::vector<KeyValue>> keys =
      etcd->GetPrefix(absl::StrCat(election->name_, "/"), &revision);
  if (!keys.ok()) return keys.status();
  if (absl::Status first = election->Round(); !first.ok()) return first;
  Election* self = election.get();
  // Any change to the candidates' keys (the leader's gone, above all) starts a round at once.
  election->watch_ = etcd->WatchPrefix(
      absl::StrCat(election->name_, "/"), revision + 1,
      [self](const WatchEvent& e) {
        if (e.type == WatchEvent::Type::kDelete) self->Round().IgnoreError();
      });
  election->rescan_ = std::make_unique<Periodic>(rescan, [self] { self->Round().IgnoreError(); });
  return election;
}

Election::Election(EtcdClient* etcd, int64_t lease, std::string name, std::string value)
    : etcd_(etcd), lease_(lease), name_(std::move(name)), value_(std::move(value)) {}

Election::~Election() {
  stopping_ = true;
  rescan_.reset();
  watch_.reset();
  std::lock_guard<std::mutex> round(round_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  if (leadership_) {
    absl::Status resigned = etcd_->Resign(*leadership_);
    if (!resigned.ok()) {
      spdlog::warn("election {}: resigning: {} (the lease's end releases it)", name_,
                   resigned.ToString());
    }
  }
}

std::string Election::leader() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leader_;
}

bool Election::leads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leadership_.has_value();
}

absl::Status Election::Round() {
  std::lock_guard<std::mutex> round(round_mu_);
  if (stopping_) return absl::OkStatus();
  absl::StatusOr<KeyValue> now = etcd_->Leader(name_);
  std::optional<Leadership> won;
  if (!now.ok() && now.status().code() == absl::StatusCode::kNotFound && !stopping_) {
    absl::StatusOr<std::optional<Leadership>> led = etcd_->TryLead(name_, lease_, value_);
    if (!led.ok()) {
      now = led.status();
    } else if (led->has_value()) {
      won = **led;
      KeyValue mine;
      mine.key = won->key;
      mine.value = value_;
      mine.create_revision = won->revision;
      mine.lease = lease_;
      now = mine;
    } else {
      now = etcd_->Leader(name_);  // another candidate's key came first
    }
  }
  const std::string error = now.ok() ? "" : now.status().ToString();
  if (!error.empty() && error != last_error_) {
    spdlog::warn("election {}: {}", name_, error);
  }
  last_error_ = error;
  std::lock_guard<std::mutex> lock(mu_);
  const std::string was = leader_;
  leader_ = now.ok() ? now->value : "";
  // Leading means holding the leader's key: this lease's, at the revision it was won at.
  if (won) {
    leadership_ = won;
  } else if (leadership_ && (!now.ok() || now->lease != lease_)) {
    leadership_.reset();
  }
  if (leader_ != was && !leader_.empty()) {
    spdlog::info("election {}: {} leads{}", name_, leader_, leadership_ ? " (this daemon)" : "");
  }
  if (!now.ok() && now.status().code() != absl::StatusCode::kNotFound) return now.status();
  return absl::OkStatus();
}

}  // namespace cluster
}  // namespace rannc
