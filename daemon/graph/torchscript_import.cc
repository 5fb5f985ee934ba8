#include "daemon/graph/torchscript_import.h"

#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/serialization/import.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/torch_archive.h"

namespace rannc {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// `module`'s own parameters and buffers (not its children's), by attribute name.
std::vector<std::pair<std::string, at::Tensor>> OwnTensors(const torch::jit::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> slots;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    slots.emplace_back(p.name, p.value);
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    slots.emplace_back(b.name, b.value);
  }
  return slots;
}

void CollectTensors(const torch::jit::Module& module, const std::string& prefix,
                    std::vector<ModuleTensor>* out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    out->push_back({prefix + p.name, p.value, /*is_parameter=*/true});
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    out->push_back({prefix + b.name, b.value, /*is_parameter=*/false});
  }
  for (const auto& child : module.named_children()) {
    CollectTensors(child.value, prefix + child.name + ".", out);
  }
}

// Where a graph value points into the module: the object (submodule) and its dotted path.
struct ObjectRef {
  c10::intrusive_ptr<c10::ivalue::Object> object;
  std::string path;
};

absl::Status LiftAttributes(Graph& graph, const torch::jit::Module& module,
                            std::vector<std::string>* tensor_names) {
  std::unordered_map<Value*, ObjectRef> objects;
  objects[graph.inputs()[0]] = {module._ivalue(), ""};
  std::unordered_map<std::string, Value*> lifted;  // dotted name -> new graph input

  std::vector<Node*> dead;
  for (Node* node : graph.nodes()) {
    if (node->kind() != c10::prim::GetAttr) continue;
    auto parent = objects.find(node->input(0));
    if (parent == objects.end()) {
      return absl::InvalidArgumentError(
          "the model's forward reads an attribute of a non-module value; trace or script a "
          "plain nn.Module");
    }
    const std::string name = node->s(c10::attr::name);
    const std::string path = parent->second.path.empty() ? name : parent->second.path + "." + name;
    c10::IValue attr = parent->second.object->getAttr(name);
    if (attr.isObject()) {
      objects[node->output()] = {attr.toObject(), path};
    } else if (attr.isTensor()) {
      Value*& input = lifted[path];
      if (input == nullptr) {
        input = graph.addInput(path)->setType(node->output()->type());
        tensor_names->push_back(path);
      }
      node->output()->replaceAllUsesWith(input);
    } else if (attr.isNone() || attr.isBool() || attr.isInt() || attr.isDouble() ||
               attr.isString()) {
      torch::jit::WithInsertPoint guard(node);
      node->output()->replaceAllUsesWith(graph.insertConstant(attr));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "the model's forward reads attribute '", path, "' of type ", attr.tagKind(),
          ", which the daemon cannot lift; only tensors, submodules and scalars are supported"));
    }
    dead.push_back(node);
  }
  // Module-valued GetAttrs lose their uses only once their children are rewired; erase
  // innermost (latest) first.
  for (auto it = dead.rbegin(); it != dead.rend(); ++it) {
    if ((*it)->output()->hasUses()) {
      return absl::InvalidArgumentError(
          "the model's forward passes a submodule as a value; trace the model instead");
    }
    (*it)->destroy();
  }
  if (graph.inputs()[0]->hasUses()) {
    return absl::InvalidArgumentError(
        "the model's forward uses `self` in a way that cannot be lifted; trace the model");
  }
  graph.eraseInput(0);
  return absl::OkStatus();
}

// Puts `sent` in place of the stand-ins. Tied weights share one stand-in (one storage in the
// archive), so every slot holding a sent name's storage takes its value.
absl::Status BindSentTensors(torch::jit::Module& module, const SentTensors& sent) {
  std::vector<ModuleTensor> current;
  CollectTensors(module, "", &current);
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const ModuleTensor& t : current) by_name[t.name] = &t.tensor;
  std::unordered_map<const c10::StorageImpl*, at::Tensor> by_storage;
  for (const auto& [name, value] : sent) {
    auto found = by_name.find(name);
    if (found == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a tensor was sent for '", name, "', which the model does not have"));
    }
    const at::Tensor& stand_in = *found->second;
    if (value.scalar_type() != stand_in.scalar_type() || !value.sizes().equals(stand_in.sizes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tensor sent for '", name, "' is ", c10::toString(value.scalar_type()),
          c10::str(value.sizes()), "; the model's is ", c10::toString(stand_in.scalar_type()),
          c10::str(stand_in.sizes())));
    }
    at::Tensor bound = value.detach();
    bound.set_requires_grad(stand_in.requires_grad());
    by_storage[stand_in.storage().unsafeGetStorageImpl()] = bound;
  }
  for (const torch::jit::NameModule& sub : module.named_modules()) {
    torch::jit::Module owner = sub.value;
    for (const auto& [name, tensor] : OwnTensors(owner)) {
      auto found = by_storage.find(tensor.storage().unsafeGetStorageImpl());
      if (found != by_storage.end()) owner.setattr(name, found->second);
    }
  }
  return absl::OkStatus();
}

// torch.jit.trace records a Python number in an expression (`loss * 1e-3`, `x + 1`) as a 0-dim
// double or long tensor constant, and a saved module keeps it so. Eager PyTorch treats such a
// number as a "wrapped number" that never promotes a tensor's dtype, as does PyTorch's graph
// executor running the traced module (its optimized graph holds the number as a scalar); the
// interpreter the daemon runs graphs with does not, so `float_loss * double_constant` would come
// out double. Each such constant operand becomes a scalar where the op has a Scalar overload.
void ScalarizeTracedNumbers(Graph& graph) {
  std::vector<Node*> nodes(graph.nodes().begin(), graph.nodes().end());
  for (Node* n : nodes) {
    if (n->kind() == c10::prim::Constant || n->inputs().size() < 2 || !n->blocks().empty()) {
      continue;
    }
    std::vector<Value*> inputs(n->inputs().begin(), n->inputs().end());
    bool changed = false;
    for (size_t i = 1; i < inputs.size(); ++i) {
      Node* c = inputs[i]->node();
      if (c->kind() != c10::prim::Constant || !c->hasAttribute(c10::attr::value) ||
          c->kindOf(c10::attr::value) != torch::jit::AttributeKind::t) {
        continue;
      }
      const at::Tensor t = c->t(c10::attr::value);
      if (!t.defined() || t.dim() != 0 || !t.device().is_cpu() || t.requires_grad() ||
          (t.scalar_type() != at::kDouble && t.scalar_type() != at::kLong)) {
        continue;
      }
      torch::jit::WithInsertPoint guard(n);
      inputs[i] = t.scalar_type() == at::kDouble ? graph.insertConstant(t.item<double>())
                                                 : graph.insertConstant(t.item<int64_t>());
      changed = true;
    }
    if (!changed) continue;
    Node* scalar = graph.create(n->kind(), inputs, n->outputs().size());
    scalar->copyMetadata(n);
    if (scalar->maybeOperator() == nullptr) {  // no Scalar overload: keep the tensor constant
      scalar->destroy();
      continue;
    }
    scalar->insertBefore(n);
    for (size_t o = 0; o < n->outputs().size(); ++o) {
      scalar->output(o)->setType(n->output(o)->type());
      scalar->output(o)->copyMetadata(n->output(o));
      n->output(o)->replaceAllUsesWith(scalar->output(o));
    }
    n->destroy();
  }
}

}  // namespace

absl::Status CheckNoStandIns(const ImportedModel& model) {
  for (const ModuleTensor& t : model.tensors) {
    if (t.tensor.numel() <= 1) continue;
    bool stand_in = true;
    for (int64_t d = 0; d < t.tensor.dim() && stand_in; ++d) {
      stand_in = t.tensor.size(d) <= 1 || t.tensor.stride(d) == 0;
    }
    if (stand_in) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the model's ", t.is_parameter ? "parameter" : "buffer", " '", t.name, "' ",
          c10::str(t.tensor.sizes()), " is a stand-in (all its elements share one stored "
          "value) and no tensor was sent for it in JobSpec.model_tensors; send its values "
          "there or leave them in the TorchScript archive"));
    }
  }
  return absl::OkStatus();
}

void ReleaseModuleTensors(ImportedModel* model) {
  model->tensors.clear();
  if (!model->module) return;
  for (const torch::jit::NameModule& sub : model->module->named_modules()) {
    torch::jit::Module owner = sub.value;
    for (const auto& [name, tensor] : OwnTensors(owner)) {
      owner.setattr(name, at::empty({0}, tensor.options()).set_requires_grad(false));
    }
  }
}

absl::StatusOr<std::string> SerializeModule(const ImportedModel& model) {
  std::ostringstream out;
  absl::Status status = TorchCall(absl::StatusCode::kInternal, "serializing the model", [&] {
    model.module->save(out);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return out.str();
}

absl::StatusOr<ImportedModel> ImportTorchScript(const std::string& bytes,
                                                const SentTensors& sent) {
  // Sizes the archive states, checked before LibTorch allocates them.
  if (absl::Status checked = CheckTorchArchive(bytes, "the model archive"); !checked.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model is not a loadable TorchScript module: ", checked.message()));
  }
  ImportedModel model;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument,
                                  "the model is not a loadable TorchScript module", [&] {
    std::istringstream stream(bytes);
    model.module = std::make_shared<torch::jit::Module>(
        torch::jit::load(stream, c10::Device(c10::kCPU)));
    if (!sent.empty()) {
      absl::Status bound = BindSentTensors(*model.module, sent);
      if (!bound.ok()) return bound;
    }
    const torch::jit::Module& module = *model.module;
    auto method = module.find_method("forward");
    if (!method) {
      return absl::InvalidArgumentError("the TorchScript module has no forward method");
    }
    model.graph = method->graph()->copy();
    torch::jit::Inline(*model.graph);
    for (size_t i = 1; i < model.graph->inputs().size(); ++i) {
      model.input_names.push_back(model.graph->inputs()[i]->debugName());
    }
    CollectTensors(module, "", &model.tensors);
    absl::Status lift = LiftAttributes(*model.graph, module, &model.graph_tensor_names);
    if (!lift.ok()) return lift;
    ScalarizeTracedNumbers(*model.graph);
    torch::jit::EliminateDeadCode(model.graph);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return model;
}

}  // namespace rannc
