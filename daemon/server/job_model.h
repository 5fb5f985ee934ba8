// A job's model, from the client's archive to a plan: import (the sent tensors in place of their
// stand-ins, the forward lowered for amp_level=O2), the checks RaNNC makes (unused inputs and
// parameters, the optimizer's groups), the IR and the plan (planned with the auto_memory
// retries, or a loaded deployment checked), and the maps from the host master's entries to the
// IR's lifted tensors. gRPC-free; every function is pure apart from the planner's profiling
// (which runs the model) and logging; thread-safe.
//
//   absl::StatusOr<ImportedModel> model = ImportJobModel(settings, bytes, sent, examples);
//   absl::StatusOr<PlannedModel> planned = PlanJobModel(settings, *model, store, examples);
#ifndef RANNC_DAEMON_SERVER_JOB_MODEL_H_
#define RANNC_DAEMON_SERVER_JOB_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/graph/index_bounds.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/planner/planner.h"
#include "daemon/runtime/param_store.h"
#include "daemon/server/job_settings.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

// The client's archive as a job (or a dry run) takes it: the sent tensors in place of their
// stand-ins, none left unbound, as many forward inputs as example inputs, and the forward
// lowered for amp_level=O2. INVALID_ARGUMENT otherwise.
absl::StatusOr<ImportedModel> ImportJobModel(const JobSettings& settings,
                                             const std::string& model_bytes,
                                             const SentTensors& sent,
                                             const std::vector<at::Tensor>& example_inputs);

// With amp_level=O2, `model`'s forward rewritten to compute in the AMP dtype from end to end
// (graph/low_precision.h); `inputs`: the job's input dtypes, whose floating ones are cast on
// entry. A no-op otherwise.
absl::Status LowerPrecision(const JobSettings& settings, ImportedModel* model,
                            const std::vector<c10::ScalarType>& inputs);

// What the planner counts per trainable parameter byte of a job with these memory switches:
// its optimizer's state (sharded with `zero`, in host memory with `offload`) and autocast's
// low-precision copies of the weights, which the profiler does not see (planner::MemoryModel).
// None at amp_level=O2: its casts are ops of the graph, whose copies the profiler measures.
planner::MemoryModel MemoryModelFor(const JobSettings& settings, bool zero, bool offload);

// RaNNC's check_unused_values: every forward input and parameter is used.
absl::Status CheckUnusedValues(const ImportedModel& model, const ParamStore& store);

// The optimizer's param groups name parameters, each once, and valid hyper-parameters.
absl::Status CheckOptimizer(const OptimizerConfig& config, const ParamStore& store);

struct PlannedModel {
  std::unique_ptr<IrGraph> ir;
  v1::Deployment plan;
  double ir_s = 0;
  double plan_s = 0;
};

// The model's IR (for the store's tensors) and its plan for settings.plan_target, or the
// loaded deployment (settings.load_deployment) checked against both. RESOURCE_EXHAUSTED when no
// plan fits, after the auto_memory retries (ZeRO, offload). Runs under the caller's autocast.
absl::StatusOr<PlannedModel> PlanJobModel(const JobSettings& settings, const ImportedModel& model,
                                          const ParamStore& store,
                                          const std::vector<at::Tensor>& example_inputs);

// A dry run: the same checks and planning as a job's creation, with no job. With `bounds`, also
// the ranges the model's integer inputs must keep to (graph/index_bounds.h).
absl::StatusOr<v1::Deployment> PlanJob(const JobSettings& settings, const std::string& model_bytes,
                                       const std::vector<at::Tensor>& example_inputs,
                                       const SentTensors& sent = {},
                                       std::vector<IndexBound>* bounds = nullptr);

// Per store entry, the IR lifted index of its tensor (under its name or an alias), or -1 when
// the graph never reads it.
std::vector<int> LiftedOfEntries(const ParamStore& store, const IrGraph& ir);

// The optimizer's param groups as lifted indices (parameters the graph never reads have no
// gradient, so no optimizer state either, and are left out).
std::vector<std::vector<int>> OptimizerGroups(const OptimizerConfig& config,
                                              const ParamStore& store,
                                              const std::vector<int>& lifted_of_entry);

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_MODEL_H_
