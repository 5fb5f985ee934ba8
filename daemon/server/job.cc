#include "daemon/server/job.h"

#include <cmath>
#include <limits>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status.h"
#include "daemon/graph/ir.h"
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

uint64_t Bytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

absl::Status CheckExampleCount(const ImportedModel& model,
                               const std::vector<at::Tensor>& example_inputs) {
  if (model.input_names.size() == example_inputs.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the model's forward takes ", model.input_names.size(), " inputs (",
      absl::StrJoin(model.input_names, ", "), "), but ", example_inputs.size(),
      " example inputs were given"));
}

// Optimizer state in multiples of the trainable parameters' size.
planner::MemoryModel MemoryModelFor(const OptimizerConfig& config) {
  planner::MemoryModel m;
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

// The model's IR and its plan: planned for config.plan_target, or the deployment the client
// loaded, checked against this model and these devices.
absl::StatusOr<v1::Deployment> PlanJobModel(const JobConfig& config, const ImportedModel& model,
                                            const ParamStore& store,
                                            const std::vector<at::Tensor>& example_inputs) {
  std::vector<at::Tensor> tensors;
  for (const std::string& name : model.graph_tensor_names) tensors.push_back(store.Find(name)->tensor);
  absl::StatusOr<IrGraph> ir = BuildIr(model, tensors, example_inputs);
  if (!ir.ok()) return Annotate(ir.status(), "building the model's IR");
  if (!config.load_deployment.empty()) {
    v1::Deployment loaded;
    if (!loaded.ParseFromString(config.load_deployment)) {
      return absl::InvalidArgumentError(
          "load_deployment: the file is not a deployment (a serialized rannc.v1.Deployment)");
    }
    planner::PlanTarget target = config.plan_target;
    target.batch_size = ir->example_batch;
    absl::Status fits = planner::CheckDeployment(loaded, *ir, target);
    if (!fits.ok()) return Annotate(fits, "load_deployment");
    loaded.set_loaded(true);
    return loaded;
  }
  absl::StatusOr<v1::Deployment> plan =
      planner::PlanModel(*ir, tensors, example_inputs, config.plan_target,
                         MemoryModelFor(config.optimizer), config.planner, config.profile_cache,
                         config.created_by);
  if (!plan.ok()) return Annotate(plan.status(), "planning the model");
  return plan;
}

// What a job holds on its device besides activations: parameters, their gradients, optimizer
// state and buffers. RESOURCE_EXHAUSTED when that alone exceeds the device's budget.
absl::Status CheckMemoryBudget(const JobConfig& config, const ParamStore& store) {
  if (config.device_memory_bytes == 0) return absl::OkStatus();
  uint64_t params = 0, buffers = 0;
  for (const ParamStore::Entry& e : store.entries()) (e.is_parameter ? params : buffers) += Bytes(e.tensor);
  const uint64_t state_per_param =
      static_cast<uint64_t>(MemoryModelFor(config.optimizer).optimizer_state_factor);
  const uint64_t need = params * (2 + state_per_param) + buffers;
  if (need <= config.device_memory_bytes) return absl::OkStatus();
  auto mib = [](uint64_t b) { return absl::StrCat(b >> 20, " MiB"); };
  return absl::ResourceExhaustedError(absl::StrCat(
      "the job needs at least ", mib(need), " on ", config.device, " (parameters ", mib(params),
      ", gradients ", mib(params), ", optimizer state ", mib(params * state_per_param),
      ", buffers ", mib(buffers), ") but the device's budget is ",
      mib(config.device_memory_bytes), "; raise ranncd's --device-memory"));
}

}  // namespace

Job::Job(std::string id, JobConfig config)
    : id_(std::move(id)),
      config_(std::move(config)),
      created_(std::chrono::system_clock::now()),
      devices_{config_.device},
      mode_(config_.mode) {}

absl::StatusOr<std::unique_ptr<Job>> Job::Create(std::string id, JobConfig config,
                                                 const std::string& model_bytes,
                                                 const std::vector<at::Tensor>& example_inputs) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(model_bytes);
  if (!model.ok()) return model.status();
  absl::Status counted = CheckExampleCount(*model, example_inputs);
  if (!counted.ok()) return counted;
  std::unique_ptr<Job> job(new Job(std::move(id), std::move(config)));
  job->store_ = ParamStore::FromModuleTensors(model->tensors);
  absl::Status fits = CheckMemoryBudget(job->config_, job->store_);
  if (!fits.ok()) return fits;
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
    absl::StatusOr<std::unique_ptr<Optimizer>> optimizer =
        BuildOptimizer(job->config_.optimizer, job->store_);
    if (!optimizer.ok()) return optimizer.status();
    job->optimizer_ = std::move(*optimizer);
  }

  // The validation run must not advance BatchNorm statistics: the job starts from exactly the
  // client's state.
  std::vector<at::Tensor> saved_buffers;
  for (const ParamStore::Entry& e : job->store_.entries()) {
    if (!e.is_parameter) saved_buffers.push_back(e.tensor.clone());
  }
  absl::StatusOr<std::vector<at::Tensor>> outputs =
      job->runner_->Forward(job->mode_, job->signature_, example_inputs, /*requires_grad=*/false);
  if (!outputs.ok()) {
    return Annotate(outputs.status(), "checking the model on the example inputs");
  }
  job->example_outputs_ = std::move(*outputs);
  {
    size_t b = 0;
    at::NoGradGuard no_grad;
    for (const ParamStore::Entry& e : job->store_.entries()) {
      if (!e.is_parameter) e.tensor.copy_(saved_buffers[b++]);
    }
  }
  absl::StatusOr<v1::Deployment> plan =
      PlanJobModel(job->config_, *model, job->store_, example_inputs);
  if (!plan.ok()) return plan.status();
  job->deployment_ = std::move(*plan);
  return job;
}

absl::StatusOr<v1::Deployment> Job::PlanOnly(const JobConfig& config,
                                              const std::string& model_bytes,
                                              const std::vector<at::Tensor>& example_inputs) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(model_bytes);
  if (!model.ok()) return model.status();
  absl::Status counted = CheckExampleCount(*model, example_inputs);
  if (!counted.ok()) return counted;
  ParamStore store = ParamStore::FromModuleTensors(model->tensors);
  if (config.check_unused_values) {
    absl::Status unused = CheckUnusedValues(*model, store);
    if (!unused.ok()) return unused;
  }
  return PlanJobModel(config, *model, store, example_inputs);
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
  return runner_->AddMode(mode, *model);
}

bool Job::SetMode(const ModelMode& mode) {
  std::lock_guard<std::mutex> lock(mu_);
  mode_ = mode;
  return runner_->HasMode(mode);
}

absl::StatusOr<std::vector<at::Tensor>> Job::Forward(const std::vector<at::Tensor>& inputs,
                                                     bool requires_grad) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = JobState::kDeployed;
  absl::StatusOr<std::vector<at::Tensor>> outputs =
      runner_->Forward(mode_, signature_, inputs, requires_grad);
  if (outputs.ok()) ++forwards_;
  return outputs;
}

absl::Status Job::Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                           bool retain_graph) {
  std::lock_guard<std::mutex> lock(mu_);
  return runner_->Backward(output_grads, retain_graph);
}

absl::Status Job::Step(const std::vector<HyperParams>& hypers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (optimizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "the job was created without an optimizer; pass one to RaNNCModule to call step()");
  }
  absl::Status status = TorchCall(absl::StatusCode::kInternal, "optimizer step",
                                  [&] { return optimizer_->Step(hypers); });
  if (status.ok()) ++steps_;
  return status;
}

void Job::ZeroGrad(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mu_);
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

absl::StatusOr<double> Job::ClipGradNorm(double max_norm, double norm_type) {
  std::lock_guard<std::mutex> lock(mu_);
  double total = 0;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : store_.Parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return absl::OkStatus();
    // The same reductions, in the same order, as torch.nn.utils.clip_grad_norm_ (1.13).
    at::Tensor total_norm;
    std::vector<at::Tensor> norms;
    if (std::isinf(norm_type)) {
      for (const at::Tensor& g : grads) norms.push_back(g.detach().abs().max());
      total_norm = norms.size() == 1 ? norms[0] : at::stack(norms).max();
    } else {
      for (const at::Tensor& g : grads) norms.push_back(at::norm(g.detach(), norm_type));
      total_norm = at::norm(at::stack(norms), norm_type);
    }
    at::Tensor clip_coef = max_norm / (total_norm + 1e-6);
    at::Tensor clamped = at::clamp_max(clip_coef, 1.0);
    for (const at::Tensor& g : grads) g.detach().mul_(clamped);
    total = total_norm.item<double>();
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return total;
}

absl::StatusOr<std::optional<at::Tensor>> Job::GetTensor(const std::string& name, bool grad) {
  std::lock_guard<std::mutex> lock(mu_);
  const ParamStore::Entry* entry = store_.Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "the model has no parameter or buffer named '", name, "'"));
  }
  if (!grad) return std::optional<at::Tensor>(entry->tensor.detach().clone());
  if (!entry->is_parameter) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is a buffer; it has no gradient"));
  }
  const at::Tensor& g = entry->tensor.grad();
  if (!g.defined()) return std::optional<at::Tensor>();
  return std::optional<at::Tensor>(g.detach().clone());
}

std::vector<StateEntry> Job::StateDict() {
  std::lock_guard<std::mutex> lock(mu_);
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
  return store_.Load(state, strict, missing, unexpected);
}

void Job::Undeploy() {
  std::lock_guard<std::mutex> lock(mu_);
  // One host device: parameters already live in host memory; what frees is the autograd graph
  // of a pending forward. Later issues move device-resident state to the host here.
  runner_->ReleaseOutputs();
  state_ = JobState::kUndeployed;
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
  s.created = created_;
  return s;
}

}  // namespace rannc
