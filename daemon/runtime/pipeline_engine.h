// Runs a planned job (a v1::Deployment) on N devices: pipeline stages, each with data-parallel
// replicas, one worker thread per device. A training step splits the client's batch into the
// plan's micro-batches and each micro-batch over a stage's replicas; every device runs
// StageOps(schedule, stage, S, m) on its StageExecutor, exchanging activations and their
// gradients with the other stages' replicas over a communicator covering all devices (resharded
// when replica counts differ), and ends by all-reducing its parameter gradients over its stage's
// replicas (tied parameters, read by several stages, over every device). See docs/runtime.md.
//
//   absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
//       ir, plan, lifted_tensors, comm::Backend::kUcx, /*num_devices=*/4);
//   absl::StatusOr<StepResult> step = (*engine)->TrainStep(batch_inputs);
//   (*engine)->ApplySgd(0.1);
//   (*engine)->ZeroGrad();
//
// The loss is the model's first output (IrValue::is_loss), combined as the batch-weighted mean;
// backward is fused with forward, assuming the client's output gradient is 1. Outputs other than
// the loss are computed but not returned yet.
//
// The IrGraph must outlive the engine. Methods must be called from one thread at a time. A step
// that fails (any worker's first error, annotated with the device and stage; a transfer that
// does not complete within the timeout) leaves the engine broken: later steps fail with
// FAILED_PRECONDITION.
#ifndef RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_
#define RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/comm/factory.h"
#include "daemon/graph/ir.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

struct StepResult {
  at::Tensor loss;  // 0-dim: the batch-weighted mean of every shard's loss
};

class PipelineEngine {
 public:
  // `lifted`: the host master of each of the IR's lifted inputs (IrGraph::tensor_names order);
  // each device gets its own copies of the ones its stage reads (parameters become leaves
  // requiring grad). INVALID_ARGUMENT when the plan does not fit the IR or the devices.
  static absl::StatusOr<std::unique_ptr<PipelineEngine>> Create(
      const IrGraph& ir, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
      comm::Backend backend, int num_devices,
      std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~PipelineEngine();

  // One forward and backward over `inputs` (the model's user inputs, the whole batch).
  // Parameter gradients accumulate (as PyTorch's do) until ZeroGrad.
  absl::StatusOr<StepResult> TrainStep(const std::vector<at::Tensor>& inputs);

  // A copy of the gradient (undefined tensor: none yet) / value of a parameter: replica 0's of
  // the first stage holding it, or `device`'s (after a step every holder has the same).
  // NOT_FOUND for a name no stage (or `device`) holds; Grad also for a buffer.
  absl::StatusOr<at::Tensor> Grad(const std::string& tensor_name, int device = -1) const;
  absl::StatusOr<at::Tensor> Param(const std::string& tensor_name, int device = -1) const;

  void ZeroGrad();
  // p -= lr * grad on every device's copy of every parameter that has a gradient.
  void ApplySgd(double lr);

  class Impl;

 private:
  explicit PipelineEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_
