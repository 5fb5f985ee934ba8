// The daemon's jobs by id, and their clients' leases. Creates ids, hands out shared references
// so a job deleted while an RPC is using it stays alive until that RPC ends, lists jobs for
// `rannc jobs`, and deletes the jobs whose client named them in no call for their lease
// (JobInfo::lease): Get renews a lease, RemoveExpired reaps.
//
//   JobManager jobs;                      // or JobManager(fake_clock) in tests
//   jobs.Add(std::move(job));
//   absl::StatusOr<std::shared_ptr<Job>> job = jobs.Get(id);
//   for (const JobManager::Expired& e : jobs.RemoveExpired()) log(e);   // once a second
//
// Time comes from the injected clock, so leases are tested without sleeping.
//
// Thread-safe: the map is guarded by a mutex that is never held while a job works.
#ifndef RANNC_DAEMON_SERVER_JOB_MANAGER_H_
#define RANNC_DAEMON_SERVER_JOB_MANAGER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/server/job.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

class JobManager {
 public:
  using Clock = std::chrono::steady_clock;
  explicit JobManager(std::function<Clock::time_point()> now = Clock::now);

  // A new id, unique within this daemon's lifetime ("job-1a2b3c4d-7").
  std::string NewJobId();
  // `job` shared, so that wherever its last reference goes (DeleteJob, or a call in flight that
  // ends after it) the heap is trimmed after it: glibc keeps what a job's many threads freed in
  // their arenas, and a long-running daemon's footprint must follow its live jobs.
  static std::shared_ptr<Job> Share(std::unique_ptr<Job> job);
  // Add starts the job's lease, and Get renews it. A job of several client ranks has the
  // answer its other ranks get from JoinJob (`joinable`).
  void Add(std::shared_ptr<Job> job,
           std::optional<v1::CreateJobResponse> joinable = std::nullopt);
  // The JoinJob answer of the job named `name` for `client_world` ranks, if there is one here.
  std::optional<v1::CreateJobResponse> FindJoinable(const std::string& name,
                                                    int client_world) const;
  // NOT_FOUND with a message naming the id when it is unknown.
  absl::StatusOr<std::shared_ptr<Job>> Get(const std::string& id);
  absl::Status Remove(const std::string& id);
  // Removes (as Remove does) the jobs whose lease has run out by now and says which, for the
  // caller's log; `on_expired` (if set) sees each first and says whether it was kept elsewhere
  // (suspended). A call in flight keeps its job alive until it ends.
  struct Expired {
    std::string id;
    std::string name;
    std::chrono::milliseconds lease;
    bool suspended = false;
  };
  std::vector<Expired> RemoveExpired(const std::function<bool(Job&)>& on_expired = nullptr);
  // The jobs, each with how long since a call last named it.
  struct Listed {
    std::shared_ptr<Job> job;
    std::chrono::milliseconds idle;
  };
  std::vector<Listed> List() const;
  size_t size() const;

  Clock::time_point Now() const { return now_(); }

  // JoinJob: the answer of the job named `name` for `client_world` ranks once one is added
  // here; or, when `leader_elsewhere` names another daemon that leads it, an answer with only
  // `leader` set. Asks again whenever a job is added and at least every `poll` (real time),
  // until `timeout` has passed on the injected clock or `cancelled` says so:
  // DEADLINE_EXCEEDED saying what rank 0 must do.
  absl::StatusOr<v1::CreateJobResponse> WaitForJoinable(
      const std::string& name, int client_world, std::chrono::milliseconds timeout,
      const std::function<std::optional<std::string>()>& leader_elsewhere,
      const std::function<bool()>& cancelled,
      std::chrono::milliseconds poll = std::chrono::milliseconds(100));

 private:
  struct Entry {
    std::shared_ptr<Job> job;
    Clock::time_point touched;
    std::optional<v1::CreateJobResponse> joinable;
  };
  static void Release(std::shared_ptr<Job> job);

  const std::function<Clock::time_point()> now_;
  mutable std::mutex mu_;
  std::condition_variable added_;
  uint64_t adds_ = 0;  // guarded by mu_
  std::map<std::string, Entry> jobs_;
  std::atomic<uint64_t> next_id_{1};
  const uint64_t instance_ = MakeInstanceTag();
  static uint64_t MakeInstanceTag();
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_MANAGER_H_
