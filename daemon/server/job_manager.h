// The daemon's jobs by id. Creates ids, hands out shared references so a job deleted while an
// RPC is using it stays alive until that RPC ends, and lists jobs for `rannc jobs`.
//
// Thread-safe: the map is guarded by a mutex that is never held while a job works.
#ifndef RANNC_DAEMON_SERVER_JOB_MANAGER_H_
#define RANNC_DAEMON_SERVER_JOB_MANAGER_H_

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/server/job.h"

namespace rannc {

class JobManager {
 public:
  JobManager() = default;

  // A new id, unique within this daemon's lifetime ("job-1a2b3c4d-7").
  std::string NewJobId();
  // Add starts the job's lease (Job::Touch), and Get renews it.
  void Add(std::shared_ptr<Job> job);
  // NOT_FOUND with a message naming the id when it is unknown.
  absl::StatusOr<std::shared_ptr<Job>> Get(const std::string& id) const;
  absl::Status Remove(const std::string& id);
  // Removes (as Remove does) the jobs whose lease has run out at `now` (Job::LeaseExpired) and
  // says which, for the caller's log. A call in flight keeps its job alive until it ends.
  struct Expired {
    std::string id;
    std::string name;
    std::chrono::milliseconds lease;
  };
  std::vector<Expired> RemoveExpired(std::chrono::steady_clock::time_point now);
  std::vector<std::shared_ptr<Job>> List() const;
  size_t size() const;

 private:
  static void Release(std::shared_ptr<Job> job);

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_;
  std::atomic<uint64_t> next_id_{1};
  const uint64_t instance_ = MakeInstanceTag();
  static uint64_t MakeInstanceTag();
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_MANAGER_H_
