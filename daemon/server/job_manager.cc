#include "daemon/server/job_manager.h"

#include <chrono>
#include <random>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rannc {

uint64_t JobManager::MakeInstanceTag() {
  // Distinguishes ids across daemon restarts, so a client holding an old id gets NOT_FOUND
  // rather than someone else's job.
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())) &
         0xffffffffu;
}

JobManager::JobManager(std::function<Clock::time_point()> now) : now_(std::move(now)) {}

std::string JobManager::NewJobId() {
  return absl::StrFormat("job-%08x-%d", instance_, next_id_.fetch_add(1));
}

void JobManager::Add(std::shared_ptr<Job> job, std::optional<v1::CreateJobResponse> joinable) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string id = job->info().id;
    jobs_[id] = Entry{std::move(job), now_(), std::move(joinable)};
    ++adds_;
  }
  added_.notify_all();
}

std::optional<v1::CreateJobResponse> JobManager::FindJoinable(const std::string& name,
                                                               int client_world) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, entry] : jobs_) {
    const JobInfo& info = entry.job->info();
    if (entry.joinable && info.name == name && info.client_world == client_world) {
      return entry.joinable;
    }
  }
  return std::nullopt;
}

absl::StatusOr<v1::CreateJobResponse> JobManager::WaitForJoinable(
    const std::string& name, int client_world, std::chrono::milliseconds timeout,
    const std::function<std::optional<std::string>()>& leader_elsewhere,
    const std::function<bool()>& cancelled, std::chrono::milliseconds poll) {
  const Clock::time_point deadline = now_() + timeout;
  for (;;) {
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = adds_;
    }
    if (std::optional<v1::CreateJobResponse> found = FindJoinable(name, client_world)) {
      return *found;
    }
    if (std::optional<std::string> leader = leader_elsewhere()) {
      v1::CreateJobResponse elsewhere;
      elsewhere.set_leader(*leader);  // the client joins there
      return elsewhere;
    }
    if (cancelled() || now_() >= deadline) break;
    std::unique_lock<std::mutex> lock(mu_);
    added_.wait_for(lock, poll, [&] { return adds_ != seen; });
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "no job named '", name, "' for ", client_world, " client ranks was created within ",
      timeout.count(), " ms; client rank 0 creates it (same RANNC_JOB and client count on "
      "every rank)"));
}

absl::StatusOr<std::shared_ptr<Job>> JobManager::Get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no job '", id, "' on this daemon (it was deleted, or the daemon restarted); "
        "`rannc jobs` lists the live ones"));
  }
  it->second.touched = now_();
  return it->second.job;
}

absl::Status JobManager::Remove(const std::string& id) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no job '", id, "' on this daemon"));
    }
    job = std::move(it->second.job);
    jobs_.erase(it);
  }
  Release(std::move(job));
  return absl::OkStatus();
}

std::vector<JobManager::Expired> JobManager::RemoveExpired(
    const std::function<bool(Job&)>& on_expired) {
  const Clock::time_point now = now_();
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      const std::chrono::milliseconds lease = it->second.job->info().lease;
      if (lease.count() > 0 && now - it->second.touched > lease) {
        jobs.push_back(std::move(it->second.job));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<Expired> expired;
  for (std::shared_ptr<Job>& job : jobs) {
    const bool suspended = on_expired && on_expired(*job);
    expired.push_back({job->info().id, job->info().name, job->info().lease, suspended});
    Release(std::move(job));
  }
  return expired;
}

std::shared_ptr<Job> JobManager::Share(std::unique_ptr<Job> job) {
  return std::shared_ptr<Job>(job.release(), [](Job* j) {
    delete j;
    // Without this, creating and deleting jobs grew the daemon by ~100 MiB a job; trimmed only
    // where DeleteJob dropped its reference, a call in flight that held the job a moment longer
    // left it untrimmed (test_bad_input's footprint check then failed now and then).
#ifdef __GLIBC__
    malloc_trim(0);
#endif
  });
}

void JobManager::Release(std::shared_ptr<Job> job) {
  // Destroyed here unless a call in flight still holds it; the heap is trimmed then (Share).
  job.reset();
}

std::vector<JobManager::Listed> JobManager::List() const {
  const Clock::time_point now = now_();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Listed> jobs;
  for (const auto& [id, entry] : jobs_) {
    jobs.push_back({entry.job, std::chrono::duration_cast<std::chrono::milliseconds>(
                                   now - entry.touched)});
  }
  return jobs;
}

size_t JobManager::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

}  // namespace rannc
