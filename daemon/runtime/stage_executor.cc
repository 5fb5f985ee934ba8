#include "daemon/runtime/stage_executor.h"

#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"

namespace rannc {

StageExecutor::~StageExecutor() = default;

absl::StatusOr<std::unique_ptr<StageExecutor>> StageExecutor::Create(
    const IrGraph& ir, Subgraph subgraph, const std::vector<at::Tensor>& lifted) {
  if (lifted.size() != ir.tensor_names.size()) {
    return absl::InternalError(absl::StrCat("StageExecutor: ", lifted.size(),
                                            " lifted tensors for ", ir.tensor_names.size()));
  }
  std::unique_ptr<StageExecutor> stage(new StageExecutor());
  stage->module_ = ir.module;
  for (int v : subgraph.inputs) {
    const int lifted_index = v - static_cast<int>(ir.num_user_inputs);
    const bool is_lifted = v < static_cast<int>(ir.inputs.size()) && lifted_index >= 0;
    if (is_lifted) {
      stage->input_slot_.push_back(-1);
      stage->lifted_.push_back(lifted[lifted_index]);
    } else {
      stage->input_slot_.push_back(static_cast<int>(stage->data_inputs_.size()));
      stage->data_inputs_.push_back(v);
      stage->lifted_.emplace_back();
    }
  }
  absl::Status compiled = TorchCall(absl::StatusCode::kInternal, "compiling a stage", [&] {
    stage->code_ = std::make_shared<torch::jit::Code>(subgraph.graph, "stage");
    return absl::OkStatus();
  });
  if (!compiled.ok()) return compiled;
  stage->subgraph_ = std::move(subgraph);
  return stage;
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::Forward(
    int micro_batch, const std::vector<at::Tensor>& inputs, bool requires_grad) {
  if (inputs.size() != data_inputs_.size()) {
    return absl::InternalError(absl::StrCat("stage forward: ", inputs.size(), " inputs for ",
                                            data_inputs_.size()));
  }
  if (pending_.count(micro_batch)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage forward: micro-batch ", micro_batch, " already has a forward pending"));
  }
  Pending pending;
  std::vector<at::Tensor> outputs;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "the stage's forward failed",
                                  [&] {
    std::optional<at::NoGradGuard> no_grad;
    if (!requires_grad) no_grad.emplace();
    // Inputs become leaves of this stage's autograd graph, so backward can hand their
    // gradients to the stage that produced them.
    for (const at::Tensor& in : inputs) {
      pending.inputs.push_back(requires_grad && in.is_floating_point()
                                   ? in.detach().requires_grad_(true)
                                   : in);
    }
    torch::jit::Stack stack;
    stack.reserve(input_slot_.size());
    for (size_t i = 0; i < input_slot_.size(); ++i) {
      if (input_slot_[i] < 0) {
        stack.emplace_back(lifted_[i]);
      } else {
        stack.emplace_back(pending.inputs[input_slot_[i]]);
      }
    }
    torch::jit::InterpreterState(*code_).run(stack);
    for (const c10::IValue& v : stack) outputs.push_back(v.toTensor());
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (requires_grad) {
    pending.outputs = outputs;
    pending_.emplace(micro_batch, std::move(pending));
  }
  return outputs;
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::Backward(
    int micro_batch, const std::vector<at::Tensor>& output_grads) {
  auto it = pending_.find(micro_batch);
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage backward: micro-batch ", micro_batch, " has no forward with gradients pending"));
  }
  Pending pending = std::move(it->second);
  pending_.erase(it);
  if (output_grads.size() != pending.outputs.size()) {
    return absl::InternalError(absl::StrCat("stage backward: ", output_grads.size(),
                                            " gradients for ", pending.outputs.size(), " outputs"));
  }
  std::vector<at::Tensor> roots, grads;
  for (size_t i = 0; i < output_grads.size(); ++i) {
    const at::Tensor& out = pending.outputs[i];
    const at::Tensor& grad = output_grads[i];
    if (!grad.defined() || !out.requires_grad()) continue;
    if (!grad.sizes().equals(out.sizes())) {
      return absl::InternalError(absl::StrCat(
          "stage backward: gradient ", DescribeTensor(grad.scalar_type(), grad.sizes()),
          " for output ", DescribeTensor(out.scalar_type(), out.sizes())));
    }
    roots.push_back(out);
    grads.push_back(grad);
  }
  std::vector<at::Tensor> input_grads(pending.inputs.size());
  absl::Status status = absl::OkStatus();
  if (!roots.empty()) {
    status = TorchCall(absl::StatusCode::kInternal, "the stage's backward failed", [&] {
      torch::autograd::backward(roots, grads);
      return absl::OkStatus();
    });
  }
  if (!status.ok()) return status;
  for (size_t i = 0; i < pending.inputs.size(); ++i) {
    if (pending.inputs[i].requires_grad()) input_grads[i] = pending.inputs[i].grad();
  }
  return input_grads;
}

}  // namespace rannc
