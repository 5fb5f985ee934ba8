#include "daemon/graph/low_precision.h"

#include <map>
#include <string>

#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

// Reads of `value` go through `aten::to(value, dtype)`, inserted before the graph's first node.
void CastUses(torch::jit::Graph& graph, torch::jit::Value* value, c10::ScalarType dtype) {
  const std::vector<torch::jit::Use> uses = value->uses();
  if (uses.empty()) return;
  torch::jit::WithInsertPoint at_start(graph.param_node()->next());
  torch::jit::Value* no = graph.insertConstant(false);
  torch::jit::Node* cast = graph.create(
      c10::aten::to, {value, graph.insertConstant(static_cast<int64_t>(dtype)), no, no,
                      graph.insertConstant(c10::IValue())});
  graph.insertNode(cast);
  c10::TypePtr type = c10::TensorType::get();
  if (auto tensor = value->type()->cast<c10::TensorType>()) type = tensor->withScalarType(dtype);
  cast->output()->setType(type);
  for (const torch::jit::Use& use : uses) use.user->replaceInput(use.offset, cast->output());
}

bool OnlyBatchNorm(const torch::jit::Value* value) {
  for (const torch::jit::Use& use : value->uses()) {
    if (use.user->kind() != c10::aten::batch_norm) return false;
  }
  return !value->uses().empty();
}

}  // namespace

absl::Status CastForwardTo(ImportedModel* model, c10::ScalarType dtype,
                           const std::vector<c10::ScalarType>& input_dtypes) {
  if (!c10::isFloatingType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("low-precision forward: ", c10::toString(dtype), " is not a floating type"));
  }
  torch::jit::Graph& graph = *model->graph;
  const size_t users = model->input_names.size();
  if (input_dtypes.size() != users) {
    return absl::InvalidArgumentError(absl::StrCat("low-precision forward: ", input_dtypes.size(),
                                                   " input dtypes for ", users, " inputs"));
  }
  for (size_t i = 0; i < users; ++i) {
    if (c10::isFloatingType(input_dtypes[i]) && input_dtypes[i] != dtype) {
      CastUses(graph, graph.inputs()[i], dtype);
    }
  }
  std::map<std::string, const ModuleTensor*> by_name;
  for (const ModuleTensor& t : model->tensors) by_name[t.name] = &t;
  for (size_t k = 0; k < model->graph_tensor_names.size(); ++k) {
    auto t = by_name.find(model->graph_tensor_names[k]);
    if (t == by_name.end() || !t->second->is_parameter) continue;  // buffers keep their dtype
    const c10::ScalarType own = t->second->tensor.scalar_type();
    torch::jit::Value* value = graph.inputs()[users + k];
    if (!c10::isFloatingType(own) || own == dtype || OnlyBatchNorm(value)) continue;
    CastUses(graph, value, dtype);
  }
  return absl::OkStatus();
}

}  // namespace rannc
