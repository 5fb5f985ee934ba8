#include "daemon/runtime/model_runner.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"

namespace rannc {
namespace {

absl::Status Flatten(const c10::IValue& value, std::vector<at::Tensor>* out) {
  if (value.isTensor()) {
    out->push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const c10::IValue& v : value.toTupleRef().elements()) {
      absl::Status s = Flatten(v, out);
      if (!s.ok()) return s;
    }
  } else if (value.isList()) {
    for (const c10::IValue& v : value.toListRef()) {
      absl::Status s = Flatten(v, out);
      if (!s.ok()) return s;
    }
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      absl::Status s = Flatten(item.value(), out);
      if (!s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model returns a value of type ", value.tagKind(),
        "; outputs must be tensors or tuples, lists or dicts of tensors"));
  }
  return absl::OkStatus();
}

std::string Describe(const InputSignature& sig, size_t index) {
  return sig.name.empty() ? absl::StrCat("input #", index)
                          : absl::StrCat("input '", sig.name, "' (#", index, ")");
}

}  // namespace

std::string ModelMode::ToString() const {
  return absl::StrCat(training ? "train" : "eval", dropout == training ? "" :
                      (dropout ? " with dropout" : " without dropout"));
}

absl::Status CheckInputs(const std::vector<InputSignature>& signature,
                         const std::vector<at::Tensor>& inputs) {
  if (inputs.size() != signature.size()) {
    std::vector<std::string> names;
    for (const InputSignature& s : signature) names.push_back(s.name);
    return absl::InvalidArgumentError(absl::StrCat(
        "the model takes ", signature.size(), " inputs (", absl::StrJoin(names, ", "), "), got ",
        inputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const InputSignature& sig = signature[i];
    const at::Tensor& in = inputs[i];
    bool ok = in.scalar_type() == sig.dtype && in.dim() == static_cast<int64_t>(sig.shape.size());
    for (size_t d = 1; ok && d < sig.shape.size(); ++d) ok = in.size(d) == sig.shape[d];
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(sig, i), ": expected ", DescribeTensor(sig.dtype, sig.shape),
          " (dimension 0, the batch, may vary), got ", DescribeTensor(in.scalar_type(),
                                                                       in.sizes())));
    }
    for (const IndexRange& range : sig.ranges) {
      if (in.numel() == 0) break;
      at::Tensor bad = at::logical_or(in < 0, in >= range.limit);
      if (range.ignore) bad.logical_and_(in != *range.ignore);
      if (!bad.any().item<bool>()) continue;
      const at::Tensor first = bad.nonzero()[0];  // the first bad value's position
      const std::vector<int64_t> pos(first.data_ptr<int64_t>(),
                                     first.data_ptr<int64_t>() + first.numel());
      at::Tensor value = in;
      for (int64_t d : pos) value = value[d];
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(sig, i), ": value ", value.item<int64_t>(), " at [", absl::StrJoin(pos, ", "),
          "] is out of range for ", range.what, ": every value must be in [0, ", range.limit,
          ")", range.ignore ? absl::StrCat(" or be ", *range.ignore) : "",
          "; the batch was refused before any device ran it"));
    }
  }
  return absl::OkStatus();
}

ModelRunner::ModelRunner(ParamStore* store) : store_(store) {}
ModelRunner::~ModelRunner() = default;

absl::Status ModelRunner::AddMode(const ModelMode& mode, const ImportedModel& model) {
  ModeGraph entry;
  entry.module = model.module;
  for (const std::string& name : model.graph_tensor_names) {
    const ParamStore::Entry* stored = store_->Find(name);
    if (stored == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", mode.ToString(), " graph reads tensor '", name,
          "', which the job's model does not have; upload a trace of the same model"));
    }
    entry.tensor_args.push_back(stored->tensor);
  }
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "compiling the model", [&] {
    entry.code = std::make_shared<torch::jit::Code>(model.graph, "forward");
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  graphs_[mode] = std::move(entry);
  return absl::OkStatus();
}

bool ModelRunner::HasMode(const ModelMode& mode) const { return graphs_.count(mode) > 0; }

absl::StatusOr<std::vector<at::Tensor>> ModelRunner::Forward(
    const ModelMode& mode, const std::vector<InputSignature>& signature,
    const std::vector<at::Tensor>& inputs, bool requires_grad) {
  auto graph = graphs_.find(mode);
  if (graph == graphs_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job has no graph for mode '", mode.ToString(), "'; upload one with AddMode"));
  }
  absl::Status checked = CheckInputs(signature, inputs);
  if (!checked.ok()) return checked;

  // A new forward replaces the previous one's graph, as re-running a PyTorch model does.
  outputs_.clear();
  std::vector<at::Tensor> outputs;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "the model's forward failed",
                                  [&] {
    std::optional<at::NoGradGuard> no_grad;
    if (!requires_grad) no_grad.emplace();
    torch::jit::Stack stack;
    stack.reserve(inputs.size() + graph->second.tensor_args.size());
    for (const at::Tensor& t : inputs) stack.emplace_back(t);
    for (const at::Tensor& t : graph->second.tensor_args) stack.emplace_back(t);
    torch::jit::InterpreterState(*graph->second.code).run(stack);
    if (stack.size() != 1) {
      return absl::InternalError(absl::StrCat("forward left ", stack.size(), " values"));
    }
    return Flatten(stack[0], &outputs);
  });
  if (!status.ok()) return status;
  if (requires_grad) outputs_ = outputs;
  return outputs;
}

absl::Status ModelRunner::Backward(
    const std::vector<std::pair<size_t, at::Tensor>>& output_grads, bool retain_graph) {
  if (outputs_.empty()) {
    return absl::FailedPreconditionError(
        "backward called with no forward pending: call forward (with gradients enabled) first, "
        "or keep_graph(True) to run backward twice over one forward");
  }
  std::vector<at::Tensor> roots;
  std::vector<at::Tensor> grads;
  for (const auto& [index, grad] : output_grads) {
    if (index >= outputs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ", but the model has ", outputs_.size(), " outputs"));
    }
    const at::Tensor& out = outputs_[index];
    if (!grad.sizes().equals(out.sizes()) || grad.scalar_type() != out.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ": expected ",
          DescribeTensor(out.scalar_type(), out.sizes()), ", got ",
          DescribeTensor(grad.scalar_type(), grad.sizes())));
    }
    if (!out.requires_grad()) continue;  // e.g. an integer output or one independent of params
    roots.push_back(out);
    grads.push_back(grad);
  }
  absl::Status status = absl::OkStatus();
  if (!roots.empty()) {
    status = TorchCall(absl::StatusCode::kFailedPrecondition, "backward failed", [&] {
      torch::autograd::backward(roots, grads, retain_graph);
      return absl::OkStatus();
    });
  }
  if (!retain_graph) outputs_.clear();
  return status;
}

}  // namespace rannc
