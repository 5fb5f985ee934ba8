// Runs one pipeline stage (a Subgraph of the model's IR) on one device with LibTorch's
// interpreter and autograd, one micro-batch at a time: Forward keeps what that micro-batch's
// backward needs, Backward takes the gradients of the stage's outputs and returns those of its
// activation inputs (what the previous stage needs), accumulating parameter gradients into the
// device's parameter leaves. Micro-batches are independent, so a schedule may interleave them
// (1F1B) or run all forwards first (GPipe).
//
//   absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
//       StageExecutor::Create(ir, std::move(subgraph), device_tensors);
//   auto out = (*stage)->Forward(/*micro_batch=*/0, inputs, /*requires_grad=*/true);
//   auto input_grads = (*stage)->Backward(0, output_grads);
//
// Not thread-safe: the stage's device worker owns it. The tensors it is given (parameters and
// buffers of the device) must outlive it.
#ifndef RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_
#define RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_

#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/subgraph.h"

namespace torch {
namespace jit {
struct Code;
}  // namespace jit
}  // namespace torch

namespace rannc {

class StageExecutor {
 public:
  // `lifted`: the device's tensor for each of the IR's lifted inputs (IrGraph::tensor_names
  // order); the stage keeps the ones its subgraph reads.
  static absl::StatusOr<std::unique_ptr<StageExecutor>> Create(
      const IrGraph& ir, Subgraph subgraph, const std::vector<at::Tensor>& lifted);
  ~StageExecutor();

  // The IR values the stage reads that are not parameters or buffers (client inputs and other
  // stages' activations), in the order Forward takes them; and the values it produces.
  const std::vector<int>& data_inputs() const { return data_inputs_; }
  const std::vector<int>& outputs() const { return subgraph_.outputs; }

  // FAILED_PRECONDITION when `micro_batch` already has a forward pending.
  absl::StatusOr<std::vector<at::Tensor>> Forward(int micro_batch,
                                                  const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad);
  // One gradient per output (undefined: the output gets none). Returns one gradient per data
  // input (undefined for inputs that are not differentiable or got none). Releases the
  // micro-batch.
  absl::StatusOr<std::vector<at::Tensor>> Backward(int micro_batch,
                                                   const std::vector<at::Tensor>& output_grads);
  // Drops a pending micro-batch (a forward without gradients, or an abandoned step).
  void Release(int micro_batch) { pending_.erase(micro_batch); }
  size_t pending() const { return pending_.size(); }

 private:
  StageExecutor() = default;

  struct Pending {
    std::vector<at::Tensor> inputs;   // data inputs, as leaves where differentiable
    std::vector<at::Tensor> outputs;
  };

  Subgraph subgraph_;
  std::shared_ptr<torch::jit::Module> module_;  // keeps call stacks alive (see ImportedModel)
  std::shared_ptr<torch::jit::Code> code_;
  std::vector<int> data_inputs_;
  // Per subgraph input: index into the data inputs, or -1 for a lifted tensor.
  std::vector<int> input_slot_;
  std::vector<at::Tensor> lifted_;  // per subgraph input (undefined for data inputs)
  std::map<int, Pending> pending_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_
