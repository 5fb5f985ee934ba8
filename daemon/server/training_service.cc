#include "daemon/server/training_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "daemon/cluster/cluster.h"
#include "daemon/cluster/cluster_service.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/config/keys.h"
#include "daemon/planner/deployment.h"
#include "daemon/planner/links.h"
#include "daemon/planner/planner.h"

namespace rannc {
namespace {

// State_dict streams cut tensors into pieces this large, well under any message limit.
constexpr size_t kStateChunkBytes = 4 << 20;

grpc::Status Fail(const char* rpc, const absl::Status& status) {
  spdlog::warn("{} failed: {}", rpc, status.ToString());
  return ToGrpcStatus(status);
}

ModelMode FromProto(const v1::Mode& mode) { return ModelMode{mode.training(), mode.dropout()}; }

HyperParams FromProto(const v1::HyperParams& h) {
  HyperParams out;
  out.lr = h.lr();
  out.weight_decay = h.weight_decay();
  out.momentum = h.momentum();
  out.dampening = h.dampening();
  out.nesterov = h.nesterov();
  out.beta1 = h.beta1();
  out.beta2 = h.beta2();
  out.eps = h.eps();
  out.amsgrad = h.amsgrad();
  out.maximize = h.maximize();
  return out;
}

absl::StatusOr<OptimizerConfig> FromProto(const v1::OptimizerSpec& spec) {
  OptimizerConfig config;
  switch (spec.type()) {
    case v1::OPTIMIZER_NONE: return config;
    case v1::SGD: config.kind = OptimizerKind::kSgd; break;
    case v1::ADAM: config.kind = OptimizerKind::kAdam; break;
    case v1::ADAMW: config.kind = OptimizerKind::kAdamW; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown optimizer type ", static_cast<int>(spec.type())));
  }
  config.enabled = true;
  if (spec.groups().empty()) {
    config.group_hyper.push_back(HyperParams());
    return config;
  }
  for (const v1::ParamGroup& g : spec.groups()) {
    config.group_params.emplace_back(g.params().begin(), g.params().end());
    config.group_hyper.push_back(FromProto(g.hyper()));
  }
  return config;
}

void FillParamInfo(const ParamStore::Entry& e, v1::ParamInfo* info) {
  info->set_name(e.name);
  EncodeSpec(e.tensor, info->mutable_spec());
  for (const std::string& a : e.aliases) info->add_aliases(a);
  info->set_requires_grad(e.tensor.requires_grad());
}

// Reassembles a tensor from StateDictChunks, checking each against the first.
class ChunkAssembler {
 public:
  absl::Status Add(const v1::StateDictChunk& chunk) {
    if (chunk.offset() == 0) {
      const std::string what = absl::StrCat("state_dict '", chunk.name(), "'");
      absl::StatusOr<at::ScalarType> type = FromProtoDType(chunk.dtype());
      if (!type.ok()) return Annotate(type.status(), what);
      if (state_.count(chunk.name())) {
        return absl::InvalidArgumentError(
            absl::StrCat("state_dict key '", chunk.name(), "' sent twice"));
      }
      std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
      absl::StatusOr<size_t> expected = DenseBytes(*type, shape, what);
      if (!expected.ok()) return expected.status();
      if (chunk.total_bytes() != *expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": ", chunk.total_bytes(), " bytes for ", DescribeTensor(*type, shape),
            ", which needs ", *expected));
      }
      absl::Status allocated = TorchCall(absl::StatusCode::kResourceExhausted, what, [&] {
        current_ = at::empty(shape, at::TensorOptions().dtype(*type));
        return absl::OkStatus();
      });
      if (!allocated.ok()) return allocated;
      name_ = chunk.name();
      filled_ = 0;
      state_[name_] = current_;
    } else if (chunk.name() != name_ || chunk.offset() != filled_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state_dict chunk for '", chunk.name(), "' at offset ", chunk.offset(),
          " does not continue '", name_, "' at ", filled_));
    }
    const uint64_t total = current_.numel() * current_.element_size();
    if (filled_ + chunk.data().size() > total) {
      return absl::InvalidArgumentError(
          absl::StrCat("state_dict '", chunk.name(), "': more data than its shape holds"));
    }
    std::memcpy(static_cast<char*>(current_.data_ptr()) + filled_, chunk.data().data(),
                chunk.data().size());
    filled_ += chunk.data().size();
    if (filled_ == total) done_.insert(name_);
    return absl::OkStatus();
  }

  absl::StatusOr<std::map<std::string, at::Tensor>> Finish() {
    for (const auto& [name, t] : state_) {
      if (!done_.count(name)) {
        return absl::InvalidArgumentError(absl::StrCat("state_dict '", name, "' is incomplete"));
      }
    }
    return std::move(state_);
  }

 private:
  std::map<std::string, at::Tensor> state_;
  std::set<std::string> done_;
  at::Tensor current_;
  std::string name_;
  uint64_t filled_ = 0;
};

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

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

TrainingServiceImpl::TrainingServiceImpl(DaemonFacts facts, JobManager* jobs)
    : facts_(std::move(facts)),
      shm_(facts_.shm_dir),
      jobs_(jobs),
      reaper_([this] { ReapExpiredJobs(); }) {}

TrainingServiceImpl::~TrainingServiceImpl() {
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    stopping_ = true;
  }
  reaper_cv_.notify_all();
  reaper_.join();
}

void TrainingServiceImpl::ReapExpiredJobs() {
  std::unique_lock<std::mutex> lock(reaper_mu_);
  while (!reaper_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_; })) {
    lock.unlock();
    for (const JobManager::Expired& e : jobs_->RemoveExpired(std::chrono::steady_clock::now())) {
      {
        std::lock_guard<std::mutex> joinable(joinable_mu_);
        joinable_.erase(e.id);
      }
      spdlog::warn("deleted job {} '{}': no call from its client for its lease of {} ms (the "
                   "client exited or hung without deleting it)",
                   e.id, e.name, e.lease.count());
    }
    lock.lock();
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

comm::Backend JobBackend(bool cuda, const std::vector<DaemonFacts::Device>& devices) {
  const bool shared = std::any_of(devices.begin(), devices.end(),
                                  [](const DaemonFacts::Device& d) { return d.shared; });
  return cuda && !shared && comm::BackendBuiltIn(comm::Backend::kNccl) ? comm::Backend::kNccl
                                                                       : comm::Backend::kUcx;
}

comm::Backend JobBackend(const std::vector<c10::Device>& placement,
                         const std::vector<DaemonFacts::Device>& devices) {
  const bool cuda = std::any_of(placement.begin(), placement.end(),
                                [](const c10::Device& d) { return d.is_cuda(); });
  return JobBackend(cuda, devices);
}

absl::StatusOr<JobConfig> JobConfigFromSpec(const v1::JobSpec& spec, const DaemonFacts& facts) {
  for (const auto& [key, value] : spec.options().config()) {
    absl::Status known = CheckJobKey(key);
    if (!known.ok()) return known;
  }
  JobConfig config;
  config.name = spec.name();
  config.mode = FromProto(spec.mode());
  absl::StatusOr<OptimizerConfig> optimizer = FromProto(spec.optimizer());
  if (!optimizer.ok()) return optimizer.status();
  config.optimizer = std::move(*optimizer);
  config.check_unused_values = spec.options().check_unused_values();
  config.zero = spec.options().enable_zero();
  config.offload = spec.options().offload_params();
  if (spec.options().enable_apex_amp()) {
    auto key = spec.options().config().find("amp_dtype");
    absl::StatusOr<c10::ScalarType> amp =
        ParseAmpDtype(key == spec.options().config().end() ? "bf16" : key->second);
    if (!amp.ok()) return amp.status();
    const bool cpu = facts.devices.empty() || facts.devices[0].type == "cpu";
    if (*amp == c10::ScalarType::Half && cpu) {
      return absl::InvalidArgumentError(
          "amp_dtype=fp16 needs CUDA devices; CPU devices run mixed precision in bf16 "
          "(amp_dtype=bf16)");
    }
    config.amp = *amp;
    auto level = spec.options().config().find("amp_level");
    const std::string amp_level =
        level == spec.options().config().end() ? "O1" : absl::AsciiStrToUpper(level->second);
    if (amp_level != "O1" && amp_level != "O2") {
      return absl::InvalidArgumentError(absl::StrCat(
          "amp_level=", level->second, ": expected O1 (autocast, the default) or O2 (the whole "
          "forward in amp_dtype, fp32 master parameters)"));
    }
    config.amp_o2 = amp_level == "O2";
  }
  const std::map<std::string, std::string> keys(spec.options().config().begin(),
                                                spec.options().config().end());
  absl::StatusOr<LossScaleOptions> loss_scale = ParseLossScale(keys, config.amp);
  if (!loss_scale.ok()) return loss_scale.status();
  config.loss_scale = *loss_scale;
  config.input_names.assign(spec.input_names().begin(), spec.input_names().end());
  for (const auto& device : facts.devices) config.device_names.push_back(device.name);
  config.placement = Placement(facts.devices, static_cast<int>(facts.devices.size()), {});
  // Blocks are profiled on the kind of device they will run on: this daemon's first.
  if (!config.placement.empty()) config.plan_target.profile_device = config.placement[0];
  if (!facts.devices.empty()) {
    config.plan_target.device_type = facts.devices[0].type;
    config.plan_target.device_memory_bytes = facts.devices[0].memory_bytes;
  }
  config.plan_target.num_devices = static_cast<int>(facts.devices.size());
  config.plan_target.links = facts.links;
  config.profile_cache = facts.profile_cache;
  config.created_by = absl::StrCat("ranncd ", facts.version, " (LibTorch ", facts.torch_version,
                                   ")");
  config.load_deployment = spec.options().load_deployment();
  config.client_world = std::max<int>(1, static_cast<int>(spec.options().client_world()));
  config.gather_inputs = spec.options().gather_inputs();
  if (spec.options().client_timeout_ms() > 0) {
    config.client_timeout = std::chrono::milliseconds(spec.options().client_timeout_ms());
  }
  config.lease = std::chrono::milliseconds(spec.options().lease_ms());
  if (config.lease.count() > 0 && config.lease < std::chrono::seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_ms=", spec.options().lease_ms(), ": a job's lease is 0 (none) or at least 1000 ms "
        "(the daemon looks for expired leases once a second); pyrannc: RANNC_JOB_LEASE seconds"));
  }
  absl::StatusOr<planner::PlannerConfig> planner = planner::PlannerConfigFromKeys(keys);
  if (!planner.ok()) return planner.status();
  config.planner = *planner;
  config.plan_target.batch_size = config.planner.batch_size;  // a dry run's may override it
  return config;
}

grpc::Status TrainingServiceImpl::GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                                          v1::DaemonInfo* info) {
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

grpc::Status TrainingServiceImpl::CreateJob(grpc::ServerContext*,
                                            grpc::ServerReader<v1::CreateJobRequest>* reader,
                                            v1::CreateJobResponse* response) {
  v1::CreateJobRequest request;
  if (!reader->Read(&request) || !request.has_spec()) {
    return Fail("CreateJob", absl::InvalidArgumentError(
        "CreateJob must start with a JobSpec message, then the model's bytes"));
  }
  const auto received = std::chrono::steady_clock::now();
  const v1::JobSpec spec = request.spec();
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
  absl::StatusOr<JobConfig> made = JobConfigFromSpec(spec, facts_);
  if (!made.ok()) return Fail("CreateJob", made.status());
  absl::StatusOr<std::vector<at::Tensor>> examples =
      DecodeAll(spec.example_inputs(), "example input", shm_);
  if (!examples.ok()) return Fail("CreateJob", examples.status());
  const auto decoding = std::chrono::steady_clock::now();
  absl::StatusOr<SentTensors> decoded = DecodeModelTensors(spec.model_tensors(), shm_);
  if (!decoded.ok()) return Fail("CreateJob", decoded.status());
  const SentTensors sent = std::move(*decoded);
  const double tensors_s = SecondsSince(decoding);

  JobConfig config = std::move(*made);

  if (spec.dry_run().num_devices() > 0) {
    const v1::PlanTarget& dry = spec.dry_run();
    config.plan_target.num_devices = static_cast<int>(dry.num_devices());
    if (dry.device_memory_bytes() != 0) {
      config.plan_target.device_memory_bytes = dry.device_memory_bytes();
    }
    if (dry.batch_size() > 0) config.plan_target.batch_size = dry.batch_size();
    if (!dry.links().empty()) {
      absl::StatusOr<planner::Links> links = planner::LinksFromString(dry.links());
      if (!links.ok()) return Fail("CreateJob", Annotate(links.status(), "dry_run.links"));
      config.plan_target.links = *links;
    }
    absl::StatusOr<v1::Deployment> plan = Job::PlanOnly(config, model, *examples, sent);
    if (!plan.ok()) return Fail("CreateJob", plan.status());
    response->set_plan_summary(planner::DescribeDeployment(*plan));
    *response->mutable_deployment() = std::move(*plan);
    spdlog::info("planned '{}' for {} devices (dry run, {:.2f} s)", spec.name(),
                 dry.num_devices(), response->deployment().planning_seconds());
    return grpc::Status::OK;
  }

  const std::string id = jobs_->NewJobId();
  if (spec.options().has_part()) {
    // This daemon's part of a job another daemon leads over the cluster.
    const v1::JobPart& part = spec.options().part();
    config.is_part = true;
    config.plan_target.num_devices = static_cast<int>(part.num_devices());
    config.local_devices.assign(part.local_devices().begin(), part.local_devices().end());
    config.engine_store_address = part.store_address();
    config.engine_group = part.group();
    config.device_names.clear();
    config.placement =
        Placement(facts_.devices, config.plan_target.num_devices, config.local_devices);
  } else {
    absl::Status spanned = SpanCluster(id, spec, &config);
    if (!spanned.ok()) return Fail("CreateJob", spanned);
  }
  config.backend = JobBackend(config.placement, facts_.devices);
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create(id, std::move(config), model, *examples, sent);
  if (!job.ok()) return Fail("CreateJob", job.status());

  response->set_job_id(id);
  *response->mutable_deployment() = (*job)->deployment();
  response->set_plan_summary(planner::DescribeDeployment((*job)->deployment()));
  for (const ParamStore::Entry& e : (*job)->params().entries()) {
    FillParamInfo(e, e.is_parameter ? response->add_params() : response->add_buffers());
  }
  for (const OutputSpec& out : (*job)->output_specs()) {
    EncodeSpec(out.dtype, out.shape, response->add_outputs());
  }
  for (const std::string& d : (*job)->devices()) response->add_devices(d);
  const CreateTimings& t = (*job)->create_timings();
  spdlog::info("created job {} '{}' ({} parameters, {} bytes of TorchScript); {}; seconds: "
               "receive {:.2f}, tensors apart {:.2f} ({} of them), import {:.2f}, IR {:.2f}, "
               "plan {:.2f}, place {:.2f}",
               id, spec.name(), (*job)->params().NumParameterElements(), model.size(),
               response->plan_summary(), receive_s, tensors_s, sent.size(), t.import_s, t.ir_s,
               t.plan_s, t.place_s);
  if ((*job)->client_world() > 1) {
    std::lock_guard<std::mutex> lock(joinable_mu_);
    joinable_[id] = *response;
  }
  jobs_->Add(std::move(*job));
  return grpc::Status::OK;
}

absl::Status TrainingServiceImpl::SpanCluster(const std::string& job_id, const v1::JobSpec& spec,
                                              JobConfig* config) const {
  std::vector<cluster::MemberInfo> members;
  {
    std::lock_guard<std::mutex> lock(address_mu_);
    if (cluster_ == nullptr || store_ == nullptr) return absl::OkStatus();
    members = cluster_->Members();
  }
  // A job runs on every member that is UP. One not heard from yet (the cluster is starting) is
  // waited for; one that is DOWN is left out, so a lost daemon does not stop new jobs.
  std::vector<std::string> left_out;
  for (const cluster::MemberInfo& m : members) {
    if (m.state == cluster::MemberState::kUnknown) {
      return absl::UnavailableError(absl::StrCat(
          "cluster member ", m.address, " has not been heard from yet; a job runs on every "
          "daemon of the cluster, so wait until all are up (rannc info)"));
    }
    if (m.state == cluster::MemberState::kDown) left_out.push_back(m.address);
  }
  members.erase(std::remove_if(members.begin(), members.end(),
                               [](const cluster::MemberInfo& m) {
                                 return m.state != cluster::MemberState::kUp;
                               }),
                members.end());
  if (!left_out.empty()) {
    spdlog::warn("job {} leaves out cluster member(s) {}, which are DOWN", job_id,
                 absl::StrJoin(left_out, ", "));
  }
  if (members.size() < 2) return absl::OkStatus();
  std::sort(members.begin(), members.end(),
            [](const cluster::MemberInfo& a, const cluster::MemberInfo& b) {
              return a.rank < b.rank;
            });
  // The cluster's devices, numbered by member rank, then each member's own order.
  config->device_names.clear();
  config->local_devices.clear();
  config->members.clear();
  for (const cluster::MemberInfo& m : members) {
    JobConfig::Member member{m.address, {}};
    for (const cluster::DeviceSummary& d : m.devices) {
      const int index = static_cast<int>(config->device_names.size());
      config->device_names.push_back(absl::StrCat(m.address, "/", d.name));
      (m.self ? config->local_devices : member.devices).push_back(index);
    }
    if (m.self) {
      config->self_address = m.address;
    } else {
      config->members.push_back(std::move(member));
    }
  }
  config->plan_target.num_devices = static_cast<int>(config->device_names.size());
  config->placement =
      Placement(facts_.devices, config->plan_target.num_devices, config->local_devices);
  config->engine_store = store_;
  config->engine_group = job_id;
  config->spec = spec;
  return absl::OkStatus();
}

std::vector<c10::Device> Placement(const std::vector<DaemonFacts::Device>& devices,
                                   int num_devices, const std::vector<int>& local) {
  std::vector<c10::Device> placement(std::max(num_devices, 0), c10::Device(c10::kCPU));
  for (size_t k = 0; k < devices.size(); ++k) {
    const int index = local.empty() ? static_cast<int>(k) : k < local.size() ? local[k] : -1;
    const DaemonFacts::Device& device = devices[k];
    if (index < 0 || index >= num_devices || device.cuda_index < 0) continue;
    placement[index] = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.cuda_index));
  }
  return placement;
}

std::vector<std::string> TrainingServiceImpl::OtherMembers() const {
  std::lock_guard<std::mutex> lock(address_mu_);
  std::vector<std::string> out;
  if (cluster_ == nullptr) return out;
  for (const cluster::MemberInfo& m : cluster_->Members()) {
    if (!m.self && m.state == cluster::MemberState::kUp) out.push_back(m.address);
  }
  return out;
}

std::string TrainingServiceImpl::Coordinator() const {
  std::lock_guard<std::mutex> lock(address_mu_);
  if (cluster_ == nullptr) return "";
  const std::vector<cluster::MemberInfo> members = cluster_->Members();
  if (members.size() < 2) return "";
  for (const cluster::MemberInfo& m : members) {
    if (m.rank == 0) return m.self ? "" : m.address;
  }
  return "";
}

v1::TrainingService::Stub* TrainingServiceImpl::PeerStub(const std::string& address) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  std::unique_ptr<v1::TrainingService::Stub>& stub = peers_[address];
  if (!stub) {
    stub = v1::TrainingService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return stub.get();
}

grpc::Status TrainingServiceImpl::JoinJob(grpc::ServerContext* context,
                                          const v1::JoinJobRequest* request,
                                          v1::CreateJobResponse* response) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(request->timeout_ms());
  // Rank 0 may still be creating the job (planning takes a while), and on another daemon of the
  // cluster: wait for it, asking the others too.
  for (;;) {
    for (const std::shared_ptr<Job>& job : jobs_->List()) {
      if (job->name() != request->name() ||
          job->client_world() != static_cast<int>(request->client_world())) {
        continue;
      }
      std::lock_guard<std::mutex> lock(joinable_mu_);
      auto it = joinable_.find(job->id());
      if (it == joinable_.end()) continue;
      *response = it->second;
      return grpc::Status::OK;
    }
    if (request->local_only()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such job here");
    }
    for (const std::string& peer : OtherMembers()) {
      v1::JoinJobRequest ask = *request;
      ask.set_local_only(true);
      v1::CreateJobResponse found;
      grpc::ClientContext peer_context;
      peer_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      if (PeerStub(peer)->JoinJob(&peer_context, ask, &found).ok()) {
        response->Clear();
        response->set_leader(peer);  // the client joins there
        return grpc::Status::OK;
      }
    }
    if (context->IsCancelled() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Fail("JoinJob", absl::DeadlineExceededError(absl::StrCat(
      "no job named '", request->name(), "' for ", request->client_world(),
      " client ranks was created within ", request->timeout_ms(), " ms; client rank 0 creates "
      "it (same RANNC_JOB and client count on every rank)")));
}

grpc::Status TrainingServiceImpl::ClientBarrier(grpc::ServerContext* context,
                                                const v1::ClientBarrierRequest* request,
                                                v1::Empty*) {
  const int world = static_cast<int>(request->client_world());
  if (world <= 1) return grpc::Status::OK;
  // Over a cluster, client ranks may talk to different daemons: they meet at the coordinator.
  if (const std::string coordinator = Coordinator(); !coordinator.empty()) {
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
  if (!met.ok()) return Fail("ClientBarrier", met);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::AddMode(grpc::ServerContext*,
                                          grpc::ServerReader<v1::AddModeRequest>* reader,
                                          v1::AddModeResponse*) {
  v1::AddModeRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return Fail("AddMode", absl::InvalidArgumentError(
        "AddMode must start with a header message, then the model's bytes"));
  }
  const v1::AddModeRequest::Header header = request.header();
  std::string model;
  while (reader->Read(&request)) model += request.model_chunk();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(header.job_id());
  if (!job.ok()) return Fail("AddMode", job.status());
  absl::Status status = (*job)->AddMode(FromProto(header.mode()), model);
  if (!status.ok()) return Fail("AddMode", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::DeleteJob(grpc::ServerContext*, const v1::JobRef* ref,
                                            v1::Empty*) {
  {
    std::lock_guard<std::mutex> lock(joinable_mu_);
    joinable_.erase(ref->job_id());
  }
  absl::Status status = jobs_->Remove(ref->job_id());
  if (!status.ok()) return Fail("DeleteJob", status);
  spdlog::info("deleted job {}", ref->job_id());
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::RenewLeases(grpc::ServerContext*,
                                              const v1::RenewLeasesRequest* request,
                                              v1::RenewLeasesResponse* response) {
  for (const std::string& id : request->job_ids()) {
    if (!jobs_->Get(id).ok()) response->add_unknown(id);  // Get renews the lease
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ListJobs(grpc::ServerContext*, const v1::Empty*,
                                           v1::ListJobsResponse* response) {
  const auto now = std::chrono::steady_clock::now();
  for (const std::shared_ptr<Job>& job : jobs_->List()) {
    JobSummary s = job->Summary();
    v1::JobSummary* out = response->add_jobs();
    out->set_job_id(s.id);
    out->set_name(s.name);
    out->set_state(s.state == JobState::kDeployed ? v1::DEPLOYED : v1::UNDEPLOYED);
    out->set_num_params(s.num_params);
    out->set_steps(s.steps);
    out->set_forwards(s.forwards);
    for (const std::string& d : s.devices) out->add_devices(d);
    for (int64_t bytes : s.device_bytes) out->add_device_bytes(static_cast<uint64_t>(bytes));
    for (int64_t bytes : s.peak_device_bytes) {
      out->add_peak_device_bytes(static_cast<uint64_t>(bytes));
    }
    out->set_loss_scale(s.loss_scale);
    out->set_skipped_steps(static_cast<uint64_t>(s.skipped_steps));
    out->set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 s.created.time_since_epoch()).count());
    out->set_lease_ms(static_cast<uint32_t>(job->lease().count()));
    out->set_idle_ms(static_cast<uint64_t>(std::max<int64_t>(0, job->IdleFor(now).count())));
  }
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Forward(grpc::ServerContext*, const v1::ForwardRequest* request,
                                          v1::ForwardResponse* response) {
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
}

absl::Status TrainingServiceImpl::DoBackward(Job& job, const v1::BackwardRequest& request,
                                             int client_rank) const {
  std::vector<std::pair<size_t, at::Tensor>> grads;
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
  std::vector<HyperParams> hypers;
  for (const v1::HyperParams& h : request.groups()) hypers.push_back(FromProto(h));
  return job.Step(client_rank, hypers);
}

absl::Status TrainingServiceImpl::DoZeroGrad(Job& job, const v1::ZeroGradRequest& request,
                                             int client_rank) const {
  return job.ZeroGrad(client_rank, request.set_to_none());
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

grpc::Status TrainingServiceImpl::Backward(grpc::ServerContext*,
                                           const v1::BackwardRequest* request, v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("Backward", job.status());
  absl::Status status = DoBackward(**job, *request, static_cast<int>(request->client_rank()));
  if (!status.ok()) return Fail("Backward", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Step(grpc::ServerContext*, const v1::StepRequest* request,
                                       v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("Step", job.status());
  absl::Status status = DoStep(**job, *request, static_cast<int>(request->client_rank()));
  if (!status.ok()) return Fail("Step", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ZeroGrad(grpc::ServerContext*,
                                           const v1::ZeroGradRequest* request, v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("ZeroGrad", job.status());
  absl::Status status = DoZeroGrad(**job, *request, static_cast<int>(request->client_rank()));
  if (!status.ok()) return Fail("ZeroGrad", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::AllReduceGrads(grpc::ServerContext*,
                                                 const v1::AllReduceGradsRequest* request,
                                                 v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("AllReduceGrads", job.status());
  absl::Status status = (*job)->AllReduceGrads(static_cast<int>(request->client_rank()));
  if (!status.ok()) return Fail("AllReduceGrads", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Flush(grpc::ServerContext*, const v1::FlushRequest* request,
                                        v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("Flush", job.status());
  absl::Status status =
      RunDeferred(**job, request->ops(), static_cast<int>(request->client_rank()));
  if (!status.ok()) return Fail("Flush", status);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ClipGradNorm(grpc::ServerContext*,
                                               const v1::ClipGradNormRequest* request,
                                               v1::ClipGradNormResponse* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("ClipGradNorm", job.status());
  const double norm_type = request->norm_type() == 0 ? 2.0 : request->norm_type();
  switch (request->part().phase()) {
    case v1::ClipGradNormPart::NORMS: {
      absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> norms =
          (*job)->GradNorms(norm_type);
      if (!norms.ok()) return Fail("ClipGradNorm", norms.status());
      for (const auto& [name, norm] : *norms) {
        response->add_norm_names(name);
        absl::Status encoded = EncodeTensor(norm, response->add_norms(), nullptr);
        if (!encoded.ok()) return Fail("ClipGradNorm", encoded);
      }
      return grpc::Status::OK;
    }
    case v1::ClipGradNormPart::SCALE: {
      absl::StatusOr<at::Tensor> coefficient =
          DecodeTensor(request->part().coefficient(), "clip coefficient", nullptr);
      if (!coefficient.ok()) return Fail("ClipGradNorm", coefficient.status());
      absl::Status scaled = (*job)->ScaleGrads(*coefficient);
      if (!scaled.ok()) return Fail("ClipGradNorm", scaled);
      return grpc::Status::OK;
    }
    default:
      break;
  }
  absl::StatusOr<double> norm = (*job)->ClipGradNorm(static_cast<int>(request->client_rank()),
                                                     request->max_norm(), norm_type);
  if (!norm.ok()) return Fail("ClipGradNorm", norm.status());
  response->set_total_norm(*norm);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::GetParam(grpc::ServerContext*,
                                           const v1::GetParamRequest* request,
                                           v1::GetParamResponse* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("GetParam", job.status());
  if (request->amp_master_param() && !(*job)->amp()) {
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
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("StateDict", job.status());
  if (request->amp_master_params() && !(*job)->amp()) {
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
    grpc::ServerContext*, grpc::ServerReader<v1::LoadStateDictRequest>* reader,
    v1::LoadStateDictResponse* response) {
  v1::LoadStateDictRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return Fail("LoadStateDict", absl::InvalidArgumentError(
        "LoadStateDict must start with a header message, then the chunks"));
  }
  const v1::LoadStateDictRequest::Header header = request.header();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(header.job_id());
  if (!job.ok()) return Fail("LoadStateDict", job.status());
  ChunkAssembler assembler;
  absl::Status status = absl::OkStatus();
  while (reader->Read(&request)) {
    if (status.ok()) status = assembler.Add(request.chunk());  // drain the stream either way
  }
  if (!status.ok()) return Fail("LoadStateDict", status);
  absl::StatusOr<std::map<std::string, at::Tensor>> state = assembler.Finish();
  if (!state.ok()) return Fail("LoadStateDict", state.status());
  std::vector<std::string> missing, unexpected;
  status = (*job)->LoadStateDict(*state, header.strict(), &missing, &unexpected);
  if (!status.ok()) return Fail("LoadStateDict", status);
  for (const std::string& k : missing) response->add_missing_keys(k);
  for (const std::string& k : unexpected) response->add_unexpected_keys(k);
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::SetMode(grpc::ServerContext*, const v1::SetModeRequest* request,
                                          v1::SetModeResponse* response) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->job_id());
  if (!job.ok()) return Fail("SetMode", job.status());
  response->set_has_graph((*job)->SetMode(FromProto(request->mode())));
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::Undeploy(grpc::ServerContext*, const v1::JobRef* ref,
                                           v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("Undeploy", job.status());
  (*job)->Undeploy();
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::AbortStep(grpc::ServerContext*, const v1::JobRef* ref,
                                            v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("AbortStep", job.status());
  (*job)->AbortStep();
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::RecreateCommunicators(grpc::ServerContext*,
                                                        const v1::JobRef* ref, v1::Empty*) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->job_id());
  if (!job.ok()) return Fail("RecreateCommunicators", job.status());
  absl::Status status = (*job)->RecreateCommunicators();
  if (!status.ok()) return Fail("RecreateCommunicators", status);
  return grpc::Status::OK;
}

}  // namespace rannc
