#include "daemon/server/training_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/cluster/cluster.h"
#include "daemon/cluster/cluster_service.h"
#include "daemon/cluster/election.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/files.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/planner/deployment.h"
#include "daemon/planner/links.h"
#include "daemon/planner/planner.h"
#include "daemon/server/job_model.h"
#include "daemon/server/optimizer_state_codec.h"
#include "daemon/server/rpc_status.h"

namespace rannc {
namespace {

grpc::Status Fail(const char* rpc, const absl::Status& status) { return FailRpc(rpc, status); }

// State_dict streams cut tensors into pieces this large, well under any message limit.
constexpr size_t kStateChunkBytes = 4 << 20;

void FillParamInfo(const ParamStore::Entry& e, v1::ParamInfo* info) {
  info->set_name(e.name);
  EncodeSpec(e.tensor, info->mutable_spec());
  for (const std::string& a : e.aliases) info->add_aliases(a);
  info->set_requires_grad(e.tensor.requires_grad());
}

}  // namespace

absl::StatusOr<std::vector<at::Tensor>> DecodeAll(
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors, const char* what,
    const ShmDirectory& shm) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < tensors.size(); ++i) {
    absl::StatusOr<at::Tensor> t = DecodeTensor(tensors[i], absl::StrCat(what, " #", i), &shm);
    if (!t.ok()) return t.status();
    out.push_back(std::move(*t));
  }
  return out;
}

// Decodes JobSpec.model_tensors on several threads: copying GiBs out of shared memory into new
// host memory is bound by page faults on the new memory, which threads take in parallel
// (measured here, one thread: 5.4 GB in 11.6 s).
absl::StatusOr<SentTensors> DecodeModelTensors(
    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& tensors, const ShmDirectory& shm) {
  const int n = tensors.size();
  std::vector<absl::StatusOr<at::Tensor>> decoded(n, absl::UnknownError("not decoded"));
  std::atomic<int> next{0};
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::min(n, std::clamp(cores, 1, 8));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) {
        decoded[i] = DecodeTensor(tensors[i].tensor(),
                                  absl::StrCat("model tensor '", tensors[i].name(), "'"), &shm);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  SentTensors sent;
  for (int i = 0; i < n; ++i) {
    if (!decoded[i].ok()) return decoded[i].status();
    if (!sent.emplace(tensors[i].name(), std::move(*decoded[i])).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("model tensor '", tensors[i].name(), "' was sent twice"));
    }
  }
  return sent;
}

namespace {

// A plan's estimated peak bytes on each of this daemon's `num_devices` devices (a device of a
// cluster plan beyond them is another daemon's).
std::vector<uint64_t> PlannedBytes(const v1::Deployment& plan, size_t num_devices) {
  std::vector<uint64_t> bytes(num_devices, 0);
  for (const v1::DeploymentStage& stage : plan.stages()) {
    for (uint32_t d : stage.devices()) {
      if (d < num_devices) bytes[d] += stage.memory_bytes();
    }
  }
  return bytes;
}

// The first device where `need` is more than `free`, described ("its plan needs 2.0 GiB on
// cuda:0, where other jobs leave 1.5 GiB"); "" when it fits everywhere.
std::string FirstShortfall(const std::vector<uint64_t>& need, const std::vector<uint64_t>& free,
                           const std::vector<DaemonFacts::Device>& devices) {
  for (size_t d = 0; d < need.size() && d < free.size(); ++d) {
    if (need[d] <= free[d]) continue;
    return absl::StrCat("its plan needs ", planner::HumanBytes(need[d]), " on ",
                        d < devices.size() ? devices[d].name : absl::StrCat("device ", d),
                        ", where other jobs leave ", planner::HumanBytes(free[d]));
  }
  return "";
}

// Where a daemon without a state dir keeps its uploads: $TMPDIR, else /tmp.
std::string TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp";
}

// The uploaded files `spec` names, removed (the job that named them ended, or was refused).
void ReleaseUploads(const Uploads& uploads, const v1::DetachedJobSpec& spec) {
  for (const std::string& path : NamedFiles(spec)) uploads.Release(path);
}

}  // namespace

TrainingServiceImpl::TrainingServiceImpl(DaemonFacts facts, JobManager* jobs,
                                         PartChannels* parts, JobRecords* records)
    : facts_(std::move(facts)),
      shm_(facts_.shm_dir),
      jobs_(jobs),
      parts_(parts),
      records_(records),
      reaper_(std::chrono::seconds(1), [this] {
        ReapExpiredJobs();
        RemoveUnusedUploads();
      }) {
  DetachedJobs::Hooks hooks;
  hooks.start = [this](const std::string& id, const v1::JobSpec& spec, const std::string& model,
                       const std::vector<at::Tensor>& examples)
      -> absl::StatusOr<std::shared_ptr<Job>> {
    absl::StatusOr<JobSettings> settings = JobSettingsFromSpec(spec, facts_);
    if (!settings.ok()) return settings.status();
    v1::CreateJobResponse response;
    absl::StatusOr<std::shared_ptr<Job>> job = StartJob(id, spec, std::move(*settings), model,
                                                        examples, {}, &response,
                                                        /*durable=*/false);
    if (job.ok()) {
      spdlog::info("created job {} '{}' (detached); {}", id, spec.name(),
                   response.plan_summary());
    }
    return job;
  };
  hooks.remove = [this](const std::string& id) { jobs_->Remove(id).IgnoreError(); };
  hooks.need = [this](const v1::JobSpec& spec, const std::string& model,
                      const std::vector<at::Tensor>& examples)
      -> absl::StatusOr<DetachedJobs::Hooks::Need> {
    absl::StatusOr<JobSettings> settings = JobSettingsFromSpec(spec, facts_);
    if (!settings.ok()) return settings.status();
    DetachedJobs::Hooks::Need need;
    absl::StatusOr<v1::Deployment> plan = PlanJob(*settings, model, examples, {}, &need.bounds);
    if (!plan.ok()) return Annotate(plan.status(), "planning the job");
    need.bytes = PlannedBytes(*plan, facts_.devices.size());
    need.plan = plan->SerializeAsString();
    return need;
  };
  hooks.short_of = [this](const std::vector<uint64_t>& need) { return ShortOf(need); };
  hooks.new_id = [this] { return jobs_->NewJobId(); };
  // Uploads live beside the records, or, without a state dir, for this process only.
  uploads_ = records_->enabled()
                 ? std::make_unique<Uploads>(JoinPath(ParentPath(records_->dir()), "uploads"))
                 : std::make_unique<Uploads>(
                       absl::StrCat(TempDir(), "/ranncd-uploads-", ::getpid()), true);
  hooks.ended = [this](const v1::DetachedJobSpec& spec) { ReleaseUploads(*uploads_, spec); };
  detached_ = std::make_unique<DetachedJobs>(
      std::move(hooks),
      records_->enabled() ? JoinPath(ParentPath(records_->dir()), "detached") : "");
  if (const char* drops = std::getenv("RANNC_TEST_DROP_RESPONSES")) {
    for (absl::string_view item : absl::StrSplit(drops, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> rpc_n = absl::StrSplit(item, ':');
      int n = 0;
      if (absl::SimpleAtoi(rpc_n.second, &n)) drop_[rpc_n.first].insert(n);
    }
    spdlog::warn("RANNC_TEST_DROP_RESPONSES={}: this daemon drops those answers (tests only)",
                 drops);
  }
}

TrainingServiceImpl::~TrainingServiceImpl() {
  std::vector<std::thread> recoveries;
  {
    std::lock_guard<std::mutex> lock(shared_mu_);
    recoveries.swap(recoveries_);
  }
  for (std::thread& t : recoveries) t.join();
}

void TrainingServiceImpl::ReapExpiredJobs() {
  for (const JobManager::Expired& e :
       jobs_->RemoveExpired([this](Job& job) { return Suspend(job); })) {
    if (e.suspended) {
      spdlog::warn("suspended job {} '{}': no call from its client for its lease of {} ms; its "
                   "last checkpoint is written and its record kept (ResumeJob, or a client "
                   "creating a job of its name, brings it back)", e.id, e.name, e.lease.count());
      Unregister(e.id);
      continue;
    }
    Unregister(e.id);
    records_->Remove(e.id).IgnoreError();
    spdlog::warn("deleted job {} '{}': no call from its client for its lease of {} ms (the "
                 "client exited or hung without deleting it)",
                 e.id, e.name, e.lease.count());
  }
}

void TrainingServiceImpl::RemoveUnusedUploads() {
  const std::chrono::milliseconds ttl = upload_ttl_.load();
  const auto now = std::chrono::steady_clock::now();
  const std::chrono::milliseconds every = std::min<std::chrono::milliseconds>(
      ttl / 4, std::chrono::minutes(1));
  if (now - uploads_swept_ < every) return;
  uploads_swept_ = now;
  // The records first, then the uploads: a job submitted in between names files written moments
  // ago, which are not old enough to go.
  const int removed = uploads_->RemoveUnused(detached_->PathsInUse(), ttl);
  if (removed > 0) {
    spdlog::info("removed {} uploaded file(s) under {} that no job names, unwritten for {} s "
                 "(--upload-ttl)", removed, uploads_->dir(), ttl.count() / 1000.0);
  }
}

absl::Status TrainingServiceImpl::EncodeReply(
    const std::vector<at::Tensor>& tensors, const v1::ShmRef& reply_shm,
    google::protobuf::RepeatedPtrField<v1::Tensor>* out) const {
  std::optional<ShmDirectory::Writer> writer;
  if (!reply_shm.path().empty()) {
    absl::StatusOr<ShmDirectory::Writer> opened = shm_.OpenReply(reply_shm);
    if (!opened.ok()) return opened.status();
    writer.emplace(std::move(*opened));
  }
  for (const at::Tensor& t : tensors) {
    absl::Status status = EncodeTensor(t, out->Add(), writer ? &*writer : nullptr);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void TrainingServiceImpl::set_address(std::string address) {
  std::lock_guard<std::mutex> lock(address_mu_);
  address_ = std::move(address);
}

void TrainingServiceImpl::set_cluster(const cluster::Cluster* cluster) {
  std::lock_guard<std::mutex> lock(address_mu_);
  cluster_ = cluster;
}

void TrainingServiceImpl::set_coordinator_election(const cluster::Election* election,
                                                   std::string cluster_store) {
  std::lock_guard<std::mutex> lock(address_mu_);
  coordinator_election_ = election;
  cluster_store_ = std::move(cluster_store);
}

grpc::Status TrainingServiceImpl::GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest*,
                                          v1::DaemonInfo* info) {
  grpc::Status denied = Authorize(*context, "GetInfo");
  if (!denied.ok()) return denied;
  info->set_version(facts_.version);
  info->set_torch_version(facts_.torch_version);
  const cluster::Cluster* cluster = nullptr;
  {
    std::lock_guard<std::mutex> lock(address_mu_);
    info->set_listen(address_);
    cluster = cluster_;
  }
  if (cluster != nullptr) {
    const cluster::Clock::time_point now = cluster->Now();
    for (const cluster::MemberInfo& member : cluster->Members()) {
      cluster::ToProto(member, now, info->add_cluster());
    }
    absl::StatusOr<std::string> coordinator = Coordinator();
    if (coordinator.ok()) {
      // Empty: this daemon coordinates; it is named as the others know it (its advertised
      // address), not by its listen address (0.0.0.0:7411 in a pod).
      info->set_coordinator(coordinator->empty() ? cluster->address() : *coordinator);
    }
  }
  {
    std::lock_guard<std::mutex> lock(address_mu_);
    info->set_cluster_store(cluster_store_);
  }
  info->set_hostname(facts_.hostname);
  info->set_max_message_bytes(facts_.max_message_bytes);
  info->set_shm_dir(facts_.shm_dir);
  info->set_links(planner::DescribeLinks(facts_.links));
  info->set_num_jobs(jobs_->size());
  for (const DaemonFacts::Device& d : facts_.devices) {
    v1::DeviceInfo* device = info->add_devices();
    device->set_name(d.name);
    device->set_type(d.type);
    device->set_memory_bytes(d.memory_bytes);
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::CreateJob(grpc::ServerContext* context,
                                            grpc::ServerReader<v1::CreateJobRequest>* reader,
                                            v1::CreateJobResponse* response) {
  grpc::Status denied = Authorize(*context, "CreateJob");
  if (!denied.ok()) return denied;
  v1::CreateJobRequest request;
  if (!reader->Read(&request) || !request.has_spec()) {
    return Fail("CreateJob", absl::InvalidArgumentError(
        "CreateJob must start with a JobSpec message, then the model's bytes"));
  }
  const auto received = std::chrono::steady_clock::now();
  v1::JobSpec spec = std::move(*request.mutable_spec());
  std::string model;
  // A hint from the client, so bounded: a bogus size must not make the daemon allocate it.
  model.reserve(std::min<uint64_t>(spec.model_bytes(), uint64_t{1} << 30));
  while (reader->Read(&request)) {
    if (!request.has_model_chunk() && request.has_spec()) {
      return Fail("CreateJob", absl::InvalidArgumentError("CreateJob got a second JobSpec"));
    }
    model += request.model_chunk();
  }
  if (spec.model_bytes() != 0 && model.size() != spec.model_bytes()) {
    return Fail("CreateJob", absl::InvalidArgumentError(absl::StrCat(
        "the model stream ended after ", model.size(), " of ", spec.model_bytes(), " bytes")));
  }
  if (model.empty()) {
    return Fail("CreateJob", absl::InvalidArgumentError("CreateJob carried no model bytes"));
  }
  const double receive_s = SecondsSince(received);
  absl::StatusOr<JobSettings> made = JobSettingsFromSpec(spec, facts_);
  if (!made.ok()) return Fail("CreateJob", made.status());
  absl::StatusOr<std::vector<at::Tensor>> examples =
      DecodeAll(spec.example_inputs(), "example input", shm_);
  if (!examples.ok()) return Fail("CreateJob", examples.status());
  const auto decoding = std::chrono::steady_clock::now();
  absl::StatusOr<SentTensors> decoded = DecodeModelTensors(spec.model_tensors(), shm_);
  if (!decoded.ok()) return Fail("CreateJob", decoded.status());
  const SentTensors sent = std::move(*decoded);
  const double tensors_s = SecondsSince(decoding);
  // Decoded: what the spec keeps of them (inline bytes, or the client's shm files) is not
  // needed again, and copies of the spec (the job's record) need not carry it.
  spec.clear_example_inputs();
  spec.clear_model_tensors();
  JobSettings settings = std::move(*made);
  settings.spec.clear_example_inputs();
  settings.spec.clear_model_tensors();

  if (spec.dry_run().num_devices() > 0) {
    absl::Status dry = ApplyDryRun(spec.dry_run(), &settings);
    if (!dry.ok()) return Fail("CreateJob", dry);
    absl::StatusOr<v1::Deployment> plan = PlanJob(settings, model, *examples, sent);
    if (!plan.ok()) return Fail("CreateJob", plan.status());
    response->set_plan_summary(planner::DescribeDeployment(*plan));
    *response->mutable_deployment() = std::move(*plan);
    spdlog::info("planned '{}' for {} devices (dry run, {:.2f} s)", spec.name(),
                 spec.dry_run().num_devices(), response->deployment().planning_seconds());
    return grpc::Status::OK;
  }

  if (absl::Status admitted = Admit(model, *examples, sent, &settings); !admitted.ok()) {
    return Fail("CreateJob", admitted);
  }
  std::optional<v1::JobRecord> suspended = SuspendedFor(spec);
  if (suspended && settings.checkpoints.resume < 0) {
    spdlog::info("job '{}' attaches to the suspended job {} of that name: it resumes from its "
                 "latest checkpoint", spec.name(), suspended->job_id());
    settings.checkpoints.resume = 0;
  }
  const bool registers = Registers(spec, settings);
  if (registers) {
    if (absl::Status led = registry_->Lead(spec.name()); !led.ok()) {
      return Fail("CreateJob", led);
    }
    Fence(&settings);
  }
  const std::string id = jobs_->NewJobId();
  absl::StatusOr<std::shared_ptr<Job>> job =
      StartJob(id, spec, std::move(settings), model, *examples, sent, response);
  if (!job.ok()) {
    if (registers) registry_->Abandon(spec.name());
    return Fail("CreateJob", job.status());
  }
  if (registers) {
    if (absl::Status registered = Register(**job, spec, model, *examples, sent);
        !registered.ok()) {
      Discard(id);
      registry_->Abandon(spec.name());
      return Fail("CreateJob", registered);
    }
  }
  if (suspended) records_->Remove(suspended->job_id()).IgnoreError();
  const JobInfo& info = (*job)->info();
  spdlog::info("created job {} '{}' ({} parameters, {} bytes of TorchScript); {}; seconds: "
               "receive {:.2f}, tensors apart {:.2f} ({} of them), import {:.2f}, IR {:.2f}, "
               "plan {:.2f}, place {:.2f}",
               id, spec.name(), (*job)->params().NumParameterElements(), model.size(),
               response->plan_summary(), receive_s, tensors_s, sent.size(), info.import_s,
               info.ir_s, info.plan_s, info.place_s);
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<Job>> TrainingServiceImpl::StartJob(
    const std::string& id, const v1::JobSpec& spec, JobSettings settings,
    const std::string& model, const std::vector<at::Tensor>& examples, const SentTensors& sent,
    v1::CreateJobResponse* response, bool durable) {
  comm::Store* store = nullptr;
  {
    std::lock_guard<std::mutex> lock(address_mu_);
    store = cluster_ != nullptr ? store_ : nullptr;
  }
  if (store != nullptr) {
    std::vector<std::string> left_out;
    absl::Status spanned =
        SpanCluster(id, spec, Members(), facts_, store, &settings, &left_out);
    if (!spanned.ok()) return spanned;
    if (!left_out.empty()) {
      spdlog::warn("job {} leaves out cluster member(s) {}, which are DOWN", id,
                   absl::StrJoin(left_out, ", "));
    }
  }
  settings.backend = JobBackend(settings.placement, facts_.devices);
  absl::StatusOr<std::unique_ptr<Job>> made =
      Job::Create(id, std::move(settings), model, examples, sent, parts_);
  if (!made.ok()) return made.status();
  std::shared_ptr<Job> job = JobManager::Share(std::move(*made));
  const JobInfo& info = job->info();
  response->set_job_id(id);
  if (auth_ != nullptr && auth_->enabled()) {
    response->set_job_token(auth_->IssueJobToken(id, spec.name()));
  }
  *response->mutable_deployment() = info.plan;
  response->set_plan_summary(planner::DescribeDeployment(info.plan));
  for (const ParamStore::Entry& e : job->params().entries()) {
    FillParamInfo(e, e.is_parameter ? response->add_params() : response->add_buffers());
  }
  for (const OutputSpec& out : info.outputs) {
    EncodeSpec(out.dtype, out.shape, response->add_outputs());
  }
  for (const std::string& d : info.devices) response->add_devices(d);
  response->set_resumed_step(job->resumed_step());
  // A job that writes checkpoints is durable: its record lets a restarted daemon bring it back.
  if (durable && records_->enabled() && !job->checkpoint_job_dir().empty()) {
    records_->SaveInBackground(id, spec, model, examples, sent, info.plan);
  }
  std::optional<v1::CreateJobResponse> joinable;
  if (info.client_world > 1) joinable = *response;
  jobs_->Add(job, std::move(joinable));
  return job;
}

bool TrainingServiceImpl::Suspend(Job& job) {
  if (!records_->enabled() || !records_->Find(job.info().id).ok()) return false;
  const std::vector<CheckpointInfo> written = job.Checkpoints();
  if (!written.empty() && written.back().committed &&
      written.back().step == job.Summary().steps) {
    return true;  // nothing since its last checkpoint
  }
  absl::StatusOr<CheckpointInfo> last = job.Checkpoint(/*wait=*/true);
  if (!last.ok()) {
    spdlog::error("job {}: its last checkpoint failed ({}); deleting it instead of suspending",
                  job.info().id, last.status().ToString());
    return false;
  }
  return true;
}

std::optional<v1::JobRecord> TrainingServiceImpl::SuspendedFor(const v1::JobSpec& spec) const {
  const std::string dir = CheckpointDirOf(spec);
  if (!records_->enabled() || dir.empty()) return std::nullopt;
  std::set<std::string> live;
  for (const JobManager::Listed& listed : jobs_->List()) live.insert(listed.job->info().id);
  std::optional<v1::JobRecord> found;
  for (v1::JobRecord& r : records_->List()) {
    if (r.name() == spec.name() && CheckpointDirOf(r.spec()) == dir && !live.count(r.job_id())) {
      found = std::move(r);  // the newest wins
    }
  }
  return found;
}

void TrainingServiceImpl::set_registry(JobRegistry* registry) {
  registry_ = registry;
  if (registry_ != nullptr) {
    registry_->WatchOrphans([this](const std::string& name) { TakeOver(name); });
  }
}

bool TrainingServiceImpl::Registers(const v1::JobSpec& spec, const JobSettings& settings) const {
  return registry_ != nullptr && !settings.checkpoints.dir.empty() && !spec.name().empty();
}

void TrainingServiceImpl::Fence(JobSettings* settings) const {
  settings->fence = [registry = registry_] { return registry->Fence(); };
  settings->step_log_daemon = registry_->self();
}

JobRecords& TrainingServiceImpl::SharedRecords(const std::string& job_dir) {
  std::lock_guard<std::mutex> lock(shared_mu_);
  std::unique_ptr<JobRecords>& records = shared_records_[job_dir];
  if (!records) records = std::make_unique<JobRecords>(job_dir);
  return *records;
}

absl::StatusOr<std::shared_ptr<Job>> TrainingServiceImpl::StartResumed(
    const std::string& id, const JobRecords::Loaded& loaded, v1::JobSpec spec, bool fenced,
    v1::CreateJobResponse* response) {
  (*spec.mutable_options()->mutable_config())["resume"] = "latest";
  absl::StatusOr<JobSettings> settings = JobSettingsFromSpec(spec, facts_);
  if (!settings.ok()) return settings.status();
  if (fenced) Fence(&*settings);
  return StartJob(id, spec, std::move(*settings), loaded.model_bytes, loaded.example_inputs,
                  loaded.sent, response);
}

void TrainingServiceImpl::Discard(const std::string& job_id) {
  jobs_->Remove(job_id).IgnoreError();
  records_->Remove(job_id).IgnoreError();
}

void TrainingServiceImpl::Describe(const Job& job, v1::RegisteredJob* entry) {
  entry->set_job_id(job.info().id);
  entry->set_resumed_step(job.resumed_step());
  entry->clear_devices();
  for (const std::string& d : job.info().devices) entry->add_devices(d);
}

absl::Status TrainingServiceImpl::Register(const Job& job, const v1::JobSpec& spec,
                                           const std::string& model,
                                           const std::vector<at::Tensor>& examples,
                                           const SentTensors& sent) {
  const std::string job_dir = job.checkpoint_job_dir();
  // The record first, where a daemon taking the job over reads it (in the background, as the
  // state dir's: a takeover before it is written fails and is tried again).
  SharedRecords(job_dir).SaveInBackground(job.info().id, spec, model, examples, sent,
                                          job.info().plan);
  v1::RegisteredJob entry;
  entry.set_name(spec.name());
  entry.set_record_dir(job_dir);
  entry.set_record_id(job.info().id);
  entry.set_client_world(static_cast<uint32_t>(job.info().client_world));
  Describe(job, &entry);
  absl::Status published = registry_->Publish(std::move(entry));
  if (published.ok()) {
    spdlog::info("job {} '{}' is in the cluster's registry: another daemon takes it over if "
                 "this one is lost", job.info().id, spec.name());
  }
  return published;
}

void TrainingServiceImpl::Unregister(const std::string& job_id) {
  if (registry_ == nullptr) return;
  std::optional<v1::RegisteredJob> released = registry_->Release(job_id);
  if (released) SharedRecords(released->record_dir()).Remove(released->record_id()).IgnoreError();
}

void TrainingServiceImpl::TakeOver(const std::string& name) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(shared_mu_);
    auto it = takeover_after_.find(name);
    if (it != takeover_after_.end() && now < it->second) return;  // failed here just now
  }
  absl::StatusOr<std::optional<v1::RegisteredJob>> won = registry_->TakeOver(name);
  if (!won.ok()) {
    spdlog::warn("job '{}' has no leader; taking it over failed: {}", name,
                 won.status().ToString());
    return;
  }
  if (!won->has_value()) return;  // another daemon leads it
  v1::RegisteredJob entry = std::move(**won);
  spdlog::warn("job '{}' ({}) lost its leader {}: this daemon takes it over from its latest "
               "checkpoint in {}", name, entry.job_id(), entry.leader(), entry.record_dir());
  const std::string lost = entry.leader();
  if (absl::Status restarted = Restart(std::move(entry), lost, "took over");
      !restarted.ok()) {
    spdlog::error("taking over job '{}' failed: {}; another daemon (or this one, in 5 s) tries "
                  "again", name, restarted.ToString());
    registry_->Abandon(name);
    std::lock_guard<std::mutex> lock(shared_mu_);
    takeover_after_[name] = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  }
}

void TrainingServiceImpl::Recover(const std::string& job_id) {
  if (registry_ == nullptr) return;
  std::optional<v1::RegisteredJob> entry = registry_->EntryOf(job_id);
  if (!entry) return;
  std::lock_guard<std::mutex> lock(shared_mu_);
  if (!recovering_.insert(job_id).second) return;
  recoveries_.emplace_back([this, entry = std::move(*entry)]() mutable {
    const std::string old_id = entry.job_id();
    const std::string name = entry.name();
    spdlog::warn("job {} '{}' lost a daemon it ran on: bringing it back from its latest "
                 "checkpoint over the members that are UP", old_id, name);
    absl::Status restarted = Restart(std::move(entry), "", "recovered");
    if (restarted.ok()) {
      // Published under its new id first, so that its client finds it before the old id goes.
      Discard(old_id);
    } else {
      spdlog::error("bringing job {} '{}' back failed: {}; its calls fail, naming the lost "
                    "daemon, until it is deleted", old_id, name, restarted.ToString());
    }
    std::lock_guard<std::mutex> lock(shared_mu_);
    recovering_.erase(old_id);
  });
}

absl::Status TrainingServiceImpl::Restart(v1::RegisteredJob entry, const std::string& lost_leader,
                                          const char* why) {
  const auto started = std::chrono::steady_clock::now();
  // Planned over the members that are UP: wait (briefly) until this daemon's view has the lost
  // leader DOWN too (its member key went with the same lease), rather than plan over it.
  const auto down_by = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (!lost_leader.empty() && std::chrono::steady_clock::now() < down_by) {
    if (registry_->stopping()) return absl::CancelledError("this daemon is stopping");
    bool up = false;
    for (const cluster::MemberInfo& m : Members()) {
      up |= !m.self && m.address == lost_leader && m.state == cluster::MemberState::kUp;
    }
    if (!up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  absl::StatusOr<JobRecords::Loaded> loaded =
      SharedRecords(entry.record_dir()).Load(entry.record_id());
  if (!loaded.ok()) return loaded.status();
  const std::string id = jobs_->NewJobId();
  v1::CreateJobResponse response;
  absl::StatusOr<std::shared_ptr<Job>> job =
      StartResumed(id, *loaded, loaded->record.spec(), /*fenced=*/true, &response);
  if (!job.ok()) return job.status();
  if (registry_->stopping()) {
    Discard(id);
    return absl::CancelledError("this daemon is stopping");
  }
  const std::string previous = entry.job_id();
  entry.set_generation(entry.generation() + 1);
  Describe(**job, &entry);
  const std::string name = entry.name();
  if (absl::Status published = registry_->Publish(std::move(entry)); !published.ok()) {
    Discard(id);
    return published;
  }
  spdlog::warn("{} job '{}': {} runs as {} here, from step {} ({}; {:.2f} s); it waits for its "
               "client", why, name, previous, id, (*job)->resumed_step(),
               response.plan_summary(), SecondsSince(started));
  return absl::OkStatus();
}

std::vector<cluster::MemberInfo> TrainingServiceImpl::Members() const {
  std::lock_guard<std::mutex> lock(address_mu_);
  if (cluster_ == nullptr) return {};
  return cluster_->Members();
}

std::vector<std::string> TrainingServiceImpl::OtherMembers() const {
  std::vector<std::string> out;
  for (const cluster::MemberInfo& m : Members()) {
    if (!m.self && m.state == cluster::MemberState::kUp) out.push_back(m.address);
  }
  return out;
}

namespace {

std::string TrainingMethod(const char* rpc) {
  return absl::StrCat("/rannc.v1.TrainingService/", rpc);
}

}  // namespace

grpc::Status TrainingServiceImpl::Authorize(const grpc::ServerContext& context, const char* rpc,
                                            const std::string& job_id,
                                            const std::string& job_name) const {
  return security::CheckCall(auth_, context, TrainingMethod(rpc), job_id, job_name);
}

security::Caller TrainingServiceImpl::Authenticate(const grpc::ServerContext& context,
                                                   const char* rpc, grpc::Status* denied) const {
  if (auth_ == nullptr || !auth_->enabled()) {
    *denied = grpc::Status::OK;
    return security::Caller();
  }
  security::Caller caller = auth_->Identify(context);
  *denied = security::CheckAuthenticated(auth_, caller, TrainingMethod(rpc));
  return caller;
}

grpc::Status TrainingServiceImpl::Authorize(const security::Caller& caller, const char* rpc,
                                            const std::string& job_id,
                                            const std::string& job_name) const {
  return security::CheckCaller(auth_, caller, TrainingMethod(rpc), job_id, job_name);
}

absl::StatusOr<std::string> TrainingServiceImpl::Coordinator() const {
  std::lock_guard<std::mutex> lock(address_mu_);
  if (coordinator_election_ != nullptr) {
    if (coordinator_election_->leads()) return std::string();
    std::string leader = coordinator_election_->leader();
    if (leader.empty()) {
      // pyrannc.barrier() retries on "has no coordinator yet": such a call met no one.
      return absl::UnavailableError(absl::StrCat(
          "the cluster has no coordinator yet (elected in etcd, ", cluster_store_,
          "): the last one just left, or etcd cannot be reached; retry"));
    }
    return leader;
  }
  if (cluster_ == nullptr) return std::string();
  const std::vector<cluster::MemberInfo> members = cluster_->Members();
  if (members.size() < 2) return std::string();
  for (const cluster::MemberInfo& m : members) {
    if (m.rank == 0) return m.self ? std::string() : m.address;
  }
  return std::string();
}

v1::TrainingService::Stub* TrainingServiceImpl::PeerStub(const std::string& address) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  std::unique_ptr<v1::TrainingService::Stub>& stub = peers_[address];
  if (!stub) {
    stub = v1::TrainingService::NewStub(
        security::PeerChannel(address));
  }
  return stub.get();
}

v1::JobPartService::Stub* TrainingServiceImpl::PartStub(const std::string& address) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  std::unique_ptr<v1::JobPartService::Stub>& stub = part_stubs_[address];
  if (!stub) {
    stub = v1::JobPartService::NewStub(
        security::PeerChannel(address));
  }
  return stub.get();
}

grpc::Status TrainingServiceImpl::JoinJob(grpc::ServerContext* context,
                                          const v1::JoinJobRequest* request,
                                          v1::CreateJobResponse* response) {
  grpc::Status denied = Authorize(*context, "JoinJob", "", request->name());
  if (!denied.ok()) return denied;
  if (absl::Status bounded = CheckClientWorld(request->client_world(), "JoinJob");
      !bounded.ok()) {
    return Fail("JoinJob", bounded);
  }
  // Rank 0 may still be creating the job (planning takes a while), and on another daemon of the
  // cluster: wait for it, asking the others too.
  auto leader_elsewhere = [&]() -> std::optional<std::string> {
    for (const std::string& peer : OtherMembers()) {
      v1::FindJobRequest ask;
      ask.set_name(request->name());
      ask.set_client_world(request->client_world());
      v1::Empty found;
      grpc::ClientContext peer_context;
      peer_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      if (PartStub(peer)->FindJob(&peer_context, ask, &found).ok()) return peer;
    }
    return std::nullopt;
  };
  absl::StatusOr<v1::CreateJobResponse> joined = jobs_->WaitForJoinable(
      request->name(), static_cast<int>(request->client_world()),
      std::chrono::milliseconds(request->timeout_ms()), leader_elsewhere,
      [context] { return context->IsCancelled(); });
  if (!joined.ok()) return Fail("JoinJob", joined.status());
  *response = std::move(*joined);
  if (auth_ != nullptr && auth_->enabled() && response->leader().empty()) {
    response->set_job_token(auth_->JobToken(response->job_id()));
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ClientBarrier(grpc::ServerContext* context,
                                                const v1::ClientBarrierRequest* request,
                                                v1::Empty*) {
  grpc::Status denied = Authorize(*context, "ClientBarrier", "", request->name());
  if (!denied.ok()) return denied;
  if (absl::Status bounded = CheckClientWorld(request->client_world(), "ClientBarrier");
      !bounded.ok()) {
    return Fail("ClientBarrier", bounded);
  }
  const int world = static_cast<int>(request->client_world());
  if (world <= 1) return grpc::Status::OK;
  // Over a cluster, client ranks may talk to different daemons: they meet at the coordinator.
  absl::StatusOr<std::string> coordinator_or = Coordinator();
  if (!coordinator_or.ok()) return Fail("ClientBarrier", coordinator_or.status());
  if (const std::string& coordinator = *coordinator_or; !coordinator.empty()) {
    grpc::ClientContext forwarded;
    forwarded.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(request->timeout_ms()) +
                           std::chrono::seconds(10));
    v1::Empty empty;
    return PeerStub(coordinator)->ClientBarrier(&forwarded, *request, &empty);
  }
  std::shared_ptr<ClientRendezvous> ranks;
  {
    std::lock_guard<std::mutex> lock(barriers_mu_);
    std::shared_ptr<ClientRendezvous>& slot = barriers_[{request->name(), world}];
    if (!slot) {
      slot = std::make_shared<ClientRendezvous>(
          world, std::chrono::milliseconds(std::max<uint32_t>(request->timeout_ms(), 1)));
    }
    ranks = slot;
  }
  std::function<absl::StatusOr<bool>(std::vector<bool>&)> meet =
      [](std::vector<bool>&) -> absl::StatusOr<bool> { return true; };
  absl::Status met = ranks->Meet<bool, bool>(absl::StrCat("barrier '", request->name(), "'"),
                                             static_cast<int>(request->client_rank()), true, meet)
                         .status();
  if (!met.ok()) {
    // Its ranks are out of step: the next call starts afresh (and nothing stays behind for
    // barriers that never complete).
    std::lock_guard<std::mutex> lock(barriers_mu_);
    auto it = barriers_.find({request->name(), world});
    if (it != barriers_.end() && it->second == ranks) barriers_.erase(it);
    return Fail("ClientBarrier", met);
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::AddMode(grpc::ServerContext* context,
                                          grpc::ServerReader<v1::AddModeRequest>* reader,
                                          v1::AddModeResponse*) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "AddMode", &denied);
  if (!denied.ok()) return denied;
  v1::AddModeRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return Fail("AddMode", absl::InvalidArgumentError(
        "AddMode must start with a header message, then the model's bytes"));
  }
  const v1::AddModeRequest::Header header = request.header();
  denied = Authorize(caller, "AddMode", header.job_id());
  if (!denied.ok()) return denied;
  std::string model;
  while (reader->Read(&request)) model += request.model_chunk();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(header.job_id());
  if (!job.ok()) return Fail("AddMode", job.status());
  absl::Status status = (*job)->AddMode(FromProto(header.mode()), model);
  if (!status.ok()) return Fail("AddMode", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::DeleteJob(grpc::ServerContext* context, const v1::JobRef* ref,
                                            v1::Empty*) {
  grpc::Status denied = Authorize(*context, "DeleteJob", ref->job_id());
  if (!denied.ok()) return denied;
  if (detached_->Status(ref->job_id()).ok()) {
    // A detached job's thread drives it: it stops after its step and deletes the job.
    absl::Status cancelled = detached_->Cancel(ref->job_id());
    if (!cancelled.ok()) return Fail("DeleteJob", cancelled);
    spdlog::info("cancelled detached job {} (DeleteJob)", ref->job_id());
    return grpc::Status::OK;
  }
  absl::Status status = jobs_->Remove(ref->job_id());
  if (status.code() == absl::StatusCode::kNotFound && records_->Find(ref->job_id()).ok()) {
    status = absl::OkStatus();  // a suspended job: its record goes
  }
  if (!status.ok()) return Fail("DeleteJob", status);
  Unregister(ref->job_id());
  records_->Remove(ref->job_id()).IgnoreError();
  if (auth_ != nullptr) auth_->ForgetJob(ref->job_id());
  spdlog::info("deleted job {}", ref->job_id());
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::RenewLeases(grpc::ServerContext* context,
                                              const v1::RenewLeasesRequest* request,
                                              v1::RenewLeasesResponse* response) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "RenewLeases", &denied);
  if (!denied.ok()) return denied;
  for (const std::string& id : request->job_ids()) {
    denied = Authorize(caller, "RenewLeases", id);
    if (!denied.ok()) return denied;
  }
  for (const std::string& id : request->job_ids()) {
    if (!jobs_->Get(id).ok()) response->add_unknown(id);  // Get renews the lease
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ListJobs(grpc::ServerContext* context, const v1::Empty*,
                                           v1::ListJobsResponse* response) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "ListJobs", &denied);
  if (!denied.ok()) return denied;
  // A job's token lists that job alone.
  auto hidden = [&](const std::string& id) {
    return caller.kind == security::Caller::Kind::kJob && id != caller.job_id;
  };
  for (const JobManager::Listed& listed : jobs_->List()) {
    const JobInfo& info = listed.job->info();
    if (hidden(info.id)) continue;
    JobSummary s = listed.job->Summary();
    v1::JobSummary* out = response->add_jobs();
    out->set_job_id(info.id);
    out->set_name(info.name);
    out->set_state(s.state == JobState::kDeployed ? v1::DEPLOYED : v1::UNDEPLOYED);
    out->set_num_params(s.num_params);
    out->set_steps(s.steps);
    out->set_forwards(s.forwards);
    for (const std::string& d : info.devices) out->add_devices(d);

    out->set_loss_scale(s.loss_scale);
    out->set_skipped_steps(static_cast<uint64_t>(s.skipped_steps));
    out->set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 info.created.time_since_epoch()).count());
    out->set_lease_ms(static_cast<uint32_t>(info.lease.count()));
    out->set_idle_ms(static_cast<uint64_t>(std::max<int64_t>(0, listed.idle.count())));
    out->set_checkpoint_dir(listed.job->checkpoint_dir());
    // Summary measured the memory just now and gave the metrics endpoint the same numbers.
    for (int64_t bytes : s.device_bytes) out->add_device_bytes(static_cast<uint64_t>(bytes));
    for (int64_t bytes : s.peak_device_bytes) {
      out->add_peak_device_bytes(static_cast<uint64_t>(bytes));
    }
    const JobMetrics::Snapshot m = listed.job->Measure();
    out->set_step_seconds(m.step_s);
    out->set_busy_seconds(m.busy_s);
    using Call = JobMetrics::Call;
    out->set_forward_busy_seconds(m.busy_by_call_s[static_cast<int>(Call::kForward)]);
    out->set_backward_busy_seconds(m.busy_by_call_s[static_cast<int>(Call::kBackward)]);
    out->set_step_busy_seconds(m.busy_by_call_s[static_cast<int>(Call::kStep)]);
    out->set_other_busy_seconds(m.busy_by_call_s[static_cast<int>(Call::kOther)]);
    out->set_planned_step_seconds(m.planned_step_s);
    out->set_tokens_per_second(m.tokens_per_s);
    out->set_bubble(m.bubble);
    out->set_planned_bubble(m.planned_bubble);
    out->set_tokens(static_cast<uint64_t>(m.tokens));
    out->set_data_plane_bytes(m.data_plane_bytes);
    out->set_checkpoint_blocked_seconds(m.checkpoint_blocked_s);
    out->set_checkpoint_bytes(m.checkpoint_bytes);
  }
  std::set<std::string> live;
  for (const v1::JobSummary& j : response->jobs()) live.insert(j.job_id());
  for (const v1::JobRecord& r : records_->List()) {
    if (live.count(r.job_id()) || hidden(r.job_id())) continue;
    v1::JobSummary* out = response->add_jobs();
    out->set_job_id(r.job_id());
    out->set_name(r.name());
    out->set_state(v1::SUSPENDED);
    out->set_created_unix_ms(r.created_unix_ms());
    // Its steps: those of its latest checkpoint.
    const std::string dir = CheckpointDirOf(r.spec());
    if (!dir.empty()) {
      out->set_checkpoint_dir(dir);
      absl::StatusOr<std::string> job_dir = CheckpointJobDir(dir, r.name());
      if (job_dir.ok()) {
        std::vector<CheckpointInfo> written = ListCheckpointsIn(*job_dir);
        if (!written.empty()) out->set_steps(static_cast<uint64_t>(written.back().step));
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ResumeJob(grpc::ServerContext* context, const v1::JobRef* ref,
                                            v1::CreateJobResponse* response) {
  grpc::Status denied = Authorize(*context, "ResumeJob", ref->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<JobRecords::Loaded> loaded = records_->Load(ref->job_id());
  if (!loaded.ok()) return Fail("ResumeJob", loaded.status());
  const std::string& id = loaded->record.job_id();
  if (jobs_->Get(id).ok()) {
    return Fail("ResumeJob", absl::FailedPreconditionError(absl::StrCat(
        "job ", id, " '", loaded->record.name(), "' runs already")));
  }
  v1::JobSpec spec = loaded->record.spec();
  spec.mutable_options()->set_lease_ms(0);  // no client holds it yet
  spec.mutable_options()->set_client_world(1);
  absl::StatusOr<std::shared_ptr<Job>> job =
      StartResumed(id, *loaded, std::move(spec), /*fenced=*/false, response);
  if (!job.ok()) return Fail("ResumeJob", job.status());
  spdlog::info("resumed the suspended job {} '{}' at step {}", id, loaded->record.name(),
               (*job)->resumed_step());
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::LocateJob(grpc::ServerContext* context,
                                            const v1::LocateJobRequest* request,
                                            v1::RegisteredJob* response) {
  grpc::Status denied = Authorize(*context, "LocateJob", "", request->name());
  if (!denied.ok()) return denied;
  if (registry_ == nullptr) {
    return Fail("LocateJob", absl::FailedPreconditionError(
        "this daemon keeps no job registry (start ranncd with --cluster-store)"));
  }
  absl::StatusOr<v1::RegisteredJob> entry = registry_->Find(request->name());
  if (!entry.ok()) return Fail("LocateJob", entry.status());
  *response = std::move(*entry);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                          v1::ForwardResponse* response) {
  grpc::Status denied = Authorize(*context, "Forward", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "Forward", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("Forward", job.status());
    const int rank = static_cast<int>(request->client_rank());
    absl::Status deferred = RunDeferred(**job, request->before(), rank);
    if (!deferred.ok()) return Fail("Forward", deferred);
    absl::StatusOr<std::vector<at::Tensor>> inputs = DecodeAll(request->inputs(), "input", shm_);
    if (!inputs.ok()) return Fail("Forward", inputs.status());
    absl::StatusOr<std::vector<at::Tensor>> outputs =
        (*job)->Forward(rank, *inputs, request->requires_grad(), request->delay_grad_allreduce());
    if (!outputs.ok()) return Fail("Forward", outputs.status());
    absl::Status encoded = EncodeReply(*outputs, request->reply_shm(), response->mutable_outputs());
    if (!encoded.ok()) return Fail("Forward", encoded);
    return grpc::Status::OK;
  });
}

absl::Status TrainingServiceImpl::DoBackward(Job& job, const v1::BackwardRequest& request,
                                             int client_rank) const {
  OutputGrads grads;
  for (const v1::OutputGrad& g : request.grads()) {
    absl::StatusOr<at::Tensor> t =
        DecodeTensor(g.grad(), absl::StrCat("gradient for output #", g.output_index()), &shm_);
    if (!t.ok()) return t.status();
    grads.emplace_back(g.output_index(), std::move(*t));
  }
  return job.Backward(client_rank, grads, request.retain_graph(),
                      request.delay_grad_allreduce());
}

absl::Status TrainingServiceImpl::DoStep(Job& job, const v1::StepRequest& request,
                                         int client_rank) const {
  JobOp op;
  op.kind = JobOp::Kind::kStep;
  for (const v1::HyperParams& h : request.groups()) {
    op.hypers.push_back(FromProto(h, job.optimizer_kind()));
  }
  return job.Run(client_rank, op).status();
}

absl::Status TrainingServiceImpl::DoZeroGrad(Job& job, const v1::ZeroGradRequest& request,
                                             int client_rank) const {
  JobOp op;
  op.kind = JobOp::Kind::kZeroGrad;
  op.set_to_none = request.set_to_none();
  return job.Run(client_rank, op).status();
}

absl::Status TrainingServiceImpl::RunDeferred(
    Job& job, const google::protobuf::RepeatedPtrField<v1::DeferredOp>& ops,
    int client_rank) const {
  for (const v1::DeferredOp& op : ops) {
    absl::Status status;
    switch (op.op_case()) {
      case v1::DeferredOp::kBackward:
        status = Annotate(DoBackward(job, op.backward(), client_rank), "deferred backward");
        break;
      case v1::DeferredOp::kStep:
        status = Annotate(DoStep(job, op.step(), client_rank), "deferred optimizer step");
        break;
      case v1::DeferredOp::kZeroGrad:
        status = Annotate(DoZeroGrad(job, op.zero_grad(), client_rank), "deferred zero_grad");
        break;
      default:
        status = absl::InvalidArgumentError("a deferred op of unknown kind");
    }
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

grpc::Status TrainingServiceImpl::Backward(grpc::ServerContext* context,
                                           const v1::BackwardRequest* request, v1::Empty* response) {
  grpc::Status denied = Authorize(*context, "Backward", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "Backward", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("Backward", job.status());
    absl::Status status = DoBackward(**job, *request, static_cast<int>(request->client_rank()));
    if (!status.ok()) return Fail("Backward", status);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::Step(grpc::ServerContext* context, const v1::StepRequest* request,
                                       v1::Empty* response) {
  grpc::Status denied = Authorize(*context, "Step", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "Step", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("Step", job.status());
    absl::Status status = DoStep(**job, *request, static_cast<int>(request->client_rank()));
    if (!status.ok()) return Fail("Step", status);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::ZeroGrad(grpc::ServerContext* context,
                                           const v1::ZeroGradRequest* request, v1::Empty* response) {
  grpc::Status denied = Authorize(*context, "ZeroGrad", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "ZeroGrad", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("ZeroGrad", job.status());
    absl::Status status = DoZeroGrad(**job, *request, static_cast<int>(request->client_rank()));
    if (!status.ok()) return Fail("ZeroGrad", status);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::AllReduceGrads(grpc::ServerContext* context,
                                                 const v1::AllReduceGradsRequest* request,
                                                 v1::Empty* response) {
  grpc::Status denied = Authorize(*context, "AllReduceGrads", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "AllReduceGrads", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("AllReduceGrads", job.status());
    JobOp op;
    op.kind = JobOp::Kind::kAllReduceGrads;
    absl::Status status = (*job)->Run(static_cast<int>(request->client_rank()), op).status();
    if (!status.ok()) return Fail("AllReduceGrads", status);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::Flush(grpc::ServerContext* context, const v1::FlushRequest* request,
                                        v1::Empty* response) {
  grpc::Status denied = Authorize(*context, "Flush", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "Flush", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("Flush", job.status());
    absl::Status status =
        RunDeferred(**job, request->ops(), static_cast<int>(request->client_rank()));
    if (!status.ok()) return Fail("Flush", status);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::ClipGradNorm(grpc::ServerContext* context,
                                               const v1::ClipGradNormRequest* request,
                                               v1::ClipGradNormResponse* response) {
  grpc::Status denied = Authorize(*context, "ClipGradNorm", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "ClipGradNorm", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("ClipGradNorm", job.status());
    const double norm_type = request->norm_type() == 0 ? 2.0 : request->norm_type();
    absl::StatusOr<double> norm = (*job)->ClipGradNorm(static_cast<int>(request->client_rank()),
                                                       request->max_norm(), norm_type);
    if (!norm.ok()) return Fail("ClipGradNorm", norm.status());
    response->set_total_norm(*norm);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::GetParam(grpc::ServerContext* context,
                                           const v1::GetParamRequest* request,
                                           v1::GetParamResponse* response) {
  grpc::Status denied = Authorize(*context, "GetParam", request->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("GetParam", job.status());
  if (request->amp_master_param() && !(*job)->info().amp) {
    return Fail("GetParam", absl::FailedPreconditionError(
        "amp_master_param=True: this job has no mixed-precision master parameters (create it "
        "with enable_apex_amp=True)"));
  }
  absl::StatusOr<std::optional<at::Tensor>> tensor =
      (*job)->GetTensor(request->name(), request->grad());
  if (!tensor.ok()) return Fail("GetParam", tensor.status());
  response->set_has_value(tensor->has_value());
  if (tensor->has_value()) {
    google::protobuf::RepeatedPtrField<v1::Tensor> out;
    absl::Status status = EncodeReply({**tensor}, request->reply_shm(), &out);
    if (!status.ok()) return Fail("GetParam", status);
    response->mutable_tensor()->Swap(&out[0]);
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::StateDict(grpc::ServerContext* context,
                                            const v1::StateDictRequest* request,
                                            grpc::ServerWriter<v1::StateDictChunk>* writer) {
  grpc::Status denied = Authorize(*context, "StateDict", request->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("StateDict", job.status());
  if (request->amp_master_params() && !(*job)->info().amp) {
    return Fail("StateDict", absl::FailedPreconditionError(
        "amp_master_params=True: this job has no mixed-precision master parameters (create it "
        "with enable_apex_amp=True)"));
  }
  for (const StateEntry& entry : (*job)->StateDict()) {
    absl::Status written = EncodeStateChunks(
        entry.name, entry.tensor, entry.is_buffer, kStateChunkBytes,
        [writer](const v1::StateDictChunk& chunk) { return writer->Write(chunk); });
    if (written.code() == absl::StatusCode::kCancelled) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away during state_dict");
    }
    if (!written.ok()) return Fail("StateDict", written);
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::LoadStateDict(
    grpc::ServerContext* context, grpc::ServerReader<v1::LoadStateDictRequest>* reader,
    v1::LoadStateDictResponse* response) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "LoadStateDict", &denied);
  if (!denied.ok()) return denied;
  v1::LoadStateDictRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return Fail("LoadStateDict", absl::InvalidArgumentError(
        "LoadStateDict must start with a header message, then the chunks"));
  }
  const v1::LoadStateDictRequest::Header header = request.header();
  denied = Authorize(caller, "LoadStateDict", header.job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(header.job_id());
  if (!job.ok()) return Fail("LoadStateDict", job.status());
  StateDictAssembler assembler;
  absl::Status status = absl::OkStatus();
  while (reader->Read(&request)) {
    if (status.ok()) status = assembler.Add(request.chunk());  // drain the stream either way
  }
  if (!status.ok()) return Fail("LoadStateDict", status);
  absl::StatusOr<std::map<std::string, at::Tensor>> state = assembler.Finish();
  if (!state.ok()) return Fail("LoadStateDict", state.status());
  return Once(context, "LoadStateDict", header.call(), response, [&]() -> grpc::Status {
    std::vector<std::string> missing, unexpected;
    absl::Status loaded = (*job)->LoadStateDict(*state, header.strict(), &missing, &unexpected);
    if (!loaded.ok()) return Fail("LoadStateDict", loaded);
    for (const std::string& k : missing) response->add_missing_keys(k);
    for (const std::string& k : unexpected) response->add_unexpected_keys(k);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::SetMode(grpc::ServerContext* context,
                                          const v1::SetModeRequest* request,
                                          v1::SetModeResponse* response) {
  grpc::Status denied = Authorize(*context, "SetMode", request->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("SetMode", job.status());
  response->set_has_graph((*job)->SetMode(FromProto(request->mode())));
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Undeploy(grpc::ServerContext* context, const v1::JobRef* ref,
                                           v1::Empty*) {
  grpc::Status denied = Authorize(*context, "Undeploy", ref->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("Undeploy", job.status());
  (*job)->Undeploy();
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::RecreateCommunicators(grpc::ServerContext* context,
                                                        const v1::JobRef* ref, v1::Empty*) {
  grpc::Status denied = Authorize(*context, "RecreateCommunicators", ref->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("RecreateCommunicators", job.status());
  JobOp op;
  op.kind = JobOp::Kind::kRecreateCommunicators;
  absl::Status status = (*job)->Run(0, op).status();
  if (!status.ok()) return Fail("RecreateCommunicators", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::OptimizerState(grpc::ServerContext* context,
                                                 const v1::JobRef* ref,
                                                 grpc::ServerWriter<v1::StateDictChunk>* writer) {
  grpc::Status denied = Authorize(*context, "OptimizerState", ref->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("OptimizerState", job.status());
  absl::StatusOr<std::vector<OptimizerEntry>> state = (*job)->OptimizerState();
  if (!state.ok()) return Fail("OptimizerState", state.status());
  absl::Status written = EncodeOptimizerState(
      *state, kStateChunkBytes, [&](const v1::StateDictChunk& c) { return writer->Write(c); });
  if (written.code() == absl::StatusCode::kCancelled || context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "client went away during OptimizerState");
  }
  if (!written.ok()) return Fail("OptimizerState", written);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::LoadOptimizerState(
    grpc::ServerContext* context, grpc::ServerReader<v1::LoadStateDictRequest>* reader,
    v1::LoadStateDictResponse* response) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "LoadOptimizerState", &denied);
  if (!denied.ok()) return denied;
  v1::LoadStateDictRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return Fail("LoadOptimizerState", absl::InvalidArgumentError(
        "LoadOptimizerState must start with a header message, then the chunks"));
  }
  denied = Authorize(caller, "LoadOptimizerState", request.header().job_id());
  if (!denied.ok()) return denied;
  const v1::CallId call = request.header().call();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request.header().job_id());
  if (!job.ok()) return Fail("LoadOptimizerState", job.status());
  OptimizerStateAssembler assembler;
  absl::Status status = absl::OkStatus();
  while (reader->Read(&request)) {
    if (status.ok()) status = assembler.Add(std::move(*request.mutable_chunk()));  // drain
  }
  if (!status.ok()) return Fail("LoadOptimizerState", status);
  absl::StatusOr<std::vector<OptimizerEntry>> state = assembler.Finish();
  if (!state.ok()) return Fail("LoadOptimizerState", state.status());
  return Once(context, "LoadOptimizerState", call, response, [&]() -> grpc::Status {
    absl::Status loaded = (*job)->LoadOptimizerState(*state);
    if (!loaded.ok()) return Fail("LoadOptimizerState", loaded);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::Once(grpc::ServerContext* context, const char* rpc,
                                       const v1::CallId& call,
                                       google::protobuf::Message* response,
                                       const std::function<grpc::Status()>& run) {
  if (call.client_id().empty()) return run();
  CallLedger::Ticket ticket = ledger_.Begin(call.client_id(), call.seq());
  if (ticket.kind == CallLedger::kReplay) {
    spdlog::info("{}: call {} of client {} came again (a retry): answered from the record, not "
                 "run twice", rpc, call.seq(), call.client_id());
    if (response != nullptr) response->ParseFromString(ticket.response);
    // The client retries a lost answer, not this one: an error here is the call's own.
    context->AddTrailingMetadata("rannc-replayed", "1");
    return grpc::Status(static_cast<grpc::StatusCode>(ticket.status.code()),
                        std::string(ticket.status.message()));
  }
  if (ticket.kind == CallLedger::kStale) {
    return Fail(rpc, absl::FailedPreconditionError(absl::StrCat(
        "call ", call.seq(), " of client ", call.client_id(), " is older than its last call (",
        ticket.last, "): a client sends each call after the previous one's answer")));
  }
  grpc::Status status = run();
  ledger_.Finish(call.client_id(), call.seq(),
                 absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                              status.error_message()),
                 response != nullptr ? response->SerializeAsString() : std::string());
  if (DropResponse(rpc)) {
    spdlog::warn("{}: dropping the answer to call {} of client {} (RANNC_TEST_DROP_RESPONSES)",
                 rpc, call.seq(), call.client_id());
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the response was dropped by the test fault hook RANNC_TEST_DROP_RESPONSES");
  }
  return status;
}

bool TrainingServiceImpl::DropResponse(const char* rpc) {
  std::lock_guard<std::mutex> lock(drop_mu_);
  if (drop_.empty()) return false;
  const int n = ++calls_[rpc];
  auto it = drop_.find(rpc);
  return it != drop_.end() && it->second.count(n) > 0;
}

namespace {

void FillCheckpointInfo(const CheckpointInfo& c, v1::CheckpointInfo* out) {
  out->set_step(c.step);
  out->set_path(c.path);
  out->set_committed(c.committed);
  out->set_bytes(c.bytes);
  out->set_created_unix_ms(c.created_unix_ms);
  out->set_blocked_s(c.blocked_s);
  out->set_write_s(c.write_s);
}

}  // namespace

absl::StatusOr<std::string> TrainingServiceImpl::CheckpointsOf(const v1::CheckpointsRef& ref,
                                                               std::shared_ptr<Job>* job) const {
  if (ref.job_id().empty()) return CheckpointJobDir(ref.checkpoint_dir(), ref.job_name());
  absl::StatusOr<std::shared_ptr<Job>> found = jobs_->Get(ref.job_id());
  if (!found.ok()) {
    // A suspended job's: where its record says.
    absl::StatusOr<v1::JobRecord> record = records_->Find(ref.job_id());
    if (!record.ok()) return found.status();
    const std::string dir = CheckpointDirOf(record->spec());
    if (dir.empty()) return found.status();
    return CheckpointJobDir(dir, record->name());
  }
  *job = *found;
  const std::string dir = (*job)->checkpoint_job_dir();
  if (dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", ref.job_id(), " has no checkpoint directory (config key checkpoint_dir)"));
  }
  return dir;
}

grpc::Status TrainingServiceImpl::Checkpoint(grpc::ServerContext* context,
                                             const v1::CheckpointRequest* request,
                                             v1::CheckpointInfo* response) {
  grpc::Status denied = Authorize(*context, "Checkpoint", request->job_id());
  if (!denied.ok()) return denied;
  return Once(context, "Checkpoint", request->call(), response, [&]() -> grpc::Status {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
    if (!job.ok()) return Fail("Checkpoint", job.status());
    absl::StatusOr<CheckpointInfo> info = (*job)->Checkpoint(request->wait());
    if (!info.ok()) return Fail("Checkpoint", info.status());
    FillCheckpointInfo(*info, response);
    return grpc::Status::OK;
  });
}

grpc::Status TrainingServiceImpl::ListCheckpoints(grpc::ServerContext* context,
                                                  const v1::CheckpointsRef* request,
                                                  v1::ListCheckpointsResponse* response) {
  grpc::Status denied =
      Authorize(*context, "ListCheckpoints", request->job_id(), request->job_name());
  if (!denied.ok()) return denied;
  std::shared_ptr<Job> job;
  absl::StatusOr<std::string> dir = CheckpointsOf(*request, &job);
  if (!dir.ok()) return Fail("ListCheckpoints", dir.status());
  for (const CheckpointInfo& c : job ? job->Checkpoints() : ListCheckpointsIn(*dir)) {
    FillCheckpointInfo(c, response->add_checkpoints());
  }
  if (job) response->set_error(job->checkpoint_error());
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ExportCheckpoint(grpc::ServerContext* context,
                                                   const v1::CheckpointsRef* request,
                                                   grpc::ServerWriter<v1::ExportChunk>* writer) {
  grpc::Status denied =
      Authorize(*context, "ExportCheckpoint", request->job_id(), request->job_name());
  if (!denied.ok()) return denied;
  std::shared_ptr<Job> job;
  absl::StatusOr<std::string> dir = CheckpointsOf(*request, &job);
  if (!dir.ok()) return Fail("ExportCheckpoint", dir.status());
  int64_t step = 0;
  absl::StatusOr<std::vector<char>> bytes = ExportCheckpointIn(*dir, request->step(), &step);
  if (!bytes.ok()) return Fail("ExportCheckpoint", bytes.status());
  for (size_t offset = 0; offset < bytes->size(); offset += kStateChunkBytes) {
    v1::ExportChunk out;
    out.set_total_bytes(bytes->size());
    out.set_step(step);
    out.set_data(bytes->data() + offset, std::min(kStateChunkBytes, bytes->size() - offset));
    if (!writer->Write(out) || context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away during the export");
    }
  }
  return grpc::Status::OK;
}

std::vector<uint64_t> TrainingServiceImpl::FreeBytes() const {
  std::vector<uint64_t> free;
  for (const DaemonFacts::Device& d : facts_.devices) free.push_back(d.memory_bytes);
  for (const JobManager::Listed& listed : jobs_->List()) {
    const std::vector<uint64_t> held = PlannedBytes(listed.job->info().plan, free.size());
    for (size_t d = 0; d < free.size(); ++d) free[d] -= std::min(free[d], held[d]);
  }
  return free;
}

std::string TrainingServiceImpl::ShortOf(const std::vector<uint64_t>& need) const {
  return FirstShortfall(need, FreeBytes(), facts_.devices);
}

absl::Status TrainingServiceImpl::Admit(const std::string& model,
                                        const std::vector<at::Tensor>& examples,
                                        const SentTensors& sent, JobSettings* settings) {
  // A job over a cluster's daemons is planned over them all, later (StartJob).
  if (!OtherMembers().empty()) return absl::OkStatus();
  // Alone on the devices, a job is planned for all of their memory: nothing to wait for.
  if (jobs_->List().empty() || !settings->load_deployment.empty()) return absl::OkStatus();
  absl::StatusOr<v1::Deployment> plan = PlanJob(*settings, model, examples, sent);
  if (!plan.ok()) return plan.status();
  const std::vector<uint64_t> need = PlannedBytes(*plan, facts_.devices.size());
  const auto start = std::chrono::steady_clock::now();
  std::string short_of = ShortOf(need);
  if (!short_of.empty()) {
    spdlog::info("job '{}' waits up to {:.1f} s for memory: {}", settings->name,
                 settings->admission_wait.count() / 1e3, short_of);
  }
  while (!short_of.empty()) {
    if (std::chrono::steady_clock::now() - start >= settings->admission_wait) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the job does not fit beside the daemon's other jobs: ", short_of, "; waited ",
          absl::StrFormat("%.1f", SecondsSince(start)), " s for them to end (config key "
          "admission_wait)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    short_of = ShortOf(need);
  }
  settings->load_deployment = plan->SerializeAsString();
  return absl::OkStatus();
}

grpc::Status TrainingServiceImpl::SubmitJob(grpc::ServerContext* context,
                                            const v1::DetachedJobSpec* spec,
                                            v1::SubmitJobResponse* response) {
  grpc::Status denied = Authorize(*context, "SubmitJob");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::string> id = detached_->Submit(*spec);
  if (!id.ok()) {
    ReleaseUploads(*uploads_, *spec);  // uploaded for this submission only
    return Fail("SubmitJob", id.status());
  }
  response->set_job_id(*id);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::UploadFile(grpc::ServerContext* context,
                                             grpc::ServerReader<v1::UploadChunk>* reader,
                                             v1::UploadedFile* response) {
  grpc::Status denied = Authorize(*context, "UploadFile");
  if (!denied.ok()) return denied;
  v1::UploadChunk chunk;
  if (!reader->Read(&chunk) || chunk.name().empty()) {
    return Fail("UploadFile", absl::InvalidArgumentError(
                                  "UploadFile's first chunk names the file (UploadChunk.name)"));
  }
  absl::StatusOr<std::unique_ptr<Uploads::Writer>> writer = uploads_->Begin(chunk.name());
  if (!writer.ok()) return Fail("UploadFile", writer.status());
  const uint64_t size = chunk.size();
  uint64_t bytes = 0;
  do {
    absl::Status wrote = (*writer)->Write(chunk.data().data(), chunk.data().size());
    if (!wrote.ok()) return Fail("UploadFile", wrote);
    bytes += chunk.data().size();
  } while (reader->Read(&chunk));
  absl::StatusOr<std::string> path = (*writer)->Commit(size);
  if (!path.ok()) return Fail("UploadFile", path.status());
  spdlog::info("received the upload {} ({} bytes)", *path, bytes);
  response->set_path(*path);
  response->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::DetachedJobStatus(grpc::ServerContext* context,
                                                    const v1::JobRef* ref,
                                                    v1::DetachedStatus* response) {
  grpc::Status denied = Authorize(*context, "DetachedJobStatus", ref->job_id());
  if (!denied.ok()) return denied;
  absl::StatusOr<v1::DetachedStatus> status = detached_->Status(ref->job_id());
  if (!status.ok()) return Fail("DetachedJobStatus", status.status());
  *response = std::move(*status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ListDetachedJobs(grpc::ServerContext* context, const v1::Empty*,
                                                   v1::ListDetachedJobsResponse* response) {
  grpc::Status denied;
  const security::Caller caller = Authenticate(*context, "ListDetachedJobs", &denied);
  if (!denied.ok()) return denied;
  for (v1::DetachedStatus& status : detached_->List()) {
    // A job's token lists that job alone.
    if (caller.kind == security::Caller::Kind::kJob && status.job_id() != caller.job_id) continue;
    *response->add_jobs() = std::move(status);
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::DetachedJobLogs(grpc::ServerContext* context,
                                                  const v1::DetachedLogsRequest* request,
                                                  grpc::ServerWriter<v1::DetachedLogLine>* writer) {
  grpc::Status denied = Authorize(*context, "DetachedJobLogs", request->job_id());
  if (!denied.ok()) return denied;
  int64_t after = request->after_seq();
  while (!context->IsCancelled()) {
    std::vector<v1::DetachedLogLine> lines;
    bool ended = false;
    absl::Status read =
        detached_->Lines(request->job_id(), after,
                         request->follow() ? std::chrono::milliseconds(500)
                                           : std::chrono::milliseconds(0),
                         &lines, &ended);
    if (!read.ok()) return Fail("DetachedJobLogs", read);
    for (const v1::DetachedLogLine& line : lines) {
      if (!writer->Write(line)) return grpc::Status::OK;  // the client went away
      after = line.seq();
    }
    if (!request->follow() || ended) break;
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::CancelJob(grpc::ServerContext* context, const v1::JobRef* ref,
                                            v1::Empty*) {
  grpc::Status denied = Authorize(*context, "CancelJob", ref->job_id());
  if (!denied.ok()) return denied;
  absl::Status cancelled = detached_->Cancel(ref->job_id());
  if (!cancelled.ok()) return Fail("CancelJob", cancelled);
  spdlog::info("cancelling detached job {}", ref->job_id());
  return grpc::Status::OK;
}

}  // namespace rannc
