#include "daemon/server/job_model.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>
#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/graph/low_precision.h"
#include "daemon/optim/optimizer.h"
#include "daemon/planner/deployment.h"
#include "daemon/planner/planner.h"
#include "daemon/runtime/autocast.h"

namespace rannc {
namespace {

absl::Status CheckExampleCount(const ImportedModel& model,
                               const std::vector<at::Tensor>& example_inputs) {
  if (model.input_names.size() == example_inputs.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the model's forward takes ", model.input_names.size(), " inputs (",
      absl::StrJoin(model.input_names, ", "), "), but ", example_inputs.size(),
      " example inputs were given"));
}
// The plan of the checkpoint a job resumes from (the manifest's), if it fits this model and
// these devices; NOT_FOUND when there is no checkpoint or it holds no plan, else why not.
absl::StatusOr<v1::Deployment> CheckpointPlan(const JobSettings& config, const IrGraph& ir) {
  absl::StatusOr<std::string> job_dir = checkpoint::JobDir(config.checkpoints.dir, config.name);
  if (!job_dir.ok()) return job_dir.status();
  absl::StatusOr<v1::CheckpointManifest> m =
      checkpoint::FindCheckpoint(*job_dir, config.checkpoints.resume);
  if (!m.ok()) return m.status();
  if (!m->has_deployment() || m->deployment().stages_size() == 0) {
    return absl::NotFoundError("the checkpoint records no plan");
  }
  v1::Deployment plan = m->deployment();
  plan.clear_saved_trace();
  plan.set_loaded(false);
  planner::PlanTarget target = config.plan_target;
  if (target.batch_size <= 0) target.batch_size = ir.example_batch;
  absl::Status fits = planner::CheckDeployment(plan, ir, target);
  if (!fits.ok()) return fits;
  spdlog::info("job '{}' resumes with the plan of its checkpoint of step {}", config.name,
               m->step());
  return plan;
}

// The plan for `ir`: the deployment the client loaded, or a resumed job's checkpoint's, checked
// against this model and these devices; else planned for config.plan_target.
absl::StatusOr<v1::Deployment> PlanIr(const JobSettings& config, const IrGraph& ir,
                                      const std::vector<at::Tensor>& tensors,
                                      const std::vector<at::Tensor>& example_inputs) {
  // A resumed job keeps its plan where it can: another plan sums gradients in another order,
  // so training would go on equally well but not bit for bit as the interrupted run would have
  // (and the planner's choice between plans of about equal cost follows the measured link
  // speeds, which vary from one daemon start to the next). Not when the job asks for a shape
  // (partition_num, pipeline_num, replica_num): then it gets what it asks for.
  const planner::PlannerConfig& shape = config.planner;
  if (config.load_deployment.empty() && config.checkpoints.resume >= 0 &&
      !config.checkpoints.dir.empty() && shape.partition_num == 0 && shape.pipeline_num == 0 &&
      shape.replica_num == 0) {
    absl::StatusOr<v1::Deployment> kept = CheckpointPlan(config, ir);
    if (kept.ok()) return kept;
    if (kept.status().code() != absl::StatusCode::kNotFound) {
      spdlog::info("job '{}' is planned afresh: its checkpoint's plan does not fit: {}",
                   config.name, std::string(kept.status().message()));
    }
  }
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
                                MemoryModelFor(config, zero, offload),
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


}  // namespace

planner::MemoryModel MemoryModelFor(const JobSettings& settings, bool zero, bool offload) {
  const OptimizerConfig& config = settings.optimizer;
  planner::MemoryModel m;
  m.zero = zero;
  m.offload = offload;
  // Autocast's low-precision copies of the fp32 weights, kept by each micro-batch in flight.
  const AmpDtype autocast = settings.autocast();
  if (autocast.has_value()) m.amp_cast_factor = c10::elementSize(*autocast) / 4.0;
  if (!config.enabled) return m;
  m.optimizer = config.Name();
  m.optimizer_state_factor = 0;
  for (const HyperParams& h : config.group_hyper) {
    m.optimizer_state_factor =
        std::max<double>(m.optimizer_state_factor, StateTensorsPerElement(config.kind, h));
  }
  if (config.scripted != nullptr) {  // every key but "step" is a tensor like the param
    for (const std::string& key : config.scripted->state_keys) {
      if (!IsScalarOptimizerState(key)) m.optimizer_state_factor += 1;
    }
  }
  return m;
}

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
absl::Status CheckOptimizer(const OptimizerConfig& config, const ParamStore& store) {
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
  // The devices' optimizers are made by the engine; this one only proves the groups.
  absl::StatusOr<std::unique_ptr<Optimizer>> made =
      MakeOptimizer(config.kind, std::move(groups), config.scripted);
  return made.status();
}
// With amp_level=O2, the imported forward rewritten to compute in the AMP dtype from end to end
// (graph/low_precision.h); `inputs`: the job's inputs, whose floating ones are cast on entry.
absl::Status LowerPrecision(const JobSettings& config, ImportedModel* model,
                            const std::vector<c10::ScalarType>& inputs) {
  if (!config.amp_o2) return absl::OkStatus();
  return CastForwardTo(model, *config.amp, inputs);
}
// The client's archive as a job (or a dry run) takes it: the sent tensors in place of their
// stand-ins, none left unbound, as many forward inputs as example inputs, and the forward
// lowered for amp_level=O2.
absl::StatusOr<ImportedModel> ImportJobModel(const JobSettings& config,
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
// The model's IR (for the store's tensors) and its plan.
absl::StatusOr<PlannedModel> PlanJobModel(const JobSettings& config, const ImportedModel& model,
                                          const ParamStore& store,
                                          const std::vector<at::Tensor>& example_inputs) {
  std::vector<at::Tensor> tensors;
  for (const std::string& name : model.graph_tensor_names) {
    tensors.push_back(store.Find(name)->tensor);
  }
  const auto start = std::chrono::steady_clock::now();
  // At O1 on CUDA devices the values' dtypes are CUDA autocast's, whose lists differ from the
  // CPU's the host probes run under: stages then send each other what they compute, uncast.
  IrOptions options;
  for (const c10::Device& d : config.placement) {
    if (d.is_cuda() && config.autocast().has_value()) options.dtype_device = d;
  }
  absl::StatusOr<IrGraph> ir;
  {
    AutocastGuard cuda_amp(options.dtype_device ? config.autocast() : AmpDtype(), /*cuda=*/true);
    ir = BuildIr(model, tensors, example_inputs, options);
  }
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
absl::StatusOr<v1::Deployment> PlanJob(const JobSettings& config, const std::string& model_bytes,
                                       const std::vector<at::Tensor>& example_inputs,
                                       const SentTensors& sent, std::vector<IndexBound>* bounds) {
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
  if (bounds != nullptr) *bounds = FindIndexBounds(*planned->ir);
  return std::move(planned->plan);
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

}  // namespace rannc
