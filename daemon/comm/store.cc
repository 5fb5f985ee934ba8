#include "daemon/comm/store.h"

#include <condition_variable>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rannc {
namespace comm {
namespace {

class InMemoryStore final : public Store {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      values_[key] = value;
    }
    changed_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    absl::Status s = Wait({key}, timeout);
    if (!s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    return values_.at(key);
  }

  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = values_.find(key);
      if (it != values_.end() && !absl::SimpleAtoi(it->second, &value)) value = 0;
      value += delta;
      values_[key] = absl::StrCat(value);
    }
    changed_.notify_all();
    return value;
  }

  absl::Status Wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto all_set = [&] {
      for (const std::string& k : keys) {
        if (!values_.count(k)) return false;
      }
      return true;
    };
    if (timeout == std::chrono::milliseconds::max()) {
      changed_.wait(lock, all_set);
      return absl::OkStatus();
    }
    if (changed_.wait_for(lock, timeout, all_set)) return absl::OkStatus();
    for (const std::string& k : keys) {
      if (!values_.count(k)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "store: key '", k, "' was not set within ", timeout.count(), " ms"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

}  // namespace

std::unique_ptr<Store> MakeInMemoryStore() { return std::make_unique<InMemoryStore>(); }

}  // namespace comm
}  // namespace rannc
