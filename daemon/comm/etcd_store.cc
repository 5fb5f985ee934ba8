#include "daemon/comm/etcd_store.h"

#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rannc {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;

class EtcdStore : public Store {
 public:
  EtcdStore(cluster::EtcdClient* etcd, std::string prefix, int64_t lease)
      : etcd_(etcd), prefix_(std::move(prefix)), lease_(lease) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return etcd_->Put(prefix_ + key, value, lease_).status();
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    const std::string full = prefix_ + key;
    int64_t revision = 0;
    absl::StatusOr<std::optional<cluster::KeyValue>> now = etcd_->Get(full, &revision);
    if (!now.ok()) return now.status();
    if (now->has_value()) return (*now)->value;
    // Not yet: wait for its put, watching from just after the read.
    std::mutex mu;
    std::condition_variable cv;
    std::optional<std::string> value;
    absl::Status failed;
    auto watch = etcd_->WatchPrefix(
        full, revision + 1,
        [&](const cluster::WatchEvent& e) {
          if (e.kv.key != full || e.type != cluster::WatchEvent::Type::kPut) return;
          std::lock_guard<std::mutex> lock(mu);
          value = e.kv.value;
          cv.notify_all();
        },
        [&](const absl::Status& s) {
          std::lock_guard<std::mutex> lock(mu);
          failed = s;
          cv.notify_all();
        });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [&] { return value.has_value() || !failed.ok(); });
    if (value.has_value()) return *value;
    if (!failed.ok()) return failed;
    return absl::DeadlineExceededError(absl::StrCat(
        "store key '", key, "' was not set within ", timeout.count(), " ms (etcd key ", full,
        ")"));
  }

  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    const std::string full = prefix_ + key;
    while (true) {
      absl::StatusOr<std::optional<cluster::KeyValue>> now = etcd_->Get(full);
      if (!now.ok()) return now.status();
      int64_t value = 0;
      if (now->has_value() && !absl::SimpleAtoi((*now)->value, &value)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "store key '", key, "' holds '", (*now)->value, "', not a number to add to"));
      }
      value += delta;
      absl::StatusOr<bool> swapped = etcd_->PutIfModRevision(
          full, absl::StrCat(value), now->has_value() ? (*now)->mod_revision : 0, lease_);
      if (!swapped.ok()) return swapped.status();
      if (*swapped) return value;
      // Another rank added first: read again.
    }
  }

  absl::Status Wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) override {
    const Clock::time_point deadline = Clock::now() + timeout;
    for (const std::string& key : keys) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      absl::StatusOr<std::string> got =
          Get(key, std::max(left, std::chrono::milliseconds(0)));
      if (!got.ok()) return got.status();
    }
    return absl::OkStatus();
  }

 private:
  cluster::EtcdClient* const etcd_;
  const std::string prefix_;
  const int64_t lease_;
};

}  // namespace

std::unique_ptr<Store> MakeEtcdStore(cluster::EtcdClient* etcd, std::string prefix,
                                     int64_t lease) {
  return std::make_unique<EtcdStore>(etcd, std::move(prefix), lease);
}

}  // namespace comm
}  // namespace rannc
