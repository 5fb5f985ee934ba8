#include "daemon/server/fake_part_channel.h"

#include "absl/strings/str_cat.h"
#include "daemon/server/job_part_service.h"

namespace rannc {
namespace {

class FakePartChannel final : public PartChannel {
 public:
  FakePartChannel(std::string address, std::string part_id, FakePartChannels* daemons,
                  JobManager* jobs)
      : PartChannel(std::move(address)), part_id_(std::move(part_id)), daemons_(daemons),
        jobs_(jobs) {}

  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad,
                                                  bool delay_grad_allreduce) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(true);
    if (!job.ok()) return job.status();
    absl::StatusOr<std::vector<at::Tensor>> out =
        (*job)->Forward(0, inputs, requires_grad, delay_grad_allreduce);
    if (!out.ok()) return Named(out.status());
    return out;
  }

  absl::Status Backward(const OutputGrads& grads, bool retain_graph,
                        bool delay_grad_allreduce) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(true);
    if (!job.ok()) return job.status();
    return Named((*job)->Backward(0, grads, retain_graph, delay_grad_allreduce));
  }

  absl::StatusOr<NamedTensors> Run(const JobOp& op) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(true);
    if (!job.ok()) return job.status();
    absl::StatusOr<NamedTensors> out = (*job)->Run(0, op);
    if (!out.ok()) return Named(out.status());
    return out;
  }

  absl::StatusOr<std::optional<at::Tensor>> GetTensor(const std::string& name,
                                                      bool grad) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    return (*job)->GetTensor(name, grad);
  }

  absl::Status LoadState(const std::map<std::string, at::Tensor>& state) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    std::vector<std::string> missing, unexpected;
    // As over the wire: the part gets copies, not the leader's tensors.
    std::map<std::string, at::Tensor> copies;
    for (const auto& [name, t] : state) copies.emplace(name, t.detach().clone());
    return Named((*job)->LoadStateDict(copies, false, &missing, &unexpected));
  }

  absl::StatusOr<std::vector<OptimizerEntry>> OptimizerState() override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    absl::StatusOr<std::vector<OptimizerEntry>> state = (*job)->OptimizerState();
    if (!state.ok()) return Named(state.status());
    return state;
  }

  absl::Status LoadOptimizerState(const std::vector<OptimizerEntry>& state) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(true);
    if (!job.ok()) return job.status();
    std::vector<OptimizerEntry> copies;  // as over the wire
    for (const OptimizerEntry& e : state) copies.push_back({e.param, e.key, e.value.clone()});
    return Named((*job)->LoadOptimizerState(copies));
  }

  absl::Status StartCheckpointShare(const std::string& dir, const std::string& prefix,
                                    int64_t step) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    return Named((*job)->StartCheckpointShare(dir, prefix, step));
  }

  absl::StatusOr<v1::CheckpointShare> CheckpointShare(int64_t step) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    absl::StatusOr<v1::CheckpointShare> share = (*job)->CheckpointShare(step);
    if (!share.ok()) return Named(share.status());
    return share;
  }

  absl::Status RestoreLossScaler(double scale, int good_steps, int skipped_steps) override {
    absl::StatusOr<std::shared_ptr<Job>> job = Part(false);
    if (!job.ok()) return job.status();
    (*job)->RestoreLossScaler(scale, good_steps, skipped_steps);
    return absl::OkStatus();
  }

  void Notify(PartNotice notice, std::chrono::milliseconds) override {
    if (!daemons_->Reach(address(), false).ok()) return;
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(part_id_);
    if (!job.ok()) return;
    switch (notice) {
      case PartNotice::kAbortStep: (*job)->coordinator().AbortStep(); break;
      case PartNotice::kUndeploy: (*job)->Undeploy(); break;
      case PartNotice::kDelete: jobs_->Remove(part_id_).IgnoreError(); break;
    }
  }

  void CancelCalls() override {}  // calls here are direct: the part's AbortStep ends them

 private:
  absl::StatusOr<std::shared_ptr<Job>> Part(bool consume_failure) {
    absl::Status reach = daemons_->Reach(address(), consume_failure);
    if (!reach.ok()) return reach;
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(part_id_);
    if (!job.ok()) return Named(job.status());
    return job;
  }

  absl::Status Named(const absl::Status& s) const {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("daemon ", address(), ": ", s.message()));
  }

  const std::string part_id_;
  FakePartChannels* const daemons_;
  JobManager* const jobs_;
};

}  // namespace

void FakePartChannels::AddDaemon(const std::string& address, DaemonFacts facts) {
  std::lock_guard<std::mutex> lock(mu_);
  Daemon& d = daemons_[address];
  d.facts = std::move(facts);
  d.jobs = std::make_unique<JobManager>();
}

JobManager* FakePartChannels::jobs(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = daemons_.find(address);
  return it == daemons_.end() ? nullptr : it->second.jobs.get();
}

void FakePartChannels::Cut(const std::string& address) {
  std::vector<JobManager*> others;
  {
    std::lock_guard<std::mutex> lock(mu_);
    daemons_[address].cut = true;
    for (auto& [other, daemon] : daemons_) {
      if (other != address && daemon.jobs) others.push_back(daemon.jobs.get());
    }
  }
  // What the other daemons' clusters report once heartbeats stop (cluster::OnMemberDown).
  for (JobManager* jobs : others) {
    for (const JobManager::Listed& listed : jobs->List()) {
      listed.job->coordinator().MemberLost(address, "cut off (FakePartChannels::Cut)");
    }
  }
}

void FakePartChannels::FailNext(const std::string& address, absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  daemons_[address].fail_next = std::move(status);
}

absl::Status FakePartChannels::Reach(const std::string& address, bool consume_failure) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = daemons_.find(address);
  if (it == daemons_.end() || it->second.cut) {
    return absl::UnavailableError(absl::StrCat("daemon ", address, ": connection refused"));
  }
  if (consume_failure && !it->second.fail_next.ok()) {
    absl::Status failure = std::move(it->second.fail_next);
    it->second.fail_next = absl::OkStatus();
    return absl::Status(failure.code(), absl::StrCat("daemon ", address, ": ", failure.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PartChannel>> FakePartChannels::CreatePart(
    const std::string& address, const v1::JobSpec& spec, const v1::PartSpec& part,
    const std::string& model_bytes) {
  absl::Status reach = Reach(address, false);
  if (!reach.ok()) return reach;
  DaemonFacts facts;
  JobManager* jobs = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    facts = daemons_[address].facts;
    jobs = daemons_[address].jobs.get();
  }
  absl::StatusOr<std::string> id = CreatePartJob(spec, part, model_bytes, facts, jobs, store_);
  if (!id.ok()) return id.status();
  return std::unique_ptr<PartChannel>(new FakePartChannel(address, *id, this, jobs));
}

}  // namespace rannc
