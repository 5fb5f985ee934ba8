// The cluster's job registry on etcd (ranncd --cluster-store; docs/cluster.md "Failover"): so
// that losing the daemon leading a job loses no job.
//
// Each job that checkpoints has an entry, /rannc/jobs/<name> (rannc.v1.RegisteredJob: its id,
// its leader, where its record and checkpoints lie), and an election, /rannc/leaders/<name>
// (etcd's election protocol: the candidate key created first leads, and lives with its
// daemon's lease). The leader writes the entry fenced by its leadership's revision, so a daemon
// that lost the job can no longer change it. When a leader's key goes (its daemon died, or was
// cut off from etcd for its lease's TTL), every daemon watching the elections finds the job
// orphaned and tries to lead it (TryLead: one wins at once, the others go on); the winner
// brings it back from its latest checkpoint (TrainingServiceImpl::TakeOver) and publishes its
// new id, which clients find with LocateJob.
//
//   JobRegistry registry(etcd, keeper, "10.0.0.1:7000");
//   absl::Status led = registry.Lead("gpt");            // ALREADY_EXISTS: led elsewhere
//   registry.Publish(entry);                            // once the job runs
//   registry.Fence();                                   // before a step, a commit
//   registry.Release(job_id);                           // the job is deleted: entry goes
//   registry.WatchOrphans([](const std::string& name) { /* take it over */ });
//
// Thread-safe.
#ifndef RANNC_DAEMON_SERVER_JOB_REGISTRY_H_
#define RANNC_DAEMON_SERVER_JOB_REGISTRY_H_

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cluster/etcd_client.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

class JobRegistry {
 public:
  // `keeper` holds this daemon's lease: its leaderships live with it, and its validity fences
  // them. Neither is owned; both outlive the registry.
  JobRegistry(cluster::EtcdClient* etcd, const cluster::LeaseKeeper* keeper, std::string self);
  ~JobRegistry();  // stops watching (leaderships stay with the lease)
  JobRegistry(const JobRegistry&) = delete;
  JobRegistry& operator=(const JobRegistry&) = delete;

  // Leads the job named `name` before it is created: ALREADY_EXISTS naming the daemon that
  // leads a job of that name now (this one included).
  absl::Status Lead(const std::string& name);
  // Leads the orphaned job `name` (its entry kept, no leader) if no other daemon did first:
  // its entry, else nullopt (another leads it, or it is gone).
  absl::StatusOr<std::optional<v1::RegisteredJob>> TakeOver(const std::string& name);
  // Writes the entry of a job this daemon leads (Lead or TakeOver): its id, this daemon as
  // leader, the fence. FAILED_PRECONDITION when it leads it no more.
  absl::Status Publish(v1::RegisteredJob entry);
  // Gives up the leadership of `name` taken for a job that did not start (others may take it).
  void Abandon(const std::string& name);
  // The job with this daemon's id `job_id` is gone for good (deleted, expired): its entry and
  // leadership go. Returns the entry it had, for the caller to remove its record; nothing for a
  // job that is not registered here.
  std::optional<v1::RegisteredJob> Release(const std::string& job_id);

  // The fence of the jobs this daemon leads (JobSettings::fence): OK while its lease surely
  // lives; UNAVAILABLE once it may have expired (another daemon may lead them).
  absl::Status Fence() const;
  // The entry of the job this daemon leads under `job_id`, if registered.
  std::optional<v1::RegisteredJob> EntryOf(const std::string& job_id) const;
  const std::string& self() const { return self_; }

  // The entry of `name`: NOT_FOUND when none.
  absl::StatusOr<v1::RegisteredJob> Find(const std::string& name) const;

  // Calls `orphaned(name)` for every registered job that no daemon leads: those found now,
  // each whose leader's key goes (watched), and any found by a rescan every `rescan` (a
  // takeover that failed everywhere is tried again). From a thread of the registry's own, one
  // call at a time.
  void WatchOrphans(std::function<void(const std::string& name)> orphaned,
                    std::chrono::milliseconds rescan = std::chrono::seconds(1));
  // Stops WatchOrphans (a daemon shutting down takes nothing over); waits for a call in flight,
  // which sees stopping() and gives up where it can.
  void StopWatching();
  bool stopping() const;

  static constexpr char kEntries[] = "/rannc/jobs/";
  static constexpr char kElections[] = "/rannc/leaders/";

 private:
  struct Held {
    cluster::Leadership leadership;
    std::optional<v1::RegisteredJob> entry;  // once published
  };
  std::vector<std::string> Orphans() const;
  void RunOrphans();

  cluster::EtcdClient* const etcd_;
  const cluster::LeaseKeeper* const keeper_;
  const std::string self_;
  mutable std::mutex mu_;
  std::map<std::string, Held> held_;  // by name

  std::function<void(const std::string&)> orphaned_;
  std::chrono::milliseconds rescan_{1000};
  std::unique_ptr<cluster::EtcdClient::Watch> watch_;
  mutable std::mutex wake_mu_;
  std::condition_variable wake_;
  bool woken_ = false;
  bool stopping_ = false;
  std::thread orphans_thread_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_REGISTRY_H_
