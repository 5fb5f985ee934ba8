#include "daemon/graph/subgraph.h"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/host_reads.h"

namespace rannc {
namespace {

// Shape arithmetic that torch.jit.trace records (`hd = x.size(2) // heads`: prim::NumToTensor of
// the size, aten::floor_divide by a 0-dim integer tensor constant, aten::Int of the result) runs
// on host scalars. Such a constant stays on the host: on the device, every aten::Int of the
// result (a host read, graph/host_reads.h) would copy it back and wait for the device (three
// times a layer for a GPT's views).
bool IsScalarArithmetic(const torch::jit::Node* n) {
  static const std::set<c10::Symbol> kinds = {
      c10::aten::add,  c10::aten::sub, c10::aten::rsub, c10::aten::mul,
      c10::aten::div,  c10::aten::floor_divide, c10::aten::true_divide, c10::aten::remainder,
      c10::aten::eq,   c10::aten::ne,  c10::aten::lt,   c10::aten::le,
      c10::aten::gt,   c10::aten::ge};
  return kinds.count(n->kind()) > 0 && n->outputs().size() == 1;
}

// A host 0-dim integer tensor: the constant of traced shape arithmetic.
bool IsHostIntegerScalar(const at::Tensor& t) {
  return t.device().is_cpu() && t.dim() == 0 && at::isIntegralType(t.scalar_type(), true);
}

// Whether everything computed from `v` is element-wise arithmetic or comparison, ending in host
// reads. A 0-dim host tensor may meet device tensors in such ops (PyTorch takes it as a scalar,
// and the result is on the device as before); a result computed from host scalars alone is then
// on the host where it was on the device, and only such ops and host reads ever see it.
bool OnlyHostScalarUses(const torch::jit::Value* v, int depth = 0) {
  if (depth > 32) return false;
  for (const torch::jit::Use& use : v->uses()) {
    const torch::jit::Node* n = use.user;
    if (IsHostRead(n)) continue;
    if (!IsScalarArithmetic(n) || !OnlyHostScalarUses(n->output(), depth + 1)) return false;
  }
  return true;
}

void PlaceConstantsIn(torch::jit::Block* block, c10::Device device) {
  std::vector<torch::jit::Node*> constants;
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == c10::prim::Constant && n->outputs().size() == 1) constants.push_back(n);
    for (torch::jit::Block* b : n->blocks()) PlaceConstantsIn(b, device);
  }
  torch::jit::Graph* graph = block->owningGraph();
  for (torch::jit::Node* n : constants) {
    torch::jit::Value* out = n->output();
    const c10::TypePtr& type = out->type();
    std::optional<c10::IValue> placed;
    if (type->kind() == c10::TypeKind::DeviceObjType) {
      std::optional<c10::IValue> value = torch::jit::toIValue(out);
      if (value && value->toDevice().is_cpu()) placed = c10::IValue(device);
    } else if (type->kind() == c10::TypeKind::TensorType) {
      std::optional<c10::IValue> value = torch::jit::toIValue(out);
      if (value && value->isTensor() && value->toTensor().device().is_cpu() &&
          !(IsHostIntegerScalar(value->toTensor()) && OnlyHostScalarUses(out))) {
        placed = c10::IValue(value->toTensor().to(device));
      }
    }
    if (!placed) continue;
    torch::jit::WithInsertPoint here(n);
    out->replaceAllUsesWith(graph->insertConstant(*placed));
    n->destroy();
  }
}


using torch::jit::Node;
using torch::jit::Value;

struct RunResult {
  std::vector<c10::IValue> outputs;
  std::vector<at::Tensor> leaves;  // the lifted tensors the run used, as autograd leaves
};

std::vector<at::Tensor> Leaves(const IrGraph& ir, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> leaves;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i].detach().clone();
    const IrValue& v = ir.values[ir.num_user_inputs + i];
    if (v.role == ValueRole::kParam && t.is_floating_point()) t.requires_grad_(true);
    leaves.push_back(t);
  }
  return leaves;
}

absl::Status Backward(const std::vector<c10::IValue>& outputs) {
  std::vector<at::Tensor> roots;
  for (const c10::IValue& o : outputs) {
    if (o.isTensor() && o.toTensor().requires_grad()) roots.push_back(o.toTensor().sum());
  }
  if (roots.empty()) return absl::OkStatus();
  return TorchCall(absl::StatusCode::kInternal, "backward while verifying a split", [&] {
    torch::autograd::backward({at::stack(roots).sum()});
    return absl::OkStatus();
  });
}

absl::Status Compare(const std::string& what, const at::Tensor& expected, const at::Tensor& got,
                     double rtol, double atol) {
  if (!expected.defined() && !got.defined()) return absl::OkStatus();
  if (expected.defined() != got.defined() || !expected.sizes().equals(got.sizes()) ||
      expected.scalar_type() != got.scalar_type()) {
    return absl::InternalError(absl::StrCat(
        "split verification: ", what, " differs in shape or presence: expected ",
        expected.defined() ? DescribeTensor(expected.scalar_type(), expected.sizes()) : "none",
        ", got ", got.defined() ? DescribeTensor(got.scalar_type(), got.sizes()) : "none"));
  }
  bool close = expected.is_floating_point()
                   ? at::allclose(expected, got, rtol, atol, /*equal_nan=*/true)
                   : at::equal(expected, got);
  if (!close) {
    double diff = (expected.to(at::kDouble) - got.to(at::kDouble)).abs().max().item<double>();
    return absl::InternalError(absl::StrCat("split verification: ", what,
                                            " differs from the whole model by up to ", diff));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Subgraph> BuildSubgraph(const IrGraph& ir, int begin, int end) {
  if (begin < 0 || end > static_cast<int>(ir.nodes.size()) || begin >= end) {
    return absl::InvalidArgumentError(absl::StrCat("bad atomic node range [", begin, ", ", end,
                                                   ") of ", ir.nodes.size()));
  }
  std::vector<int> nodes;
  for (int i = begin; i < end; ++i) nodes.push_back(i);
  return BuildSubgraph(ir, std::move(nodes));
}

std::vector<int> ParamBlockStarts(const IrGraph& ir, int begin, int end, int64_t max_param_bytes) {
  std::vector<int> starts = {begin};
  if (max_param_bytes <= 0) return starts;
  std::set<int> block;  // parameters the current block reads
  int64_t bytes = 0;
  for (int n = begin; n < end; ++n) {
    std::vector<int> fresh;
    int64_t more = 0;
    for (int v : ir.nodes[n].inputs) {
      if (ir.values[v].role != ValueRole::kParam || block.count(v)) continue;
      if (std::find(fresh.begin(), fresh.end(), v) != fresh.end()) continue;
      fresh.push_back(v);
      more += ir.values[v].bytes;
    }
    if (more == 0) continue;
    if (bytes > 0 && bytes + more > max_param_bytes) {
      starts.push_back(n);
      block.clear();
      bytes = 0;
    }
    block.insert(fresh.begin(), fresh.end());
    bytes += more;
  }
  return starts;
}

absl::StatusOr<Subgraph> BuildSubgraph(const IrGraph& ir, std::vector<int> nodes) {
  const int n = static_cast<int>(ir.nodes.size());
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  if (nodes.empty() || nodes.front() < 0 || nodes.back() >= n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a stage needs at least one atomic node, each in [0, ", n, ")"));
  }
  std::vector<bool> member(n, false);
  for (int i : nodes) member[i] = true;
  // Convex: no node outside the set lies on a path between two of its nodes. Nodes are in
  // topological order, so one forward pass finds everything downstream of the set. A range
  // is convex by construction.
  const bool range = nodes.back() - nodes.front() + 1 == static_cast<int>(nodes.size());
  std::vector<bool> downstream(n, false);
  for (int i = nodes.front(); i < n && !range; ++i) {
    for (int v : ir.nodes[i].inputs) {
      const int p = ir.values[v].producer;
      if (p < 0 || !(member[p] || downstream[p])) continue;
      if (member[i] && !member[p]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "atomic nodes ", nodes.front(), "..", nodes.back(), " are not a convex set: node ",
            p, " outside it depends on the set and feeds node ", i, " in it"));
      }
      if (!member[i]) downstream[i] = true;
    }
  }

  Subgraph sub;
  sub.nodes = nodes;
  // The IR's lookups when it has them (BuildIr fills them); else made here.
  std::unordered_map<const Node*, int> local_node_of_op;
  if (ir.node_of_op.empty()) {
    for (int i = 0; i < n; ++i) {
      for (Node* op : ir.nodes[i].ops) local_node_of_op[op] = i;
    }
  }
  const std::unordered_map<const Node*, int>& node_of_op =
      ir.node_of_op.empty() ? local_node_of_op : ir.node_of_op;
  std::unordered_set<Node*> in_range;
  for (int i : nodes) in_range.insert(ir.nodes[i].ops.begin(), ir.nodes[i].ops.end());
  std::set<int> inputs, produced;
  for (int i : nodes) {
    for (Node* op : ir.nodes[i].ops) {
      for (Value* o : op->outputs()) produced.insert(ir.ValueOf(o));
    }
  }
  for (int i : nodes) {
    for (int v : ir.nodes[i].inputs) {
      if (!produced.count(v)) inputs.insert(v);
    }
  }
  for (int v : produced) {
    const IrValue& value = ir.values[v];
    bool needed_outside = value.is_output;
    for (int c : value.consumers) needed_outside = needed_outside || !member[c];
    if (needed_outside) sub.outputs.push_back(v);
  }
  sub.inputs.assign(inputs.begin(), inputs.end());

  // The helpers the range reads, found backwards from its ops.
  std::unordered_set<Node*> helpers;
  std::vector<Node*> work(in_range.begin(), in_range.end());
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    for (Value* in : ExternalInputs(n)) {
      Node* p = in->node();
      if (p->kind() == c10::prim::Param || node_of_op.count(p) || helpers.count(p)) continue;
      helpers.insert(p);
      work.push_back(p);
    }
  }

  absl::Status status = TorchCall(absl::StatusCode::kInternal, "building a stage graph", [&] {
    sub.graph = std::make_shared<torch::jit::Graph>();
    std::unordered_map<const Value*, Value*> env;
    for (int v : sub.inputs) {
      const IrValue& value = ir.values[v];
      Value* input = sub.graph->addInput()->setType(value.jit->type());
      if (value.jit->hasDebugName()) input->setDebugName(value.jit->debugName());
      env[value.jit] = input;
    }
    auto lookup = [&](Value* v) -> Value* {
      auto it = env.find(v);
      if (it == env.end()) {
        throw std::runtime_error(absl::StrCat("value %", v->debugName(),
                                              " is not available to the stage"));
      }
      return it->second;
    };
    // The stage's ops in graph order.
    std::vector<Node*> ops;
    if (ir.op_position.empty()) {
      for (Node* n : ir.graph->nodes()) {
        if (in_range.count(n) || helpers.count(n)) ops.push_back(n);
      }
    } else {
      ops.assign(in_range.begin(), in_range.end());
      ops.insert(ops.end(), helpers.begin(), helpers.end());
      std::sort(ops.begin(), ops.end(), [&](Node* a, Node* b) {
        return ir.op_position.at(a) < ir.op_position.at(b);
      });
    }
    for (Node* n : ops) {
      Node* clone = sub.graph->insertNode(sub.graph->createClone(n, lookup));
      for (size_t i = 0; i < n->outputs().size(); ++i) env[n->output(i)] = clone->output(i);
    }
    for (int v : sub.outputs) sub.graph->registerOutput(lookup(ir.values[v].jit));
    sub.graph->lint();
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return sub;
}

absl::StatusOr<std::vector<c10::IValue>> RunGraph(const std::shared_ptr<torch::jit::Graph>& graph,
                                                  std::vector<c10::IValue> inputs) {
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "running a graph", [&] {
    torch::jit::Code code(graph, "stage");
    torch::jit::InterpreterState(code).run(inputs);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return inputs;
}

absl::Status VerifySplit(const IrGraph& ir, const std::vector<int>& stage_starts,
                         const std::vector<at::Tensor>& tensors,
                         const std::vector<at::Tensor>& inputs, double rtol, double atol) {
  if (stage_starts.empty() || stage_starts[0] != 0) {
    return absl::InvalidArgumentError("stage starts must begin with 0");
  }
  std::vector<std::vector<int>> stages;
  for (size_t st = 0; st < stage_starts.size(); ++st) {
    const int end = st + 1 < stage_starts.size() ? stage_starts[st + 1]
                                                 : static_cast<int>(ir.nodes.size());
    stages.emplace_back();
    for (int i = stage_starts[st]; i < end; ++i) stages.back().push_back(i);
  }
  return VerifyPartition(ir, stages, tensors, inputs, rtol, atol);
}

absl::Status VerifyPartition(const IrGraph& ir, const std::vector<std::vector<int>>& stages,
                             const std::vector<at::Tensor>& tensors,
                             const std::vector<at::Tensor>& client_inputs, double rtol,
                             double atol) {
  std::vector<int> covered(ir.nodes.size(), 0);
  for (const std::vector<int>& stage : stages) {
    for (int i : stage) {
      if (i < 0 || i >= static_cast<int>(ir.nodes.size())) {
        return absl::InvalidArgumentError(absl::StrCat("no atomic node ", i));
      }
      ++covered[i];
    }
  }
  for (size_t i = 0; i < covered.size(); ++i) {
    if (covered[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the stages must hold every atomic node once; node ", i, " is in ", covered[i]));
    }
  }
  absl::StatusOr<std::vector<at::Tensor>> batch =
      WithStepInputs(ir, client_inputs, tensors);
  if (!batch.ok()) return batch.status();
  const std::vector<at::Tensor>& inputs = *batch;
  // Whole model.
  std::vector<at::Tensor> whole_leaves = Leaves(ir, tensors);
  std::vector<c10::IValue> stack(inputs.begin(), inputs.end());
  for (const at::Tensor& t : whole_leaves) stack.emplace_back(t);
  absl::StatusOr<std::vector<c10::IValue>> whole = RunGraph(ir.graph, stack);
  if (!whole.ok()) return whole.status();
  absl::Status s = Backward(*whole);
  if (!s.ok()) return s;

  // Stages in sequence; autograd links them through the tensors they pass.
  std::vector<at::Tensor> split_leaves = Leaves(ir, tensors);
  std::unordered_map<int, c10::IValue> env;
  for (size_t i = 0; i < inputs.size(); ++i) env[ir.inputs[i]] = inputs[i];
  for (size_t i = 0; i < split_leaves.size(); ++i) {
    env[ir.inputs[ir.num_user_inputs + i]] = split_leaves[i];
  }
  for (size_t st = 0; st < stages.size(); ++st) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, stages[st]);
    if (!sub.ok()) return sub.status();
    std::vector<c10::IValue> in;
    for (int v : sub->inputs) {
      auto it = env.find(v);
      if (it == env.end()) {
        return absl::InternalError(absl::StrCat("split verification: stage ", st,
                                                " reads %", ir.values[v].name,
                                                ", which no earlier stage produced"));
      }
      in.push_back(it->second);
    }
    absl::StatusOr<std::vector<c10::IValue>> out = RunGraph(sub->graph, std::move(in));
    if (!out.ok()) return Annotate(out.status(), absl::StrCat("stage ", st));
    for (size_t i = 0; i < sub->outputs.size(); ++i) env[sub->outputs[i]] = (*out)[i];
  }
  std::vector<c10::IValue> split_outputs;
  for (int v : ir.outputs) split_outputs.push_back(env.at(v));
  s = Backward(split_outputs);
  if (!s.ok()) return s;

  for (size_t i = 0; i < ir.outputs.size(); ++i) {
    s = Compare(absl::StrCat("output #", i), (*whole)[i].toTensor().detach(),
                split_outputs[i].toTensor().detach(), rtol, atol);
    if (!s.ok()) return s;
  }
  for (size_t i = 0; i < whole_leaves.size(); ++i) {
    s = Compare(absl::StrCat("gradient of '", ir.tensor_names[i], "'"), whole_leaves[i].grad(),
                split_leaves[i].grad(), rtol, atol);
    if (!s.ok()) return s;
    if (ir.values[ir.num_user_inputs + i].role == ValueRole::kBuffer) {
      s = Compare(absl::StrCat("buffer '", ir.tensor_names[i], "' after forward"),
                  whole_leaves[i], split_leaves[i], rtol, atol);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

void PlaceOnDevice(torch::jit::Graph& graph, c10::Device device) {
  if (device.is_cpu()) return;
  PlaceConstantsIn(graph.block(), device);
}

}  // namespace rannc
