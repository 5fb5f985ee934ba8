#include "daemon/server/job_settings.h"

#include <algorithm>
#include <cstdlib>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/config/keys.h"
#include "daemon/config/options.h"

namespace rannc {
namespace {

absl::StatusOr<OptimizerConfig> FromProto(const v1::OptimizerSpec& spec) {
  OptimizerConfig config;
  if (spec.type() == v1::OPTIMIZER_NONE) return config;
  absl::StatusOr<OptimizerKind> kind = OptimizerKindOf(spec.type());
  if (!kind.ok()) return kind.status();
  config.kind = *kind;
  switch (spec.type()) {
    case v1::SCRIPTED: {
      auto update = std::make_shared<ScriptedUpdate>();
      update->name = spec.scripted().name().empty() ? "scripted" : spec.scripted().name();
      update->module = spec.scripted().module();
      update->state_keys.assign(spec.scripted().state_keys().begin(),
                                spec.scripted().state_keys().end());
      absl::Status valid = ValidateScriptedUpdate(*update);
      if (!valid.ok()) return valid;
      config.scripted = std::move(update);
      break;
    }
    default:
      break;
  }
  config.enabled = true;
  if (spec.groups().empty()) {
    config.group_hyper.push_back(DefaultHyperParams(config.kind));
    return config;
  }
  for (const v1::ParamGroup& g : spec.groups()) {
    config.group_params.emplace_back(g.params().begin(), g.params().end());
    config.group_hyper.push_back(rannc::FromProto(g.hyper(), config.kind));
  }
  return config;
}

// enable_apex_amp's dtype and level (config keys amp_dtype, amp_level).
absl::Status ApplyAmp(const v1::JobSpec& spec, const DaemonFacts& facts, JobSettings* settings) {
  const auto& keys = spec.options().config();
  auto key = keys.find("amp_dtype");
  absl::StatusOr<c10::ScalarType> amp = ParseAmpDtype(key == keys.end() ? "bf16" : key->second);
  if (!amp.ok()) return amp.status();
  const bool cpu = facts.devices.empty() || facts.devices[0].type == "cpu";
  if (*amp == c10::ScalarType::Half && cpu) {
    return absl::InvalidArgumentError(
        "amp_dtype=fp16 needs CUDA devices; CPU devices run mixed precision in bf16 "
        "(amp_dtype=bf16)");
  }
  settings->amp = *amp;
  auto level = keys.find("amp_level");
  const std::string amp_level =
      level == keys.end() ? "O1" : absl::AsciiStrToUpper(level->second);
  if (amp_level != "O1" && amp_level != "O2") {
    return absl::InvalidArgumentError(absl::StrCat(
        "amp_level=", level->second, ": expected O1 (autocast, the default) or O2 (the whole "
        "forward in amp_dtype, fp32 master parameters)"));
  }
  settings->amp_o2 = amp_level == "O2";
  if (auto group = keys.find("amp_cast_group_bytes"); group != keys.end()) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(group->second);
    if (!bytes.ok() || *bytes > (uint64_t{1} << 62)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "amp_cast_group_bytes=", group->second, ": expected a size such as 256MiB, or 0"));
    }
    settings->amp_cast_group_bytes = static_cast<int64_t>(*bytes);
  }
  return absl::OkStatus();
}

// "~/x" as $HOME/x.
std::string ExpandHome(std::string path) {
  if (absl::StartsWith(path, "~/") && std::getenv("HOME") != nullptr) {
    path = absl::StrCat(std::getenv("HOME"), path.substr(1));
  }
  return path;
}

// Config keys checkpoint_dir, checkpoint_every, checkpoint_keep and resume.
absl::Status ApplyCheckpointKeys(const std::map<std::string, std::string>& keys,
                                 JobSettings* settings) {
  JobSettings::Checkpoints& c = settings->checkpoints;
  auto get = [&](const char* key) {
    auto it = keys.find(key);
    return it == keys.end() ? std::string() : it->second;
  };
  c.dir = ExpandHome(get("checkpoint_dir"));
  for (auto [key, out] : {std::pair<const char*, int*>{"checkpoint_every", &c.every},
                          std::pair<const char*, int*>{"checkpoint_keep", &c.keep}}) {
    const std::string value = get(key);
    if (!value.empty() && (!absl::SimpleAtoi(value, out) || *out < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          key, "=", value, ": expected a whole number, 0 or more"));
    }
  }
  const std::string resume = get("resume");
  if (resume.empty()) return absl::OkStatus();
  if (resume == "latest") {
    c.resume = 0;
  } else if (!absl::SimpleAtoi(resume, &c.resume) || c.resume <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume=", resume, ": expected 'latest' or the step of a checkpoint (a number)"));
  }
  if (c.dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume=", resume, " needs checkpoint_dir (RANNC_CHECKPOINT_DIR): where the job's "
        "checkpoints are"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointDirOf(const v1::JobSpec& spec) {
  auto it = spec.options().config().find("checkpoint_dir");
  return it == spec.options().config().end() ? std::string() : ExpandHome(it->second);
}

ModelMode FromProto(const v1::Mode& mode) { return ModelMode{mode.training(), mode.dropout()}; }

absl::StatusOr<OptimizerKind> OptimizerKindOf(v1::OptimizerType type) {
  switch (type) {
    case v1::SGD: return OptimizerKind::kSgd;
    case v1::ADAM: return OptimizerKind::kAdam;
    case v1::ADAMW: return OptimizerKind::kAdamW;
    case v1::RMSPROP: return OptimizerKind::kRmsprop;
    case v1::ADAGRAD: return OptimizerKind::kAdagrad;
    case v1::ADAMAX: return OptimizerKind::kAdamax;
    case v1::NADAM: return OptimizerKind::kNAdam;
    case v1::RADAM: return OptimizerKind::kRAdam;
    case v1::ADADELTA: return OptimizerKind::kAdadelta;
    case v1::ASGD: return OptimizerKind::kAsgd;
    case v1::RPROP: return OptimizerKind::kRprop;
    case v1::SCRIPTED: return OptimizerKind::kScripted;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown optimizer type ", static_cast<int>(type)));
  }
}

HyperParams FromProto(const v1::HyperParams& h, OptimizerKind kind) {
  HyperParams out = DefaultHyperParams(kind);
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
  if (h.has_alpha()) out.alpha = h.alpha();
  if (h.has_centered()) out.centered = h.centered();
  if (h.has_lr_decay()) out.lr_decay = h.lr_decay();
  if (h.has_initial_accumulator_value()) {
    out.initial_accumulator_value = h.initial_accumulator_value();
  }
  if (h.has_momentum_decay()) out.momentum_decay = h.momentum_decay();
  if (h.has_decoupled_weight_decay()) out.decoupled_weight_decay = h.decoupled_weight_decay();
  if (h.has_rho()) out.rho = h.rho();
  if (h.has_lambd()) out.lambd = h.lambd();
  if (h.has_t0()) out.t0 = h.t0();
  if (h.has_etaminus()) out.etaminus = h.etaminus();
  if (h.has_etaplus()) out.etaplus = h.etaplus();
  if (h.has_step_size_min()) out.step_size_min = h.step_size_min();
  if (h.has_step_size_max()) out.step_size_max = h.step_size_max();
  out.named.insert(h.named().begin(), h.named().end());
  return out;
}

v1::HyperParams ToProto(const HyperParams& h) {
  v1::HyperParams p;
  p.set_lr(h.lr);
  p.set_weight_decay(h.weight_decay);
  p.set_momentum(h.momentum);
  p.set_dampening(h.dampening);
  p.set_nesterov(h.nesterov);
  p.set_beta1(h.beta1);
  p.set_beta2(h.beta2);
  p.set_eps(h.eps);
  p.set_amsgrad(h.amsgrad);
  p.set_maximize(h.maximize);
  p.set_alpha(h.alpha);
  p.set_centered(h.centered);
  p.set_lr_decay(h.lr_decay);
  p.set_initial_accumulator_value(h.initial_accumulator_value);
  p.set_momentum_decay(h.momentum_decay);
  p.set_decoupled_weight_decay(h.decoupled_weight_decay);
  p.set_rho(h.rho);
  p.set_lambd(h.lambd);
  p.set_t0(h.t0);
  p.set_etaminus(h.etaminus);
  p.set_etaplus(h.etaplus);
  p.set_step_size_min(h.step_size_min);
  p.set_step_size_max(h.step_size_max);
  p.mutable_named()->insert(h.named.begin(), h.named.end());
  return p;
}

absl::Status CheckClientWorld(uint32_t world, const std::string& what) {
  if (world <= kMaxClientWorld) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", world, " client ranks; a job may "
                                                 "have at most ", kMaxClientWorld));
}

absl::StatusOr<JobSettings> JobSettingsFromSpec(const v1::JobSpec& spec,
                                                const DaemonFacts& facts) {
  for (const auto& [key, value] : spec.options().config()) {
    absl::Status known = CheckJobKey(key);
    if (!known.ok()) return known;
  }
  JobSettings settings;
  settings.name = spec.name();
  settings.spec = spec;
  settings.mode = FromProto(spec.mode());
  absl::StatusOr<OptimizerConfig> optimizer = FromProto(spec.optimizer());
  if (!optimizer.ok()) return optimizer.status();
  settings.optimizer = std::move(*optimizer);
  settings.check_unused_values = spec.options().check_unused_values();
  settings.allreduce_amp_master_params = spec.options().allreduce_amp_master_params();
  settings.zero = spec.options().enable_zero();
  settings.offload = spec.options().offload_params();
  if (spec.options().enable_apex_amp()) {
    absl::Status amp = ApplyAmp(spec, facts, &settings);
    if (!amp.ok()) return amp;
  }
  const std::map<std::string, std::string> keys(spec.options().config().begin(),
                                                spec.options().config().end());
  absl::StatusOr<LossScaleOptions> loss_scale = ParseLossScale(keys, settings.amp);
  if (!loss_scale.ok()) return loss_scale.status();
  settings.loss_scale = *loss_scale;
  absl::Status checkpoints = ApplyCheckpointKeys(keys, &settings);
  if (!checkpoints.ok()) return checkpoints;
  if (auto wait = keys.find("admission_wait"); wait != keys.end()) {
    double seconds = 0;
    if (!absl::SimpleAtod(wait->second, &seconds) || !(seconds >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "admission_wait=", wait->second, ": expected seconds, 0 or more"));
    }
    settings.admission_wait = std::chrono::milliseconds(std::llround(seconds * 1000));
  }
  if (auto early = keys.find("outputs_before_backward"); early != keys.end()) {
    if (!absl::SimpleAtob(early->second, &settings.outputs_before_backward)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs_before_backward=", early->second, ": expected true or false"));
    }
  }
  if ((settings.checkpoints.every > 0) && settings.checkpoints.dir.empty()) {
    return absl::InvalidArgumentError(
        "checkpoint_every needs checkpoint_dir (RANNC_CHECKPOINT_DIR): where to write them");
  }
  settings.input_names.assign(spec.input_names().begin(), spec.input_names().end());
  for (const auto& device : facts.devices) settings.device_names.push_back(device.name);
  settings.placement = Placement(facts.devices, static_cast<int>(facts.devices.size()), {});
  // Blocks are profiled on the kind of device they will run on: this daemon's first.
  if (!settings.placement.empty()) settings.plan_target.profile_device = settings.placement[0];
  if (!facts.devices.empty()) {
    settings.plan_target.device_type = facts.devices[0].type;
    settings.plan_target.device_memory_bytes = facts.devices[0].memory_bytes;
  }
  settings.plan_target.num_devices = static_cast<int>(facts.devices.size());
  settings.plan_target.links = facts.links;
  settings.profile_cache = facts.profile_cache;
  settings.created_by = absl::StrCat("ranncd ", facts.version, " (LibTorch ",
                                     facts.torch_version, ")");
  settings.load_deployment = spec.options().load_deployment();
  if (absl::Status bounded = CheckClientWorld(spec.options().client_world(), "client_world");
      !bounded.ok()) {
    return bounded;
  }
  settings.client_world = std::max<int>(1, static_cast<int>(spec.options().client_world()));
  settings.gather_inputs = spec.options().gather_inputs();
  if (spec.options().client_timeout_ms() > 0) {
    settings.client_timeout = std::chrono::milliseconds(spec.options().client_timeout_ms());
  }
  if (spec.options().has_numerics()) {
    const v1::NumericSettings& n = spec.options().numerics();
    settings.numerics.float32_matmul_precision = n.float32_matmul_precision();
    settings.numerics.cudnn_allow_tf32 = n.cudnn_allow_tf32();
    settings.numerics.cudnn_deterministic = n.cudnn_deterministic();
    settings.numerics.cudnn_benchmark = n.cudnn_benchmark();
    settings.numerics.deterministic_algorithms = n.deterministic_algorithms();
    settings.numerics.deterministic_warn_only = n.deterministic_warn_only();
    absl::Status valid = ValidateNumericSettings(settings.numerics);
    if (!valid.ok()) return valid;
  }
  settings.lease = std::chrono::milliseconds(spec.options().lease_ms());
  if (settings.lease.count() > 0 && settings.lease < std::chrono::seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_ms=", spec.options().lease_ms(), ": a job's lease is 0 (none) or at least 1000 ms "
        "(the daemon looks for expired leases once a second); pyrannc: RANNC_JOB_LEASE seconds"));
  }
  absl::StatusOr<planner::PlannerConfig> planner = planner::PlannerConfigFromKeys(keys);
  if (!planner.ok()) return planner.status();
  settings.planner = *planner;
  settings.plan_target.batch_size = settings.planner.batch_size;  // a dry run's may override it
  return settings;
}

absl::Status ApplyDryRun(const v1::PlanTarget& dry, JobSettings* settings) {
  settings->plan_target.num_devices = static_cast<int>(dry.num_devices());
  if (dry.device_memory_bytes() != 0) {
    settings->plan_target.device_memory_bytes = dry.device_memory_bytes();
  }
  if (dry.batch_size() > 0) settings->plan_target.batch_size = dry.batch_size();
  if (!dry.links().empty()) {
    absl::StatusOr<planner::Links> links = planner::LinksFromString(dry.links());
    if (!links.ok()) return Annotate(links.status(), "dry_run.links");
    settings->plan_target.links = *links;
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSettings> PartSettings(const v1::JobSpec& spec, const v1::PartSpec& part,
                                         const DaemonFacts& facts) {
  absl::StatusOr<JobSettings> settings = JobSettingsFromSpec(spec, facts);
  if (!settings.ok()) return settings.status();
  settings->is_part = true;
  settings->plan_target.num_devices = static_cast<int>(part.num_devices());
  settings->local_devices.assign(part.local_devices().begin(), part.local_devices().end());
  settings->engine_store_address = part.store_address();
  settings->engine_group = part.group();
  settings->device_names.clear();
  settings->placement =
      Placement(facts.devices, settings->plan_target.num_devices, settings->local_devices);
  settings->backend = JobBackend(settings->placement, facts.devices);
  return settings;
}

absl::Status SpanCluster(const std::string& job_id, const v1::JobSpec& spec,
                         std::vector<cluster::MemberInfo> members, const DaemonFacts& facts,
                         comm::Store* store, JobSettings* settings,
                         std::vector<std::string>* left_out) {
  // A job runs on every member that is UP. One not heard from yet (the cluster is starting) is
  // waited for; one that is DOWN is left out, so a lost daemon does not stop new jobs.
  for (const cluster::MemberInfo& m : members) {
    if (m.state == cluster::MemberState::kUnknown) {
      return absl::UnavailableError(absl::StrCat(
          "cluster member ", m.address, " has not been heard from yet; a job runs on every "
          "daemon of the cluster, so wait until all are up (rannc info)"));
    }
    if (m.state == cluster::MemberState::kDown) left_out->push_back(m.address);
  }
  members.erase(std::remove_if(members.begin(), members.end(),
                               [](const cluster::MemberInfo& m) {
                                 return m.state != cluster::MemberState::kUp;
                               }),
                members.end());
  if (members.size() < 2) return absl::OkStatus();
  // The leading daemon's devices first, then the others' by rank: a plan that uses fewer
  // devices than the cluster has uses the leader's (which must take part: it runs the job's
  // first engine and its client's calls).
  std::sort(members.begin(), members.end(),
            [](const cluster::MemberInfo& a, const cluster::MemberInfo& b) {
              return std::make_pair(!a.self, a.rank) < std::make_pair(!b.self, b.rank);
            });
  settings->device_names.clear();
  settings->local_devices.clear();
  settings->members.clear();
  for (const cluster::MemberInfo& m : members) {
    JobSettings::Member member{m.address, {}};
    for (const cluster::DeviceSummary& d : m.devices) {
      const int index = static_cast<int>(settings->device_names.size());
      settings->device_names.push_back(absl::StrCat(m.address, "/", d.name));
      (m.self ? settings->local_devices : member.devices).push_back(index);
    }
    if (m.self) {
      settings->self_address = m.address;
    } else {
      settings->members.push_back(std::move(member));
    }
  }
  settings->plan_target.num_devices = static_cast<int>(settings->device_names.size());
  settings->placement =
      Placement(facts.devices, settings->plan_target.num_devices, settings->local_devices);
  settings->engine_store = store;
  settings->engine_group = job_id;
  settings->spec = spec;
  return absl::OkStatus();
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

}  // namespace rannc
