#include "daemon/server/job.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <cmath>
#include <limits>
#include <set>

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/ir/ir.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/comm/grpc_store.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/optim/grad_norm.h"
#include "daemon/common/status.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/index_bounds.h"
#include "daemon/graph/low_precision.h"
#include "daemon/planner/deployment.h"

namespace rannc {

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kDeployed: return "DEPLOYED";
    case JobState::kUndeployed: return "UNDEPLOYED";
  }
  return "UNKNOWN";
}

namespace {

absl::Status CheckUnusedValues(const ImportedModel& model, const ParamStore& store) {
  for (size_t i = 0; i < model.input_names.size(); ++i) {
    if (!model.graph->inputs()[i]->hasUses()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", model.input_names[i], "' (#", i,
          ") is not used by the model's forward; remove it or pass check_unused_values=False"));
    }
  }
  std::set<std::string> used(model.graph_tensor_names.begin(), model.graph_tensor_names.end());
  for (const ParamStore::Entry& e : store.entries()) {
    if (!e.is_parameter) continue;
    bool is_used = used.count(e.name) > 0;
    for (const std::string& alias : e.aliases) is_used = is_used || used.count(alias) > 0;
    if (!is_used) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", e.name, "' is not used by the model's forward; remove it or pass "
          "check_unused_values=False"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Optimizer>> BuildOptimizer(const OptimizerConfig& config,
                                                          const ParamStore& store) {
  std::vector<ParamGroup> groups;
  if (config.group_params.empty()) {
    if (config.group_hyper.size() != 1) {
      return absl::InvalidArgumentError("an optimizer without param groups needs one hyper set");
    }
    groups.push_back({store.Parameters(), config.group_hyper[0]});
  } else {
    if (config.group_params.size() != config.group_hyper.size()) {
      return absl::InvalidArgumentError("optimizer param groups and hyper-parameters differ");
    }
    std::set<const ParamStore::Entry*> seen;
    for (size_t g = 0; g < config.group_params.size(); ++g) {
      ParamGroup group{{}, config.group_hyper[g]};
      for (const std::string& name : config.group_params[g]) {
        const ParamStore::Entry* entry = store.Find(name);
        if (entry == nullptr || !entry->is_parameter) {
          return absl::InvalidArgumentError(absl::StrCat(
              "optimizer param group ", g, " names '", name, "', which is not a parameter of "
              "the model"));
        }
        if (!seen.insert(entry).second) {
          return absl::InvalidArgumentError(absl::StrCat(
              "parameter '", name, "' appears in more than one optimizer param group"));
        }
        group.params.push_back(entry->tensor);
      }
      groups.push_back(std::move(group));
    }
  }
  for (const ParamGroup& g : groups) {
    absl::Status valid = ValidateHyperParams(config.kind, g.hyper);
    if (!valid.ok()) return valid;
  }
  return MakeOptimizer(config.kind, std::move(groups));
}

absl::Status CheckExampleCount(const ImportedModel& model,
                               const std::vector<at::Tensor>& example_inputs) {
  if (model.input_names.size() == example_inputs.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the model's forward takes ", model.input_names.size(), " inputs (",
      absl::StrJoin(model.input_names, ", "), "), but ", example_inputs.size(),
      " example inputs were given"));
}

// With amp_level=O2, the imported forward rewritten to compute in the AMP dtype from end to end
// (graph/low_precision.h); `inputs`: the job's inputs, whose floating ones are cast on entry.
absl::Status LowerPrecision(const JobConfig& config, ImportedModel* model,
                            const std::vector<c10::ScalarType>& inputs) {
  if (!config.amp_o2) return absl::OkStatus();
  return CastForwardTo(model, *config.amp, inputs);
}

// The client's archive as a job (or a dry run) takes it: the sent tensors in place of their
// stand-ins, none left unbound, as many forward inputs as example inputs, and the forward
// lowered for amp_level=O2.
absl::StatusOr<ImportedModel> ImportJobModel(const JobConfig& config,
                                             const std::string& model_bytes,
                                             const SentTensors& sent,
                                             const std::vector<at::Tensor>& example_inputs) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(model_bytes, sent);
  if (!model.ok()) return model.status();
  if (absl::Status bound = CheckNoStandIns(*model); !bound.ok()) return bound;
  if (absl::Status counted = CheckExampleCount(*model, example_inputs); !counted.ok()) {
    return counted;
  }
  std::vector<c10::ScalarType> dtypes;
  for (const at::Tensor& x : example_inputs) dtypes.push_back(x.scalar_type());
  if (absl::Status lowered = LowerPrecision(config, &*model, dtypes); !lowered.ok()) {
    return lowered;
  }
  return model;
}

// What the planner counts per trainable parameter byte: optimizer state (and whether it is sharded
// or offloaded) and AMP weight copies.
planner::MemoryModel MemoryModelFor(const OptimizerConfig& config, bool zero, bool offload,
                                    const AmpDtype& amp) {
  planner::MemoryModel m;
  m.zero = zero;
  m.offload = offload;
  // Autocast's low-precision copies of the fp32 weights, kept by each micro-batch in flight.
  if (amp.has_value()) m.amp_cast_factor = c10::elementSize(*amp) / 4.0;
  if (!config.enabled) return m;
  bool momentum = false, amsgrad = false;
  for (const HyperParams& h : config.group_hyper) {
    momentum = momentum || h.momentum != 0;
    amsgrad = amsgrad || h.amsgrad;
  }
  switch (config.kind) {
    case OptimizerKind::kSgd:
      m.optimizer = "sgd";
      m.optimizer_state_factor = momentum ? 1 : 0;
      break;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      m.optimizer = config.kind == OptimizerKind::kAdam ? "adam" : "adamw";
      m.optimizer_state_factor = amsgrad ? 3 : 2;
      break;
  }
  return m;
}

// The plan for `ir`: planned for config.plan_target, or the deployment the client loaded,
// checked against this model and these devices.
absl::StatusOr<v1::Deployment> PlanIr(const JobConfig& config, const IrGraph& ir,
                                      const std::vector<at::Tensor>& tensors,
                                      const std::vector<at::Tensor>& example_inputs) {
  if (!config.load_deployment.empty()) {
    v1::Deployment loaded;
    if (!loaded.ParseFromString(config.load_deployment)) {
      return absl::InvalidArgumentError(
          "load_deployment: the file is not a deployment (a serialized rannc.v1.Deployment)");
    }
    // The client's saved trace (MBs of TorchScript) is the client's business: dropped so the
    // job's plan, the CreateJob reply and a cluster part's spec do not carry it.
    loaded.clear_saved_trace();
    planner::PlanTarget target = config.plan_target;
    if (target.batch_size <= 0) target.batch_size = ir.example_batch;
    absl::Status fits = planner::CheckDeployment(loaded, ir, target);
    if (!fits.ok()) return Annotate(fits, "load_deployment");
    loaded.set_loaded(true);
    return loaded;
  }
  auto plan_with = [&](bool zero, bool offload) -> absl::StatusOr<v1::Deployment> {
    // The planner runs the model (profiling): a LibTorch error there is a status, not a throw.
    absl::StatusOr<v1::Deployment> plan = absl::InternalError("no plan");
    absl::Status ran = TorchCall(absl::StatusCode::kInternal, "profiling", [&] {
      plan = planner::PlanModel(ir, tensors, example_inputs, config.plan_target,
                                MemoryModelFor(config.optimizer, zero, offload, config.amp),
                                config.planner, config.profile_cache, config.created_by);
      return absl::OkStatus();
    });
    if (!ran.ok()) return ran;
    return plan;
  };
  absl::StatusOr<v1::Deployment> plan = plan_with(config.zero, config.offload);
  if (!plan.ok() && plan.status().code() == absl::StatusCode::kResourceExhausted &&
      config.planner.auto_memory) {
    // Nothing fits as asked: the switches a user would turn on by hand, the cheapest first
    // (ZeRO shards over replicas; offload moves each step's parameters over the host link).
    // The profiles are cached, so each try is a search.
    std::set<std::pair<bool, bool>> tried = {{config.zero, config.offload}};
    for (auto [zero, offload] : std::vector<std::pair<bool, bool>>{
             {true, config.offload}, {config.zero, true}, {true, true}}) {
      if (!tried.insert({zero, offload}).second) continue;
      absl::StatusOr<v1::Deployment> more = plan_with(zero, offload);
      if (more.ok()) {
        spdlog::info("no plan fits {}; planned with{}{} instead (planner key auto_memory)",
                     config.zero || config.offload ? "with the job's memory switches"
                                                   : "without ZeRO or offload",
                     zero ? " ZeRO" : "", offload ? (zero ? " and offload" : " offload") : "");
      }
      if (more.ok() || more.status().code() != absl::StatusCode::kResourceExhausted) {
        plan = std::move(more);
        break;
      }
    }
    if (!plan.ok() && plan.status().code() == absl::StatusCode::kResourceExhausted) {
      plan = absl::ResourceExhaustedError(absl::StrCat(
          plan.status().message(), "; with ZeRO and parameter offload (auto_memory) neither"));
    }
  }
  if (!plan.ok()) return Annotate(plan.status(), "planning the model");
  return plan;
}

struct PlannedModel {
  std::unique_ptr<IrGraph> ir;
  v1::Deployment plan;
  double ir_s = 0;
  double plan_s = 0;
};

// The model's IR (for the store's tensors) and its plan.
absl::StatusOr<PlannedModel> PlanJobModel(const JobConfig& config, const ImportedModel& model,
                                          const ParamStore& store,
                                          const std::vector<at::Tensor>& example_inputs) {
  std::vector<at::Tensor> tensors;
  for (const std::string& name : model.graph_tensor_names) {
    tensors.push_back(store.Find(name)->tensor);
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<IrGraph> ir = BuildIr(model, tensors, example_inputs);
  if (!ir.ok()) return Annotate(ir.status(), "building the model's IR");
  PlannedModel out;
  out.ir_s = SecondsSince(start);
  spdlog::info("IR: {} atomic nodes, {} of them run per probe, built in {:.2f} s", ir->nodes.size(),
               ir->nodes_probed, out.ir_s);
  out.ir = std::make_unique<IrGraph>(std::move(*ir));
  const auto planning = std::chrono::steady_clock::now();
  absl::StatusOr<v1::Deployment> plan = PlanIr(config, *out.ir, tensors, example_inputs);
  if (!plan.ok()) return plan.status();
  out.plan = std::move(*plan);
  out.plan_s = SecondsSince(planning);
  return out;
}

// Per store entry, the IR lifted index of its tensor (under its name or an alias), or -1 when
// the graph never reads it.
std::vector<int> LiftedOfEntries(const ParamStore& store, const IrGraph& ir) {
  std::vector<int> out;
  for (const ParamStore::Entry& e : store.entries()) {
    int lifted = -1;
    for (size_t i = 0; i < ir.tensor_names.size() && lifted < 0; ++i) {
      if (ir.tensor_names[i] == e.name ||
          std::find(e.aliases.begin(), e.aliases.end(), ir.tensor_names[i]) != e.aliases.end()) {
        lifted = static_cast<int>(i);
      }
    }
    out.push_back(lifted);
  }
  return out;
}

// The optimizer's param groups as lifted indices (parameters the graph never reads have no
// gradient, so no optimizer state either, and are left out).
std::vector<std::vector<int>> OptimizerGroups(const OptimizerConfig& config,
                                              const ParamStore& store,
                                              const std::vector<int>& lifted_of_entry) {
  auto lifted_of = [&](const std::string& name) {
    return lifted_of_entry[store.Find(name) - store.entries().data()];
  };
  std::vector<std::vector<int>> groups;
  if (config.group_params.empty()) {
    groups.emplace_back();
    for (const ParamStore::Entry& e : store.entries()) {
      if (e.is_parameter && lifted_of(e.name) >= 0) groups.back().push_back(lifted_of(e.name));
    }
    return groups;
  }
  for (const std::vector<std::string>& names : config.group_params) {
    groups.emplace_back();
    for (const std::string& name : names) {
      if (lifted_of(name) >= 0) groups.back().push_back(lifted_of(name));
    }
  }
  return groups;
}

// A part's answer as a Status with the same code, naming the daemon.
absl::Status FromGrpc(const grpc::Status& status, const std::string& address) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("daemon ", address, ": ", status.error_message()));
}

// Which of several daemons' errors in one step the client gets: the cause (a bad input, say)
// rather than its consequences on the other daemons, a peer that went away (UNAVAILABLE) or a
// step abandoned (ABORTED).
int ErrorRank(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return 0;
    case absl::StatusCode::kAborted: return 1;
    case absl::StatusCode::kUnavailable: return 2;
    default: return 3;
  }
}

// What Step and ClipGradNorm answer while delayed backwards' gradients are not reduced: RaNNC
// requires allreduce_grads() before them, and so do we rather than use partial sums.
absl::Status NotReduced(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": the gradients of delayed backwards (delay_grad_allreduce(True)) are not "
      "all-reduced yet; call allreduce_grads() first"));
}

// The proto form of a step's hyper-parameters, for the members' parts.
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
  return p;
}

}  // namespace

Job::~Job() { TellParts(&v1::TrainingService::Stub::DeleteJob, std::chrono::seconds(10)); }

Job::Job(std::string id, JobConfig config)
    : id_(std::move(id)),
      config_(std::move(config)),
      created_(std::chrono::system_clock::now()),
      touched_ns_(std::chrono::steady_clock::now().time_since_epoch().count()),
      mode_(config_.mode),
      parked_loss_scaler_(config_.loss_scale) {}

absl::StatusOr<std::unique_ptr<Job>> Job::Create(std::string id, JobConfig config,
                                                 const std::string& model_bytes,
                                                 const std::vector<at::Tensor>& example_inputs,
                                                 const SentTensors& sent) {
  auto phase = std::chrono::steady_clock::now();
  absl::StatusOr<ImportedModel> model = ImportJobModel(config, model_bytes, sent, example_inputs);
  if (!model.ok()) return model.status();
  std::unique_ptr<Job> job(new Job(std::move(id), std::move(config)));
  job->create_timings_.import_s = SecondsSince(phase);
  job->store_ = ParamStore::FromModuleTensors(model->tensors);
  if (job->config_.check_unused_values) {
    absl::Status unused = CheckUnusedValues(*model, job->store_);
    if (!unused.ok()) return unused;
  }
  for (size_t i = 0; i < example_inputs.size(); ++i) {
    std::string name = i < job->config_.input_names.size() && !job->config_.input_names[i].empty()
                           ? job->config_.input_names[i]
                           : model->input_names[i];
    job->signature_.push_back({name, example_inputs[i].scalar_type(),
                               example_inputs[i].sizes().vec()});
  }
  job->runner_ = std::make_unique<ModelRunner>(&job->store_);
  absl::Status added = job->runner_->AddMode(job->mode_, *model);
  if (!added.ok()) return added;
  if (job->config_.optimizer.enabled) {
    // Checks the groups and hyper-parameters; the devices' optimizers are made by Deploy.
    absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
        BuildOptimizer(job->config_.optimizer, job->store_);
    if (!optimizer.ok()) return optimizer.status();
  }

  // Every forward of an AMP job at O1 runs under autocast, the IR's and profiler's below
  // included (so the outputs' dtypes the client learns are the training run's); at O2 the graph
  // itself computes in the AMP dtype.
  AutocastGuard amp(job->config_.autocast());
  absl::StatusOr<PlannedModel> planned =
      PlanJobModel(job->config_, *model, job->store_, example_inputs);
  if (!planned.ok()) return planned.status();
  // The outputs' specs come from the IR's example run (its probes, extrapolated to the example
  // batch): no forward of the whole example batch on the host is needed.
  for (int id : planned->ir->outputs) {
    const IrValue& v = planned->ir->values[id];
    job->output_specs_.push_back({v.dtype, v.shape});
  }
  // Integer inputs that index tables (token ids, class targets) are range-checked on the host
  // with every batch: on a GPU an index out of range would be a device-side assert.
  for (const IndexBound& b : FindIndexBounds(*planned->ir)) {
    job->signature_[b.input].ranges.push_back({b.limit, b.ignore, b.what});
  }
  job->ir_ = std::move(planned->ir);
  job->deployment_ = std::move(planned->plan);
  // The plan's memory switches: the job's, or more when nothing fit without them
  // (PlannerConfig::auto_memory), or those a loaded plan was made with.
  job->zero_ = job->config_.zero || job->deployment_.zero();
  job->offload_ = job->config_.offload || job->deployment_.offload();
  job->create_timings_.ir_s = planned->ir_s;
  job->create_timings_.plan_s = planned->plan_s;
  phase = std::chrono::steady_clock::now();

  job->lifted_of_entry_ = LiftedOfEntries(job->store_, *job->ir_);
  if (job->config_.optimizer.enabled) {
    job->optimizer_groups_ =
        OptimizerGroups(job->config_.optimizer, job->store_, job->lifted_of_entry_);
  }
  for (int d : job->deployment_devices()) {
    job->devices_.push_back(d < static_cast<int>(job->config_.device_names.size())
                                ? job->config_.device_names[d]
                                : absl::StrCat(job->config_.plan_target.device_type, ":", d));
  }
  absl::Status deployed;
  if (job->config_.members.empty()) {
    deployed = job->Deploy();
  } else if (sent.empty()) {
    deployed = job->CreateParts(model_bytes, example_inputs);
  } else {
    // The parts take one whole archive: the sent tensors go back into it.
    absl::StatusOr<std::string> whole = SerializeModule(*model);
    deployed = whole.ok() ? job->CreateParts(*whole, example_inputs) : whole.status();
  }
  if (!deployed.ok()) return Annotate(deployed, "deploying the model on its devices");
  job->create_timings_.place_s = SecondsSince(phase);
  if (job->config_.client_world > 1) {
    job->client_ranks_ = std::make_unique<ClientRendezvous>(job->config_.client_world,
                                                            job->config_.client_timeout);
  }
  return job;
}

void Job::Touch() {
  touched_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                    std::memory_order_relaxed);
}

std::chrono::milliseconds Job::IdleFor(std::chrono::steady_clock::time_point now) const {
  const std::chrono::steady_clock::time_point touched{
      std::chrono::steady_clock::duration(touched_ns_.load(std::memory_order_relaxed))};
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - touched);
}

bool Job::LeaseExpired(std::chrono::steady_clock::time_point now) const {
  return config_.lease.count() > 0 && IdleFor(now) > config_.lease;
}

std::vector<int> Job::deployment_devices() const {
  std::set<int> used;
  for (const v1::DeploymentStage& s : deployment_.stages()) {
    used.insert(s.devices().begin(), s.devices().end());
  }
  return {used.begin(), used.end()};
}

absl::Status Job::Deploy() {
  std::vector<at::Tensor> lifted(ir_->tensor_names.size());
  for (size_t i = 0; i < lifted.size(); ++i) {
    lifted[i] = store_.Find(ir_->tensor_names[i])->tensor;
  }
  EngineOptions options;
  options.backend = config_.backend;
  options.num_devices = config_.plan_target.num_devices;
  options.local_devices = config_.local_devices;
  options.placement = config_.placement;
  options.group = config_.engine_group;
  options.zero = zero_;
  options.offload = offload_;
  options.loss_scaler = parked_loss_scaler_;
  options.amp = config_.autocast();
  {
    // A fresh flag per engine: an aborted step leaves the next engine untouched.
    std::lock_guard<std::mutex> lock(lost_mu_);
    cancel_ = std::make_shared<std::atomic<bool>>(!lost_.ok());
    options.cancel = cancel_;
  }
  if (config_.engine_store != nullptr) {
    options.store = config_.engine_store;
  } else if (!config_.engine_store_address.empty()) {
    if (!part_store_) part_store_ = comm::MakeGrpcStore(config_.engine_store_address);
    options.store = part_store_.get();
  }
  if (!options.group.empty()) {
    // A redeployed job's communicators must not meet the previous deployment's keys.
    options.group = absl::StrCat(options.group, "/", deployments_++);
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(*ir_, deployment_, lifted, options);
  if (!engine.ok()) return engine.status();
  const double engine_s = SecondsSince(start);
  if (config_.optimizer.enabled) {
    absl::Status s = (*engine)->SetOptimizer(config_.optimizer.kind, optimizer_groups_);
    if (s.ok()) s = (*engine)->LoadOptimizerState(parked_optimizer_state_);
    if (!s.ok()) return s;
  }
  // Gradients accumulated before an undeploy go back to the devices.
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const at::Tensor& t = entries[e].tensor;
    if (lifted_of_entry_[e] < 0 || !t.grad().defined()) continue;
    if (grad_shares_) {
      (*engine)->AddGradShare(lifted_of_entry_[e], t.grad());
    } else {
      (*engine)->AddGrad(lifted_of_entry_[e], t.grad());
    }
    t.mutable_grad().reset();
  }
  grad_shares_ = false;
  parked_optimizer_state_.clear();
  engine_ = std::move(*engine);
  const double deploy_s = SecondsSince(start);
  spdlog::log(deploy_s >= 0.1 ? spdlog::level::info : spdlog::level::debug,
              "deployed in {:.2f} s: engine {:.2f} (split in its own line), optimizer state "
              "and gradients {:.2f}",
              deploy_s, engine_s, deploy_s - engine_s);
  if (held_.empty()) {
    for (size_t li = 0; li < lifted.size(); ++li) {
      held_.push_back(engine_->Holds(static_cast<int>(li)));
    }
  }
  return absl::OkStatus();
}

absl::Status Job::PartStatus(absl::Status status) const {
  if (!config_.is_part || status.code() != absl::StatusCode::kUnavailable) return status;
  return absl::AbortedError(status.message());
}

bool Job::Held(int lifted) const {
  if (parts_.empty() && !config_.is_part) return true;
  return lifted >= 0 && lifted < static_cast<int>(held_.size()) && held_[lifted];
}

bool Job::GradsPending() const { return grad_shares_ || (engine_ && engine_->grads_pending()); }

void Job::SyncStore(bool grads) {
  at::NoGradGuard no_grad;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const int li = lifted_of_entry_[e];
    if (li < 0) continue;
    const at::Tensor& t = entries[e].tensor;
    if (!Held(li)) {
      // Another daemon's part holds it (a part keeps its store's copy of what it doesn't hold).
      if (grads || parts_.empty()) continue;
      absl::StatusOr<at::Tensor> remote = PartTensor(entries[e].name, false);
      if (remote.ok() && remote->defined()) t.copy_(*remote);
      continue;
    }
    if (!engine_) continue;
    t.copy_(engine_->ParamAt(li));
    if (grads && entries[e].is_parameter) t.mutable_grad() = engine_->GradAt(li);
  }
}

void Job::ReleaseEngine() {
  if (!engine_) return;
  // With every device here, a pending gradient read from the engine is already the sum over
  // its holders; over several daemons it is this daemon's share.
  grad_shares_ = engine_->grads_pending() && (!parts_.empty() || config_.is_part);
  SyncStore(/*grads=*/true);  // this daemon's values only: its parts keep theirs
  parked_optimizer_state_ = engine_->OptimizerState();
  parked_loss_scaler_ = engine_->loss_scaler();
  engine_.reset();
}

absl::Status Job::EnsureDeployed() {
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  state_ = JobState::kDeployed;
  if (engine_) return absl::OkStatus();
  return Annotate(Deploy(), "deploying the model on its devices");
}

absl::StatusOr<v1::Deployment> Job::PlanOnly(const JobConfig& config,
                                              const std::string& model_bytes,
                                              const std::vector<at::Tensor>& example_inputs,
                                              const SentTensors& sent) {
  absl::StatusOr<ImportedModel> model = ImportJobModel(config, model_bytes, sent, example_inputs);
  if (!model.ok()) return model.status();
  ParamStore store = ParamStore::FromModuleTensors(model->tensors);
  if (config.check_unused_values) {
    absl::Status unused = CheckUnusedValues(*model, store);
    if (!unused.ok()) return unused;
  }
  AutocastGuard amp(config.autocast());
  absl::StatusOr<PlannedModel> planned = PlanJobModel(config, *model, store, example_inputs);
  if (!planned.ok()) return planned.status();
  return std::move(planned->plan);
}

absl::Status Job::CreateParts(const std::string& model_bytes,
                              const std::vector<at::Tensor>& example_inputs) {
  // The members whose devices the plan uses each get a part: the client's spec with the plan
  // to load and the devices to run.
  const std::vector<int> plan_devices = deployment_devices();
  const std::set<int> used(plan_devices.begin(), plan_devices.end());
  v1::JobSpec spec = config_.spec;
  spec.mutable_options()->set_load_deployment(deployment_.SerializeAsString());
  spec.clear_example_inputs();
  spec.clear_model_tensors();  // in model_bytes; they may name the client's shm files
  // A part lives as long as the job that leads it (~Job deletes the parts), not by a lease.
  spec.mutable_options()->set_lease_ms(0);
  for (const at::Tensor& t : example_inputs) {
    absl::Status encoded = EncodeTensor(t, spec.add_example_inputs(), nullptr);
    if (!encoded.ok()) return encoded;
  }
  spec.set_model_bytes(model_bytes.size());
  std::vector<std::future<absl::StatusOr<std::string>>> created;
  for (const JobConfig::Member& member : config_.members) {
    std::vector<int> mine;
    for (int d : member.devices) {
      if (used.count(d)) mine.push_back(d);
    }
    if (mine.empty()) continue;
    Part part;
    part.address = member.address;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    part.stub = v1::TrainingService::NewStub(grpc::CreateCustomChannel(
        member.address, grpc::InsecureChannelCredentials(), args));
    v1::JobSpec part_spec = spec;
    // The client ranks meet here, at the leader; a part serves only it.
    part_spec.mutable_options()->set_client_world(0);
    v1::JobPart* p = part_spec.mutable_options()->mutable_part();
    p->set_store_address(config_.self_address);
    for (int d : mine) p->add_local_devices(d);
    p->set_num_devices(config_.plan_target.num_devices);
    p->set_group(config_.engine_group);
    v1::TrainingService::Stub* stub = part.stub.get();
    parts_.push_back(std::move(part));
    created.push_back(std::async(std::launch::async, [stub, part_spec, &model_bytes]()
                                     -> absl::StatusOr<std::string> {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
      v1::CreateJobResponse response;
      std::unique_ptr<grpc::ClientWriter<v1::CreateJobRequest>> writer =
          stub->CreateJob(&context, &response);
      v1::CreateJobRequest header;
      *header.mutable_spec() = part_spec;
      bool ok = writer->Write(header);
      constexpr size_t kChunk = 1 << 20;
      for (size_t off = 0; ok && off < model_bytes.size(); off += kChunk) {
        v1::CreateJobRequest chunk;
        chunk.set_model_chunk(model_bytes.substr(off, kChunk));
        ok = writer->Write(chunk);
      }
      writer->WritesDone();
      grpc::Status status = writer->Finish();
      if (!status.ok()) return absl::UnavailableError(status.error_message());
      return response.job_id();
    }));
  }
  absl::Status local = Deploy();
  absl::Status status = local;
  for (size_t i = 0; i < created.size(); ++i) {
    absl::StatusOr<std::string> id = created[i].get();
    if (id.ok()) {
      parts_[i].job_id = *id;
    } else if (status.ok()) {
      status = Annotate(id.status(), absl::StrCat("creating this job's part on ",
                                                  parts_[i].address));
    }
  }
  return status;
}

absl::Status Job::OnParts(const PartCall& call, const std::function<absl::Status()>& local) {
  aborting_ = false;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::future<absl::Status>> remote;
  for (Part& part : parts_) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    grpc::ClientContext* context = contexts.back().get();
    remote.push_back(std::async(std::launch::async, [this, &call, &part, context] {
      const grpc::Status s = call(part, *context);
      if (s.ok()) return absl::OkStatus();
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        MemberLost(part.address, s.error_message());  // gone, or cut off
      } else if (s.error_code() != grpc::StatusCode::ABORTED) {
        AbortEverywhere();  // the others' waits on this part would only time out
      }
      return FromGrpc(s, part.address);
    }));
  }
  absl::Status status = local();
  if (!status.ok()) AbortEverywhere();
  for (std::future<absl::Status>& f : remote) {
    // A daemon cut off by a partition (not killed: no connection reset) never answers, and its
    // call would wait until TCP gives up, minutes later. Once a member is lost (heartbeats),
    // stop waiting for any part.
    while (f.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
      if (Lost().ok()) continue;
      for (const std::unique_ptr<grpc::ClientContext>& c : contexts) c->TryCancel();
    }
    absl::Status s = f.get();
    if (ErrorRank(s) > ErrorRank(status)) status = s;
  }
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  if (!status.ok()) {
    // Every daemon starts the next call from a fresh engine, with what it had before this one.
    runner_->ReleaseOutputs();
    ReleaseEngine();
    UndeployParts();
  }
  return status;
}

void Job::TellParts(PartNotice notice, std::chrono::seconds deadline) {
  std::vector<std::future<void>> sent;
  for (Part& part : parts_) {
    if (part.job_id.empty()) continue;  // its creation failed
    sent.push_back(std::async(std::launch::async, [&part, notice, deadline] {
      v1::JobRef ref;
      ref.set_job_id(part.job_id);
      v1::Empty empty;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + deadline);
      // Best effort: a part that does not answer is gone or cut off, and found lost anyway.
      ((*part.stub).*notice)(&context, ref, &empty).ok();
    }));
  }
  for (std::future<void>& f : sent) f.get();
}

void Job::AbortEverywhere() {
  if (aborting_.exchange(true)) return;
  AbortStep();
  // Briefly: a part cut off by a partition does not answer.
  TellParts(&v1::TrainingService::Stub::AbortStep, std::chrono::seconds(2));
}

void Job::UndeployParts() {
  if (!Lost().ok()) return;  // nothing to keep in step
  TellParts(&v1::TrainingService::Stub::Undeploy, std::chrono::seconds(30));
}

absl::Status Job::PushToParts(const std::map<std::string, at::Tensor>& state) {
  constexpr size_t kChunkBytes = 4 << 20;
  return OnParts(
      [&](Part& part, grpc::ClientContext& context) -> grpc::Status {
        v1::LoadStateDictResponse response;
        std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer =
            part.stub->LoadStateDict(&context, &response);
        v1::LoadStateDictRequest header;
        header.mutable_header()->set_job_id(part.job_id);
        header.mutable_header()->set_strict(false);
        bool ok = writer->Write(header);
        for (auto it = state.begin(); ok && it != state.end(); ++it) {
          const ParamStore::Entry* entry = store_.Find(it->first);
          absl::Status sent = EncodeStateChunks(
              it->first, it->second, entry != nullptr && !entry->is_parameter, kChunkBytes,
              [&](const v1::StateDictChunk& chunk) {
                v1::LoadStateDictRequest request;
                *request.mutable_chunk() = chunk;
                return writer->Write(request);
              });
          ok = sent.ok();
        }
        writer->WritesDone();
        return writer->Finish();
      },
      [] { return absl::OkStatus(); });
}

bool Job::MemberLost(const std::string& address, const std::string& reason) {
  const bool leader = config_.is_part && config_.engine_store_address == address;
  bool mine = leader;
  for (const JobConfig::Member& m : config_.members) mine = mine || m.address == address;
  if (!mine) return false;
  std::lock_guard<std::mutex> lock(lost_mu_);
  if (lost_.ok()) {
    lost_ = absl::UnavailableError(absl::StrCat(
        "daemon ", address, ", which ", leader ? "leads" : "runs part of",
        " this job, is lost (", reason,
        "); the job cannot go on: delete it and create it again once the cluster is whole"));
  }
  cancel_->store(true);
  return leader;
}

void Job::AbortStep() {
  std::lock_guard<std::mutex> lock(lost_mu_);
  cancel_->store(true);
}

absl::Status Job::Lost() {
  std::lock_guard<std::mutex> lock(lost_mu_);
  return lost_;
}

absl::StatusOr<at::Tensor> Job::PartTensor(const std::string& name, bool grad) {
  for (Part& part : parts_) {
    v1::GetParamRequest request;
    request.set_job_id(part.job_id);
    request.set_name(name);
    request.set_grad(grad);
    v1::GetParamResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::Status s = part.stub->GetParam(&context, request, &response);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) continue;  // held elsewhere
    if (!s.ok()) return absl::UnavailableError(absl::StrCat(part.address, ": ", s.error_message()));
    if (!response.has_value()) return at::Tensor();
    return DecodeTensor(response.tensor(), name, nullptr);
  }
  return absl::NotFoundError(absl::StrCat("no daemon of this job holds ", name));
}

absl::Status Job::AddMode(const ModelMode& mode, const std::string& model_bytes) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(model_bytes);
  if (!model.ok()) return model.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (model->input_names.size() != signature_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", mode.ToString(), " graph takes ", model->input_names.size(),
        " inputs; the job's model takes ", signature_.size()));
  }
  std::vector<c10::ScalarType> inputs;
  for (const InputSignature& in : signature_) inputs.push_back(in.dtype);
  absl::Status lowered = LowerPrecision(config_, &*model, inputs);
  if (!lowered.ok()) return lowered;
  return runner_->AddMode(mode, *model);
}

bool Job::SetMode(const ModelMode& mode) {
  std::lock_guard<std::mutex> lock(mu_);
  mode_ = mode;
  return runner_->HasMode(mode);
}

absl::StatusOr<std::vector<at::Tensor>> Job::Forward(const std::vector<at::Tensor>& inputs,
                                                     bool requires_grad,
                                                     bool delay_grad_allreduce) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status checked = CheckInputs(signature_, inputs);
  if (!checked.ok()) return checked;
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  absl::StatusOr<std::vector<at::Tensor>> outputs;
  if (mode_.training == config_.mode.training && mode_.dropout == config_.mode.dropout) {
    engine_forward_ = true;
    if (parts_.empty()) {
      absl::Status deployed = EnsureDeployed();
      if (!deployed.ok()) return deployed;
      engine_->SetDelayGradReduction(delay_grad_allreduce);
      outputs = engine_->Forward(inputs, requires_grad);
      if (!outputs.ok()) outputs = PartStatus(outputs.status());
      if (engine_->broken()) ReleaseEngine();
    } else {
      // Every daemon's part computes its devices' share; the shares add up to the outputs.
      v1::ForwardRequest request;
      request.set_requires_grad(requires_grad);
      request.set_delay_grad_allreduce(delay_grad_allreduce);
      for (const at::Tensor& t : inputs) {
        absl::Status encoded = EncodeTensor(t, request.add_inputs(), nullptr);
        if (!encoded.ok()) return encoded;
      }
      std::vector<std::vector<at::Tensor>> shares(parts_.size());
      absl::Status status = OnParts(
          [&](Part& part, grpc::ClientContext& context) -> grpc::Status {
            v1::ForwardRequest mine = request;
            mine.set_job_id(part.job_id);
            v1::ForwardResponse response;
            grpc::Status s = part.stub->Forward(&context, mine, &response);
            if (!s.ok()) return s;
            std::vector<at::Tensor>& out = shares[&part - parts_.data()];
            for (const v1::Tensor& t : response.outputs()) {
              absl::StatusOr<at::Tensor> decoded = DecodeTensor(t, "a part's output", nullptr);
              if (!decoded.ok()) {
                return grpc::Status(grpc::StatusCode::INTERNAL,
                                    std::string(decoded.status().message()));
              }
              out.push_back(*decoded);
            }
            return grpc::Status::OK;
          },
          [&]() -> absl::Status {
            absl::Status deployed = EnsureDeployed();
            if (!deployed.ok()) return deployed;
            engine_->SetDelayGradReduction(delay_grad_allreduce);
            outputs = engine_->Forward(inputs, requires_grad);
            return outputs.status();
          });
      if (status.ok()) {
        at::NoGradGuard no_grad;
        for (const std::vector<at::Tensor>& share : shares) {
          for (size_t i = 0; i < share.size() && i < outputs->size(); ++i) {
            (*outputs)[i] = (*outputs)[i] + share[i].to((*outputs)[i].scalar_type());
          }
        }
      } else {
        outputs = status;
      }
    }
  } else {
    // Another mode's graph runs whole on the host over the devices' current values; buffers it
    // updates (BatchNorm statistics in train mode) go back to the devices.
    engine_forward_ = false;
    if (parts_.empty()) {
      absl::Status deployed = EnsureDeployed();
      if (!deployed.ok()) return deployed;
    }
    SyncStore(/*grads=*/false);
    {
      AutocastGuard amp(config_.autocast());
      outputs = runner_->Forward(mode_, signature_, inputs, requires_grad);
    }
    std::map<std::string, at::Tensor> buffers;
    const std::vector<ParamStore::Entry>& entries = store_.entries();
    for (size_t e = 0; e < entries.size(); ++e) {
      if (entries[e].is_parameter || lifted_of_entry_[e] < 0) continue;
      if (engine_ && Held(lifted_of_entry_[e])) {
        engine_->SetParam(lifted_of_entry_[e], entries[e].tensor);
      }
      buffers[entries[e].name] = entries[e].tensor;
    }
    // Only a training-mode graph updates buffers (BatchNorm statistics).
    if (outputs.ok() && mode_.training && !parts_.empty() && !buffers.empty()) {
      absl::Status pushed = PushToParts(buffers);
      if (!pushed.ok()) outputs = pushed;
    }
  }
  if (outputs.ok()) ++forwards_;
  return outputs;
}

// ---------------------------------------------------------------------------------------------
// Several client ranks.

namespace {

using Grads = std::vector<std::pair<size_t, at::Tensor>>;

// The batch dimension of output `i` in the planned graph (-1: none, or an unknown output).
int OutputBatchDim(const IrGraph& ir, size_t i) {
  return i < ir.outputs.size() ? ir.values[ir.outputs[i]].batch_dim : -1;
}

}  // namespace

absl::StatusOr<std::vector<at::Tensor>> Job::Forward(int client_rank,
                                                     const std::vector<at::Tensor>& inputs,
                                                     bool requires_grad,
                                                     bool delay_grad_allreduce) {
  if (!client_ranks_) return Forward(inputs, requires_grad, delay_grad_allreduce);
  using Shares = std::vector<std::vector<at::Tensor>>;
  std::function<absl::StatusOr<Shares>(std::vector<std::vector<at::Tensor>>&)> run =
      [&](std::vector<std::vector<at::Tensor>>& all) -> absl::StatusOr<Shares> {
    const int world = static_cast<int>(all.size());
    if (!config_.gather_inputs) {
      absl::StatusOr<std::vector<at::Tensor>> out =
          Forward(all[0], requires_grad, delay_grad_allreduce);
      if (!out.ok()) return out.status();
      return Shares(world, *out);
    }
    std::vector<at::Tensor> gathered;
    std::vector<int64_t> rows(world, 0);
    absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "gathering inputs", [&] {
      for (size_t j = 0; j < all[0].size(); ++j) {
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r) {
          if (all[r].size() != all[0].size()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "client rank ", r, " passed ", all[r].size(), " inputs, rank 0 ",
                all[0].size()));
          }
          parts.push_back(all[r][j]);
          if (j == 0) rows[r] = all[r][j].dim() > 0 ? all[r][j].size(0) : 0;
        }
        gathered.push_back(at::cat(parts, 0));
      }
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    absl::StatusOr<std::vector<at::Tensor>> out =
        Forward(gathered, requires_grad, delay_grad_allreduce);
    if (!out.ok()) return out.status();
    int64_t total = 0;
    for (int64_t n : rows) total += n;
    rank_rows_ = rows;
    Shares shares(world);
    for (size_t i = 0; i < out->size(); ++i) {
      const at::Tensor& o = (*out)[i];
      const int bd = OutputBatchDim(*ir_, i);
      const bool batched = bd >= 0 && bd < o.dim() && total > 0 && o.size(bd) % total == 0;
      int64_t offset = 0;
      for (int r = 0; r < world; ++r) {
        if (!batched) {
          shares[r].push_back(o);
          continue;
        }
        const int64_t per_sample = o.size(bd) / total;
        shares[r].push_back(o.narrow(bd, offset * per_sample, rows[r] * per_sample).contiguous());
        offset += rows[r];
      }
    }
    return shares;
  };
  absl::StatusOr<Shares> shares =
      client_ranks_->Meet<std::vector<at::Tensor>, Shares>("forward", client_rank, inputs, run);
  if (!shares.ok()) return shares.status();
  return (*shares)[client_rank];
}

absl::Status Job::Backward(int client_rank, const Grads& output_grads, bool retain_graph,
                           bool delay_grad_allreduce) {
  if (!client_ranks_) return Backward(output_grads, retain_graph, delay_grad_allreduce);
  std::function<absl::StatusOr<bool>(std::vector<Grads>&)> run =
      [&](std::vector<Grads>& all) -> absl::StatusOr<bool> {
    if (!config_.gather_inputs) {
      absl::Status s = Backward(all[0], retain_graph, delay_grad_allreduce);
      if (!s.ok()) return s;
      return true;
    }
    const int world = static_cast<int>(all.size());
    std::map<size_t, std::vector<at::Tensor>> by_output;  // output -> per rank (maybe undefined)
    for (int r = 0; r < world; ++r) {
      for (const auto& [index, grad] : all[r]) {
        std::vector<at::Tensor>& slot = by_output[index];
        slot.resize(world);
        slot[r] = grad;
      }
    }
    Grads combined;
    absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "combining gradients",
                                    [&] {
      for (auto& [index, grads] : by_output) {
        const int bd = OutputBatchDim(*ir_, index);
        at::Tensor any;
        int any_rank = 0;
        for (int r = 0; r < world; ++r) {
          if (grads[r].defined()) {
            any = grads[r];
            any_rank = r;
          }
        }
        if (bd >= 0 && rank_rows_.size() == grads.size()) {
          // Each rank's rows, in rank order; a rank that sent none contributes zeros.
          std::vector<at::Tensor> parts;
          for (int r = 0; r < world; ++r) {
            if (grads[r].defined()) {
              parts.push_back(grads[r]);
            } else {
              std::vector<int64_t> shape = any.sizes().vec();
              shape[bd] =
                  any.size(bd) / std::max<int64_t>(rank_rows_[any_rank], 1) * rank_rows_[r];
              parts.push_back(at::zeros(shape, any.options()));
            }
          }
          combined.emplace_back(index, at::cat(parts, bd));
        } else {
          // A loss: every rank differentiates the same value; their gradients average.
          at::Tensor sum;
          int n = 0;
          for (const at::Tensor& g : grads) {
            if (!g.defined()) continue;
            sum = sum.defined() ? sum + g : g.clone();
            ++n;
          }
          combined.emplace_back(index, sum / n);
        }
      }
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    absl::Status s = Backward(combined, retain_graph, delay_grad_allreduce);
    if (!s.ok()) return s;
    return true;
  };
  return client_ranks_->Meet<Grads, bool>("backward", client_rank, output_grads, run).status();
}

absl::Status Job::Step(int client_rank, const std::vector<HyperParams>& hypers) {
  if (!client_ranks_) return Step(hypers);
  std::function<absl::StatusOr<bool>(std::vector<std::vector<HyperParams>>&)> run =
      [&](std::vector<std::vector<HyperParams>>& all) -> absl::StatusOr<bool> {
    absl::Status s = Step(all[0]);
    if (!s.ok()) return s;
    return true;
  };
  return client_ranks_
      ->Meet<std::vector<HyperParams>, bool>("step", client_rank, hypers, run)
      .status();
}

absl::Status Job::AllReduceGrads(int client_rank) {
  if (!client_ranks_) return AllReduceGrads();
  std::function<absl::StatusOr<bool>(std::vector<bool>&)> run =
      [&](std::vector<bool>&) -> absl::StatusOr<bool> {
    absl::Status s = AllReduceGrads();
    if (!s.ok()) return s;
    return true;
  };
  return client_ranks_->Meet<bool, bool>("allreduce_grads", client_rank, true, run).status();
}

absl::Status Job::ZeroGrad(int client_rank, bool set_to_none) {
  if (!client_ranks_) {
    ZeroGrad(set_to_none);
    return absl::OkStatus();
  }
  std::function<absl::StatusOr<bool>(std::vector<bool>&)> run =
      [&](std::vector<bool>& all) -> absl::StatusOr<bool> {
    ZeroGrad(all[0]);
    return true;
  };
  return client_ranks_->Meet<bool, bool>("zero_grad", client_rank, set_to_none, run).status();
}

absl::StatusOr<double> Job::ClipGradNorm(int client_rank, double max_norm, double norm_type) {
  if (!client_ranks_) return ClipGradNorm(max_norm, norm_type);
  std::function<absl::StatusOr<double>(std::vector<std::pair<double, double>>&)> run =
      [&](std::vector<std::pair<double, double>>& all) -> absl::StatusOr<double> {
    return ClipGradNorm(all[0].first, all[0].second);
  };
  return client_ranks_->Meet<std::pair<double, double>, double>(
      "clip_grad_norm", client_rank, {max_norm, norm_type}, run);
}

absl::Status Job::Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                           bool retain_graph, bool delay_grad_allreduce) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  if (!engine_) {
    return absl::FailedPreconditionError(
        "backward called with no forward pending (the job was undeployed since)");
  }
  if (engine_forward_) {
    engine_->SetDelayGradReduction(delay_grad_allreduce);
    if (parts_.empty()) {
      absl::Status status = PartStatus(engine_->Backward(output_grads, retain_graph));
      if (engine_->broken()) ReleaseEngine();
      return status;
    }
    v1::BackwardRequest request;
    request.set_retain_graph(retain_graph);
    request.set_delay_grad_allreduce(delay_grad_allreduce);
    for (const auto& [index, grad] : output_grads) {
      v1::OutputGrad* g = request.add_grads();
      g->set_output_index(static_cast<uint32_t>(index));
      absl::Status encoded = EncodeTensor(grad, g->mutable_grad(), nullptr);
      if (!encoded.ok()) return encoded;
    }
    return OnParts(
        [&](Part& part, grpc::ClientContext& context) {
          v1::BackwardRequest mine = request;
          mine.set_job_id(part.job_id);
          v1::Empty empty;
          return part.stub->Backward(&context, mine, &empty);
        },
        [&] { return engine_->Backward(output_grads, retain_graph); });
  }
  if (!parts_.empty()) {
    return absl::UnimplementedError(
        "backward through a graph traced in another mode than the job's (train/eval) is not "
        "supported for a job over several daemons; run that forward under torch.no_grad()");
  }
  absl::Status status = runner_->Backward(output_grads, retain_graph);
  if (!status.ok()) return status;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const at::Tensor& t = entries[e].tensor;
    if (lifted_of_entry_[e] < 0 || !t.grad().defined()) continue;
    engine_->AddGrad(lifted_of_entry_[e], t.grad());
    t.mutable_grad().reset();
  }
  return absl::OkStatus();
}

absl::Status Job::Step(const std::vector<HyperParams>& hypers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!config_.optimizer.enabled) {
    return absl::FailedPreconditionError(
        "the job was created without an optimizer; pass one to RaNNCModule to call step()");
  }
  if (GradsPending()) return NotReduced("optimizer step");
  auto local = [&] {
    absl::Status deployed = EnsureDeployed();
    if (!deployed.ok()) return deployed;
    return PartStatus(TorchCall(absl::StatusCode::kInternal, "optimizer step",
                                [&] { return engine_->Step(hypers); }));
  };
  absl::Status status = parts_.empty() ? local() : OnParts(
      [&](Part& part, grpc::ClientContext& context) {
        v1::StepRequest request;
        request.set_job_id(part.job_id);
        for (const HyperParams& h : hypers) *request.add_groups() = ToProto(h);
        v1::Empty empty;
        return part.stub->Step(&context, request, &empty);
      },
      local);
  if (status.ok()) ++steps_;
  return status;
}

absl::Status Job::AllReduceGrads() {
  std::lock_guard<std::mutex> lock(mu_);
  return ReduceGradsLocked();
}

absl::Status Job::ReduceGradsLocked() {
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  // Every daemon of the job has seen the same backwards, so what is pending here is pending on
  // each part: they all reduce, or none does.
  if (!GradsPending()) return absl::OkStatus();
  auto local = [&] {
    absl::Status deployed = EnsureDeployed();
    if (!deployed.ok()) return deployed;
    return PartStatus(engine_->AllReduceGrads());
  };
  if (parts_.empty()) {
    absl::Status status = local();
    if (engine_ && engine_->broken()) ReleaseEngine();
    return status;
  }
  return OnParts(
      [&](Part& part, grpc::ClientContext& context) {
        v1::AllReduceGradsRequest request;
        request.set_job_id(part.job_id);
        v1::Empty empty;
        return part.stub->AllReduceGrads(&context, request, &empty);
      },
      local);
}

void Job::ZeroGrad(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mu_);
  auto local = [&] {
    if (engine_) engine_->ZeroGrad(set_to_none);
    return absl::OkStatus();
  };
  if (parts_.empty()) {
    local().IgnoreError();
  } else {
    // A part that is gone fails the next forward, which names it.
    OnParts(
        [&](Part& part, grpc::ClientContext& context) {
          v1::ZeroGradRequest request;
          request.set_job_id(part.job_id);
          request.set_set_to_none(set_to_none);
          v1::Empty empty;
          return part.stub->ZeroGrad(&context, request, &empty);
        },
        local)
        .IgnoreError();
  }
  grad_shares_ = false;  // the store's gradients are zeroed below
  for (at::Tensor p : store_.Parameters()) {
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad.reset();
    } else {
      // As torch.nn.Module.zero_grad: a grad with history is detached before zeroing.
      if (grad.grad_fn()) {
        grad = grad.detach();
      } else {
        grad.requires_grad_(false);
      }
      grad.zero_();
    }
  }
}

std::vector<int> Job::ClippedParams() const {
  std::vector<int> params;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    if (entries[e].is_parameter && lifted_of_entry_[e] >= 0) params.push_back(lifted_of_entry_[e]);
  }
  return params;
}

absl::StatusOr<double> Job::ClipGradNorm(double max_norm, double norm_type) {
  std::lock_guard<std::mutex> lock(mu_);
  if (GradsPending()) return NotReduced("clip_grad_norm");
  if (!parts_.empty()) return ClipOverParts(max_norm, norm_type);
  if (engine_) {
    absl::StatusOr<double> total = 0.0;
    absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
      total = engine_->ClipGradNorm(ClippedParams(), max_norm, norm_type);
      return total.status();
    });
    if (!status.ok()) return status;
    return total;
  }
  double total = 0;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : store_.Parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return absl::OkStatus();
    const at::Tensor total_norm = TotalGradNorm(grads, norm_type);
    const at::Tensor clamped = ClipCoefficient(total_norm, max_norm);
    for (const at::Tensor& g : grads) g.detach().mul_(clamped);
    total = total_norm.item<double>();
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return total;
}

absl::StatusOr<double> Job::ClipOverParts(double max_norm, double norm_type) {
  // Round 1: every daemon's norms of the gradients it holds (a tied parameter held by several
  // reports the same all-reduced gradient: it is counted once).
  const std::vector<int> params = ClippedParams();
  std::map<int, at::Tensor> norms;  // by lifted index
  std::mutex norms_mu;
  auto keep = [&](int li, const at::Tensor& norm) {
    std::lock_guard<std::mutex> lock(norms_mu);
    norms.emplace(li, norm);
  };
  absl::Status status = OnParts(
      [&](Part& part, grpc::ClientContext& context) -> grpc::Status {
        v1::ClipGradNormRequest request;
        request.set_job_id(part.job_id);
        request.set_norm_type(norm_type);
        request.mutable_part()->set_phase(v1::ClipGradNormPart::NORMS);
        v1::ClipGradNormResponse response;
        grpc::Status s = part.stub->ClipGradNorm(&context, request, &response);
        if (!s.ok()) return s;
        if (response.norms_size() != response.norm_names_size()) {
          return grpc::Status(grpc::StatusCode::INTERNAL, "a part sent malformed norms");
        }
        for (int i = 0; i < response.norm_names_size(); ++i) {
          absl::StatusOr<at::Tensor> norm = DecodeTensor(response.norms(i), "a norm", nullptr);
          const ParamStore::Entry* entry = store_.Find(response.norm_names(i));
          if (!norm.ok() || entry == nullptr) {
            return grpc::Status(grpc::StatusCode::INTERNAL, "a part sent malformed norms");
          }
          keep(lifted_of_entry_[entry - store_.entries().data()], *norm);
        }
        return grpc::Status::OK;
      },
      [&]() -> absl::Status {
        absl::Status deployed = EnsureDeployed();
        if (!deployed.ok()) return deployed;
        return TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
          absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> mine =
              engine_->GradNorms(params, norm_type);
          if (!mine.ok()) return mine.status();
          for (auto& [li, norm] : *mine) keep(li, norm);
          return absl::OkStatus();
        });
      });
  if (!status.ok()) return status;
  std::vector<at::Tensor> ordered;  // in the client's parameter order, as PyTorch sums them
  for (int li : params) {
    auto it = norms.find(li);
    if (it != norms.end()) ordered.push_back(it->second);
  }
  if (ordered.empty()) return 0.0;
  // Round 2: every daemon scales its copies by the one coefficient.
  at::Tensor total, coefficient;
  status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    total = CombineNorms(ordered, norm_type);
    coefficient = ClipCoefficient(total, max_norm);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  v1::Tensor coefficient_proto;
  status = EncodeTensor(coefficient, &coefficient_proto, nullptr);
  if (!status.ok()) return status;
  status = OnParts(
      [&](Part& part, grpc::ClientContext& context) {
        v1::ClipGradNormRequest request;
        request.set_job_id(part.job_id);
        request.mutable_part()->set_phase(v1::ClipGradNormPart::SCALE);
        *request.mutable_part()->mutable_coefficient() = coefficient_proto;
        v1::ClipGradNormResponse response;
        return part.stub->ClipGradNorm(&context, request, &response);
      },
      [&] {
        engine_->ScaleGrads(params, coefficient);
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return total.item<double>();
}

absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> Job::GradNorms(
    double norm_type) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status deployed = EnsureDeployed();
  if (!deployed.ok()) return deployed;
  std::map<int, std::string> name_of_lifted;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) name_of_lifted[lifted_of_entry_[e]] = entries[e].name;
  std::vector<std::pair<std::string, at::Tensor>> out;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> norms =
        engine_->GradNorms(ClippedParams(), norm_type);
    if (!norms.ok()) return norms.status();
    for (auto& [li, norm] : *norms) out.emplace_back(name_of_lifted[li], norm);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return out;
}

absl::Status Job::ScaleGrads(const at::Tensor& coefficient) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!engine_) {
    return absl::FailedPreconditionError("clip_grad_norm: this part was undeployed meanwhile");
  }
  return TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    engine_->ScaleGrads(ClippedParams(), coefficient);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::optional<at::Tensor>> Job::GetTensor(const std::string& name, bool grad) {
  std::lock_guard<std::mutex> lock(mu_);
  const ParamStore::Entry* entry = store_.Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "the model has no parameter or buffer named '", name, "'"));
  }
  if (grad && !entry->is_parameter) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is a buffer; it has no gradient"));
  }
  if (grad && GradsPending()) {
    // On one daemon the engine reads a pending gradient as its holders' sum; over several, the
    // leading daemon reduces everywhere first, and a part holds only its share.
    if (config_.is_part) return NotReduced(absl::StrCat("gradient of '", name, "'"));
    if (!parts_.empty()) {
      absl::Status reduced = ReduceGradsLocked();
      if (!reduced.ok()) return Annotate(reduced, "all-reducing the gradients to read them");
    }
  }
  const int lifted = lifted_of_entry_[entry - store_.entries().data()];
  if (lifted >= 0 && !Held(lifted)) {
    if (config_.is_part) {
      return absl::NotFoundError(absl::StrCat("'", name, "' is held by another daemon's part"));
    }
    absl::StatusOr<at::Tensor> t = PartTensor(name, grad);
    if (!t.ok()) return t.status();
    if (!t->defined()) return std::optional<at::Tensor>();
    return std::optional<at::Tensor>(*t);
  }
  if (engine_ && lifted >= 0) {
    at::Tensor t = grad ? engine_->GradAt(lifted) : engine_->ParamAt(lifted);
    if (!t.defined()) return std::optional<at::Tensor>();
    return std::optional<at::Tensor>(t);
  }
  if (!grad) return std::optional<at::Tensor>(entry->tensor.detach().clone());
  const at::Tensor& g = entry->tensor.grad();
  if (!g.defined()) return std::optional<at::Tensor>();
  return std::optional<at::Tensor>(g.detach().clone());
}

std::vector<StateEntry> Job::StateDict() {
  std::lock_guard<std::mutex> lock(mu_);
  SyncStore(/*grads=*/false);
  std::vector<StateEntry> state;
  for (const std::string& key : store_.state_keys()) {
    const ParamStore::Entry* entry = store_.Find(key);
    state.push_back({key, entry->tensor.detach().clone(), !entry->is_parameter});
  }
  return state;
}

absl::Status Job::LoadStateDict(const std::map<std::string, at::Tensor>& state, bool strict,
                                std::vector<std::string>* missing,
                                std::vector<std::string>* unexpected) {
  std::lock_guard<std::mutex> lock(mu_);
  // Entries the state leaves out keep the devices' values.
  SyncStore(/*grads=*/false);
  absl::Status loaded = store_.Load(state, strict, missing, unexpected);
  if (!loaded.ok()) return loaded;
  if (engine_) {
    const std::vector<ParamStore::Entry>& entries = store_.entries();
    for (size_t e = 0; e < entries.size(); ++e) {
      const int li = lifted_of_entry_[e];
      if (li >= 0 && Held(li)) engine_->SetParam(li, entries[e].tensor);
    }
  }
  if (parts_.empty()) return absl::OkStatus();
  // The parts take what they hold, deployed or not (an undeployed part deploys from its store).
  std::map<std::string, at::Tensor> known;
  for (const auto& [key, value] : state) {
    if (store_.Find(key) != nullptr) known.emplace(key, value);
  }
  return Annotate(PushToParts(known), "loading the state into the job's other daemons");
}

void Job::Undeploy() {
  std::lock_guard<std::mutex> lock(mu_);
  runner_->ReleaseOutputs();
  ReleaseEngine();
  UndeployParts();
  state_ = JobState::kUndeployed;
}

absl::Status Job::RecreateCommunicators() {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  if (!engine_) return absl::OkStatus();  // undeployed: the next forward builds them
  runner_->ReleaseOutputs();
  auto local = [&] {
    ReleaseEngine();
    return Annotate(Deploy(), "recreating the job's communicators");
  };
  if (parts_.empty()) return local();
  // Every part rebuilds its engine at once, its communicators meeting this daemon's new ones.
  return OnParts(
      [&](Part& part, grpc::ClientContext& context) {
        v1::JobRef ref;
        ref.set_job_id(part.job_id);
        v1::Empty empty;
        return part.stub->RecreateCommunicators(&context, ref, &empty);
      },
      local);
}

JobSummary Job::Summary() {
  std::lock_guard<std::mutex> lock(mu_);
  JobSummary s;
  s.id = id_;
  s.name = config_.name;
  s.state = state_;
  s.num_params = store_.NumParameterElements();
  s.steps = steps_;
  s.forwards = forwards_;
  s.devices = devices_;
  for (int d : deployment_devices()) {
    s.device_bytes.push_back(engine_ ? engine_->DeviceBytes(d) : 0);
    s.peak_device_bytes.push_back(engine_ ? engine_->PeakDeviceBytes(d) : 0);
  }
  const LossScaler& scaler = engine_ ? engine_->loss_scaler() : parked_loss_scaler_;
  s.loss_scale = scaler.scale();
  s.skipped_steps = scaler.skipped_steps();
  s.created = created_;
  return s;
}

}  // namespace rannc
