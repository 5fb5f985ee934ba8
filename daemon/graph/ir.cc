#include "daemon/graph/ir.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/lower_tuples.h>
#include <torch/csrc/jit/passes/remove_mutation.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/batch_flow.h"
#include "daemon/graph/structure.h"

namespace rannc {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

bool IsTensor(const Value* v) { return v->type()->kind() == c10::TypeKind::TensorType; }

// The model's return value as a flat list of tensor values, in ModelRunner's Flatten order.
absl::Status FlattenOutput(Value* v, std::vector<Value*>* out) {
  Node* n = v->node();
  if (n->kind() == c10::prim::TupleConstruct || n->kind() == c10::prim::ListConstruct) {
    for (Value* in : n->inputs()) {
      absl::Status s = FlattenOutput(in, out);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (n->kind() == c10::prim::DictConstruct) {
    for (size_t i = 1; i < n->inputs().size(); i += 2) {
      absl::Status s = FlattenOutput(n->input(i), out);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (!IsTensor(v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model returns a value of type ", v->type()->str(), " the planner cannot split; "
        "return tensors, or tuples, lists or dicts of tensors built in forward"));
  }
  out->push_back(v);
  return absl::OkStatus();
}

// Every top-level value of `graph` in a fixed order: inputs, then each node's outputs.
std::vector<Value*> TopLevelValues(Graph& graph) {
  std::vector<Value*> values(graph.inputs().begin(), graph.inputs().end());
  for (Node* n : graph.nodes()) {
    for (Value* o : n->outputs()) values.push_back(o);
  }
  return values;
}

// Ops whose results are sizes or shapes, not data.
bool IsShapeOp(const Node* n) {
  static const std::unordered_set<std::string> kinds = {
      "aten::size", "aten::dim", "aten::numel", "prim::shape", "aten::len"};
  return kinds.count(n->kind().toQualString()) > 0;
}

}  // namespace

bool ShapesFollowFromShapes(Graph& graph) {
  static const std::unordered_set<std::string> kinds = {
      "aten::nonzero",    "aten::nonzero_numpy", "aten::argwhere",       "aten::masked_select",
      "aten::unique",     "aten::_unique",       "aten::_unique2",       "aten::unique_dim",
      "aten::unique_consecutive", "aten::unique_dim_consecutive",         "aten::bincount",
      "aten::repeat_interleave",  "aten::item",  "aten::_local_scalar_dense", "aten::Int",
      "aten::Float",      "aten::Bool",          "aten::IntImplicit",    "aten::FloatImplicit",
      "aten::ComplexImplicit", "aten::ScalarImplicit", "aten::tolist",   "prim::tolist",
      "aten::equal",      "aten::is_nonzero",    "aten::allclose",       "aten::index",
  };
  // where(condition) alone is nonzero by another name.
  auto contents_to_shape = [&](const Node* n) {
    return kinds.count(n->kind().toQualString()) > 0 ||
           (n->kind() == c10::aten::where && n->inputs().size() == 1);
  };
  std::function<bool(torch::jit::Block*)> nested_ok = [&](torch::jit::Block* b) {
    for (Node* n : b->nodes()) {
      if (contents_to_shape(n)) return false;
      for (torch::jit::Block* inner : n->blocks()) {
        if (!nested_ok(inner)) return false;
      }
    }
    return true;
  };
  std::unordered_set<const Value*> from_contents(graph.inputs().begin(), graph.inputs().end());
  for (Node* n : graph.nodes()) {
    bool contents = false;
    for (Value* in : ExternalInputs(n)) contents = contents || from_contents.count(in) > 0;
    if (contents && (contents_to_shape(n) || !n->blocks().empty())) {
      return false;
    }
    for (torch::jit::Block* b : n->blocks()) {
      if (!nested_ok(b)) return false;
    }
    if (contents && !IsShapeOp(n)) {
      for (Value* o : n->outputs()) from_contents.insert(o);
    }
  }
  return true;
}

namespace {

// One atomic node, runnable alone: its ops and every helper they read, with every value it
// computes as an output, so a run of all probes in order records every top-level value.
struct NodeProbe {
  std::shared_ptr<Graph> graph;
  std::vector<int> inputs;   // IR value ids, in the graph's input order
  std::vector<int> outputs;  // IR value ids of every value the graph computes, in order
  std::string structure;     // CanonicalGraphText(*graph)
  std::unique_ptr<torch::jit::Code> code;  // made at the first run
};

absl::StatusOr<std::vector<NodeProbe>> BuildProbes(const IrGraph& ir) {
  const std::unordered_map<const Node*, int>& position = ir.op_position;
  const std::unordered_map<const Node*, int>& owner = ir.node_of_op;
  std::vector<NodeProbe> probes(ir.nodes.size());
  absl::Status status = TorchCall(absl::StatusCode::kInternal, "building probe graphs", [&] {
    for (size_t i = 0; i < ir.nodes.size(); ++i) {
      std::unordered_set<Node*> members(ir.nodes[i].ops.begin(), ir.nodes[i].ops.end());
      std::vector<Node*> work(ir.nodes[i].ops.begin(), ir.nodes[i].ops.end());
      while (!work.empty()) {
        Node* n = work.back();
        work.pop_back();
        for (Value* in : ExternalInputs(n)) {
          Node* p = in->node();
          if (p->kind() == c10::prim::Param || owner.count(p) || members.count(p)) continue;
          members.insert(p);
          work.push_back(p);
        }
      }
      std::vector<Node*> ordered(members.begin(), members.end());
      std::sort(ordered.begin(), ordered.end(),
                [&](Node* a, Node* b) { return position.at(a) < position.at(b); });
      std::set<int> inputs;
      for (Node* n : ordered) {
        for (Value* in : ExternalInputs(n)) {
          if (!members.count(in->node())) inputs.insert(ir.ValueOf(in));
        }
      }
      NodeProbe& probe = probes[i];
      probe.graph = std::make_shared<Graph>();
      std::unordered_map<const Value*, Value*> env;
      for (int v : inputs) {
        probe.inputs.push_back(v);
        env[ir.values[v].jit] = probe.graph->addInput()->setType(ir.values[v].jit->type());
      }
      auto lookup = [&](Value* v) -> Value* {
        auto it = env.find(v);
        if (it == env.end()) {
          throw std::runtime_error(absl::StrCat("value %", v->debugName(),
                                                " is not available to the probe"));
        }
        return it->second;
      };
      for (Node* n : ordered) {
        Node* clone = probe.graph->insertNode(probe.graph->createClone(n, lookup));
        for (size_t o = 0; o < n->outputs().size(); ++o) {
          env[n->output(o)] = clone->output(o);
          probe.graph->registerOutput(clone->output(o));
          probe.outputs.push_back(ir.ValueOf(n->output(o)));
        }
      }
      probe.structure = CanonicalGraphText(*probe.graph);
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return probes;
}

// The value of every IR value in one run of the model; `set[i]` says whether value i has one.
struct ProbeRun {
  std::vector<c10::IValue> values;
  std::vector<bool> set;
  int nodes_run = 0;
};

// Runs the probes in order on `graph_inputs` (user inputs, then lifted tensors). With `share`,
// a node whose ops and input kinds (dtype, sizes, strides) equal an earlier node's does not run:
// its values are that node's, which have the same shapes (ShapesFollowFromShapes), so the
// layers of a deep model cost one layer's run.
absl::StatusOr<ProbeRun> RunProbes(const IrGraph& ir, std::vector<NodeProbe>& probes,
                                   const std::vector<c10::IValue>& graph_inputs, bool share) {
  ProbeRun run;
  run.values.resize(ir.values.size());
  run.set.assign(ir.values.size(), false);
  for (size_t i = 0; i < graph_inputs.size(); ++i) {
    run.values[ir.inputs[i]] = graph_inputs[i];
    run.set[ir.inputs[i]] = true;
  }
  std::unordered_map<std::string, size_t> seen;
  for (size_t n = 0; n < probes.size(); ++n) {
    NodeProbe& probe = probes[n];
    std::vector<c10::IValue> stack;
    std::string key = share ? probe.structure : "";
    for (int v : probe.inputs) {
      if (!run.set[v]) {
        return absl::InternalError(absl::StrCat("atomic node ", n, " reads %",
                                                ir.values[v].name, " before it is computed"));
      }
      stack.push_back(run.values[v]);
      if (share) absl::StrAppend(&key, DescribeRuntimeValue(stack.back()), ";");
    }
    if (share) {
      auto [it, added] = seen.emplace(std::move(key), n);
      if (!added) {
        const NodeProbe& same = probes[it->second];
        for (size_t k = 0; k < probe.outputs.size(); ++k) {
          if (run.set[probe.outputs[k]]) continue;
          run.values[probe.outputs[k]] = run.values[same.outputs[k]];
          run.set[probe.outputs[k]] = true;
        }
        continue;
      }
    }
    absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument,
                                    "the model's forward failed", [&] {
      if (!probe.code) probe.code = std::make_unique<torch::jit::Code>(probe.graph, "probe");
      torch::jit::InterpreterState(*probe.code).run(stack);
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    ++run.nodes_run;
    if (stack.size() != probe.outputs.size()) {
      return absl::InternalError(absl::StrCat("probe of atomic node ", n, " returned ",
                                              stack.size(), " values, expected ",
                                              probe.outputs.size()));
    }
    for (size_t k = 0; k < probe.outputs.size(); ++k) {
      if (run.set[probe.outputs[k]]) continue;
      run.values[probe.outputs[k]] = std::move(stack[k]);
      run.set[probe.outputs[k]] = true;
    }
  }
  return run;
}

// Ops that draw from a generator. Node::isNondeterministic() knows most of them from their
// schemas; the names also catch ops whose schema it does not list (and are cheap to over-lock).
bool IsRandomKind(const torch::jit::Node* n) {
  static const std::set<std::string> kinds = {
      "aten::dropout",          "aten::dropout_",         "aten::feature_dropout",
      "aten::feature_dropout_", "aten::alpha_dropout",    "aten::alpha_dropout_",
      "aten::feature_alpha_dropout", "aten::feature_alpha_dropout_", "aten::native_dropout",
      "aten::_fused_dropout",   "aten::bernoulli",        "aten::bernoulli_",
      "aten::rand",             "aten::rand_like",        "aten::randn",
      "aten::randn_like",       "aten::randint",          "aten::randint_like",
      "aten::randperm",         "aten::normal",           "aten::normal_",
      "aten::uniform_",         "aten::multinomial",      "aten::poisson",
      "aten::binomial",         "aten::exponential_",     "aten::geometric_",
      "aten::cauchy_",          "aten::log_normal_",      "aten::random_",
      "aten::rrelu",            "aten::rrelu_",           "aten::rrelu_with_noise",
      "aten::rrelu_with_noise_", "aten::_standard_gamma", "aten::_sample_dirichlet",
  };
  return kinds.count(n->kind().toQualString()) > 0;
}

// Copies of the lifted tensors the graph may write (buffers), to put back after a run; the
// others (all parameters, usually) are only read and need no copy.
class SavedTensors {
 public:
  SavedTensors(const IrGraph& ir, const std::vector<at::Tensor>& tensors) : tensors_(tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (ir.values[ir.inputs[ir.num_user_inputs + i]].written) {
        saved_.emplace_back(i, tensors[i].clone());
      }
    }
  }
  void Restore() const {
    at::NoGradGuard no_grad;
    for (const auto& [i, t] : saved_) tensors_[i].copy_(t);
  }

 private:
  const std::vector<at::Tensor>& tensors_;
  std::vector<std::pair<size_t, at::Tensor>> saved_;
};

// The runtime check behind the static one (graph/batch_flow.h): runs the model on each of the
// two samples of `run_pair` apart (with the pair's step inputs, as shards of one batch get) and
// compares the outputs with the pair's: batched outputs row by row, the others as the means or
// sums the static analysis says they are. "" when they agree, else why not. Buffers are restored.
absl::StatusOr<std::string> CrossCheckSeparable(const std::vector<at::Tensor>& pair_inputs,
                                                const std::vector<at::Tensor>& tensors,
                                                std::vector<NodeProbe>& probes, bool share,
                                                const ProbeRun& run_pair, const IrGraph& ir) {
  const SavedTensors saved(ir, tensors);
  std::vector<absl::StatusOr<ProbeRun>> single;
  {
    at::NoGradGuard no_grad;
    for (int64_t sample = 0; sample < 2; ++sample) {
      std::vector<c10::IValue> inputs;
      for (size_t i = 0; i < pair_inputs.size(); ++i) {
        const at::Tensor& t = pair_inputs[i];
        inputs.emplace_back(i < ir.num_client_inputs ? t.narrow(0, sample, 1) : t);
      }
      for (const at::Tensor& t : tensors) inputs.emplace_back(t);
      single.push_back(RunProbes(ir, probes, inputs, share));
      saved.Restore();
    }
  }
  for (const auto& run : single) {
    if (!run.ok()) {
      return absl::StrCat("the model fails on a single sample: ", run.status().message());
    }
  }
  auto close = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes().equals(b.sizes()) &&
           (at::isFloatingType(a.scalar_type())
                ? at::allclose(a.to(at::kDouble), b.to(at::kDouble), 1e-4, 1e-5)
                : at::equal(a, b));
  };
  std::string why;
  absl::Status status = TorchCall(absl::StatusCode::kInternal, "checking samples' independence",
                                  [&] {
    for (int id : ir.outputs) {
      const IrValue& value = ir.values[id];
      if (!value.is_tensor || value.role != ValueRole::kActivation) continue;
      const at::Tensor pair = run_pair.values[id].toTensor();
      const at::Tensor one = single[0]->values[id].toTensor();
      const at::Tensor two = single[1]->values[id].toTensor();
      if (value.batch_dim >= 0) {
        const int64_t rows = pair.size(value.batch_dim) / 2;
        if (!close(pair.narrow(value.batch_dim, 0, rows), one) ||
            !close(pair.narrow(value.batch_dim, rows, rows), two)) {
          why = absl::StrCat("output %", value.name, " of a sample depends on the other samples "
                             "of the batch");
          break;
        }
      } else if (value.reduction == IrValue::Reduction::kMean) {
        if (!close(pair, (one + two) / 2)) {
          why = absl::StrCat("output %", value.name, " is not the mean of the samples' values");
          break;
        }
      } else if (value.reduction == IrValue::Reduction::kSum) {
        if (!close(pair, one + two)) {
          why = absl::StrCat("output %", value.name, " is not the sum of the samples' values");
          break;
        }
      }
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return why;
}

// Merges overlapping [first, last] ranges over `count` anchors; returns group start indices.
std::vector<int> MergeRanges(int count, std::vector<std::pair<int, int>> ranges) {
  std::vector<int> reach(count);
  for (int i = 0; i < count; ++i) reach[i] = i;
  for (auto [a, b] : ranges) {
    if (a >= 0 && a < count) reach[a] = std::max(reach[a], std::min(b, count - 1));
  }
  std::vector<int> starts;
  int end = -1;
  for (int i = 0; i < count; ++i) {
    if (i > end) starts.push_back(i);
    end = std::max(end, reach[i]);
  }
  return starts;
}

// Joins the atomic nodes of each [first, last] range of `ranges` (and of overlapping ranges)
// into one node, keeping the IR's indices (producers, consumers, node_of_op) consistent.
void MergeNodes(IrGraph& ir, const std::vector<std::pair<int, int>>& ranges) {
  const int count = static_cast<int>(ir.nodes.size());
  const std::vector<int> starts = MergeRanges(count, ranges);
  if (static_cast<int>(starts.size()) == count) return;
  std::vector<int> group(count);
  for (size_t g = 0; g < starts.size(); ++g) {
    const int end = g + 1 < starts.size() ? starts[g + 1] : count;
    for (int i = starts[g]; i < end; ++i) group[i] = static_cast<int>(g);
  }
  for (IrValue& v : ir.values) {
    if (v.producer >= 0) v.producer = group[v.producer];
    std::set<int> consumers;
    for (int c : v.consumers) {
      if (group[c] != v.producer) consumers.insert(group[c]);
    }
    v.consumers.assign(consumers.begin(), consumers.end());
  }
  std::vector<IrNode> merged(starts.size());
  for (int i = 0; i < count; ++i) {
    IrNode& m = merged[group[i]];
    IrNode& old = ir.nodes[i];
    m.ops.insert(m.ops.end(), old.ops.begin(), old.ops.end());
    m.label = m.label.empty() ? old.label : absl::StrCat(m.label, ",", old.label);
  }
  for (size_t g = 0; g < merged.size(); ++g) {
    std::set<int> inputs, outputs;
    const int end = g + 1 < starts.size() ? starts[g + 1] : count;
    for (int i = starts[g]; i < end; ++i) {
      for (int v : ir.nodes[i].inputs) {
        if (ir.values[v].producer != static_cast<int>(g)) inputs.insert(v);
      }
      for (int v : ir.nodes[i].outputs) {
        if (!ir.values[v].consumers.empty() || ir.values[v].is_output) outputs.insert(v);
      }
    }
    merged[g].inputs.assign(inputs.begin(), inputs.end());
    merged[g].outputs.assign(outputs.begin(), outputs.end());
  }
  ir.nodes = std::move(merged);
  for (auto& [op, node] : ir.node_of_op) node = group[node];
}

}  // namespace

bool FusesForwardBackward(const IrGraph& ir) {
  if (ir.outputs.empty()) return false;
  const IrValue& first = ir.values[ir.outputs[0]];
  if (!first.is_loss || !first.shape.empty() || !at::isFloatingType(first.dtype)) return false;
  for (size_t i = 1; i < ir.outputs.size(); ++i) {
    if (at::isFloatingType(ir.values[ir.outputs[i]].dtype)) return false;
  }
  return true;
}

bool HasRandomOps(const torch::jit::Block* block) {
  for (const torch::jit::Node* n : block->nodes()) {
    if (IsRandomKind(n) || n->isNondeterministic()) return true;
    for (const torch::jit::Block* b : n->blocks()) {
      if (HasRandomOps(b)) return true;
    }
  }
  return false;
}

std::vector<Value*> ExternalInputs(Node* n) {
  std::vector<Value*> out(n->inputs().begin(), n->inputs().end());
  if (n->blocks().empty()) return out;
  std::unordered_set<const Value*> inside;
  std::function<void(torch::jit::Block*)> visit = [&](torch::jit::Block* b) {
    for (Value* p : b->inputs()) inside.insert(p);
    for (Node* inner : b->nodes()) {
      for (Value* v : inner->inputs()) {
        if (!inside.count(v)) out.push_back(v);
      }
      for (Value* o : inner->outputs()) inside.insert(o);
      for (torch::jit::Block* nested : inner->blocks()) visit(nested);
    }
    for (Value* v : b->outputs()) {
      if (!inside.count(v)) out.push_back(v);
    }
  };
  for (torch::jit::Block* b : n->blocks()) visit(b);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string StableHash(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

at::Tensor RepeatSamples(const at::Tensor& t, int64_t n) {
  return t.index_select(0, at::arange(n, t.options().dtype(at::kLong)).remainder(t.size(0)));
}

const char* ValueRoleName(ValueRole role) {
  switch (role) {
    case ValueRole::kInput: return "input";
    case ValueRole::kParam: return "param";
    case ValueRole::kBuffer: return "buffer";
    case ValueRole::kActivation: return "activation";
    case ValueRole::kParamDerived: return "param-derived";
    case ValueRole::kConst: return "const";
  }
  return "unknown";
}

absl::StatusOr<IrGraph> BuildIr(const ImportedModel& model, const std::vector<at::Tensor>& tensors,
                                const std::vector<at::Tensor>& example_inputs,
                                const IrOptions& options) {
  IrGraph ir;
  ir.module = model.module;
  ir.num_client_inputs = model.input_names.size();
  ir.num_user_inputs = ir.num_client_inputs;
  ir.tensor_names = model.graph_tensor_names;
  if (example_inputs.size() != ir.num_client_inputs || tensors.size() != ir.tensor_names.size()) {
    return absl::InternalError("BuildIr: inputs do not match the graph");
  }
  for (const at::Tensor& t : example_inputs) {
    if (t.dim() == 0) {
      return absl::InvalidArgumentError(
          "every model input must have a batch dimension (dim 0); got a 0-dim tensor");
    }
  }
  ir.example_batch = example_inputs[0].size(0);
  for (const at::Tensor& t : example_inputs) {
    if (t.size(0) != ir.example_batch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "every model input must have the same batch size in dimension 0; got ",
          ir.example_batch, " and ", t.size(0)));
    }
  }

  // Prepare the graph: functional where LibTorch can make it so, tuples gone, outputs flat.
  absl::Status prepared = TorchCall(absl::StatusCode::kInvalidArgument, "preparing the graph", [&] {
    ir.graph = model.graph->copy();
    torch::jit::RemoveTensorMutation(ir.graph);
    torch::jit::LowerSimpleTuples(ir.graph);
    std::vector<Value*> flat;
    for (Value* out : ir.graph->outputs()) {
      absl::Status s = FlattenOutput(out, &flat);
      if (!s.ok()) return s;
    }
    while (!ir.graph->outputs().empty()) ir.graph->eraseOutput(0);
    for (Value* v : flat) ir.graph->registerOutput(v);
    torch::jit::EliminateDeadCode(ir.graph);
    return absl::OkStatus();
  });
  if (!prepared.ok()) return prepared;
  Graph& graph = *ir.graph;
  // Mean losses over counted targets become sums over a per-batch denominator, so that any
  // split of the batch gives the whole batch's mean (graph/loss_denominators.h).
  absl::StatusOr<LossRewrite> rewrite = RewriteMeanLosses(graph, ir.num_client_inputs);
  if (!rewrite.ok()) return rewrite.status();
  ir.loss_rewrite = std::make_shared<const LossRewrite>(std::move(*rewrite));
  ir.num_user_inputs += ir.loss_rewrite->denominators.size();

  // Values, roles and batch dimensions.
  std::map<std::string, bool> is_param;
  for (const ModuleTensor& t : model.tensors) is_param[t.name] = t.is_parameter;
  std::vector<Value*> top = TopLevelValues(graph);
  // Batch-dependent: computed from the inputs at all. Data-dependent: computed from their
  // values, not only their shapes. A tensor made from shapes alone (a traced `x.size(0)` becomes
  // a 0-dim tensor; a causal mask built from the sequence length) is a helper: each stage
  // recomputes it from its own inputs, so it is right for that stage's shard of the batch and
  // never travels.
  std::unordered_set<const Value*> batch_dependent, data_dependent;
  for (size_t i = 0; i < ir.num_user_inputs; ++i) {
    batch_dependent.insert(graph.inputs()[i]);
    data_dependent.insert(graph.inputs()[i]);
  }
  for (Node* n : graph.nodes()) {
    const bool shape_only = IsShapeOp(n);
    bool batch = false, data = false;
    for (Value* in : ExternalInputs(n)) {
      batch = batch || batch_dependent.count(in) > 0;
      data = data || data_dependent.count(in) > 0;
    }
    for (Value* o : n->outputs()) {
      if (batch) batch_dependent.insert(o);
      if (data && !shape_only) data_dependent.insert(o);
    }
  }
  for (size_t i = 0; i < top.size(); ++i) {
    Value* v = top[i];
    IrValue value;
    value.jit = v;
    value.name = v->debugName();
    value.is_tensor = IsTensor(v);
    if (i < graph.inputs().size()) {
      value.role = i < ir.num_user_inputs ? ValueRole::kInput
                   : is_param[ir.tensor_names[i - ir.num_user_inputs]] ? ValueRole::kParam
                                                                       : ValueRole::kBuffer;
    } else if (batch_dependent.count(v)) {
      value.role = ValueRole::kActivation;
    } else {
      value.role = v->node()->kind() == c10::prim::Constant ? ValueRole::kConst
                                                             : ValueRole::kParamDerived;
    }
    ir.value_index[v] = static_cast<int>(ir.values.size());
    ir.values.push_back(std::move(value));
  }
  for (size_t i = 0; i < graph.inputs().size(); ++i) ir.inputs.push_back(static_cast<int>(i));
  std::unordered_set<const Value*> outputs;
  for (Value* o : graph.outputs()) {
    outputs.insert(o);
    int id = ir.ValueOf(o);
    ir.outputs.push_back(id);
    IrValue& value = ir.values[id];
    value.is_output = true;
  }

  // Anchors: ops that compute tensors from the batch, ops with side effects, and ops whose
  // results the model returns. Everything else is a helper.
  std::unique_ptr<torch::jit::AliasDb> alias_db;
  absl::Status aliased = TorchCall(absl::StatusCode::kInternal, "alias analysis", [&] {
    alias_db = std::make_unique<torch::jit::AliasDb>(ir.graph);
    return absl::OkStatus();
  });
  if (!aliased.ok()) return aliased;
  for (size_t i = 0; i < graph.inputs().size(); ++i) {
    IrValue& value = ir.values[i];
    value.written = value.role == ValueRole::kBuffer || alias_db->hasWriters(graph.inputs()[i]);
  }
  std::vector<Node*> anchors;
  std::unordered_map<const Node*, int> anchor_index;
  for (Node* n : graph.nodes()) {
    bool batch = n->outputs().size() > 0 && data_dependent.count(n->output(0)) > 0;
    bool tensor_out = false, returned = false;
    for (Value* o : n->outputs()) {
      tensor_out = tensor_out || IsTensor(o);
      returned = returned || outputs.count(o) > 0;
    }
    bool side_effect = n->hasSideEffects() || alias_db->isMutable(n);
    if ((batch && tensor_out) || returned || side_effect) {
      anchor_index[n] = static_cast<int>(anchors.size());
      anchors.push_back(n);
    }
  }
  if (anchors.empty()) {
    return absl::InvalidArgumentError("the model computes nothing from its inputs");
  }

  // Helpers resolve to the anchor-produced values and graph inputs they read.
  std::unordered_map<const Node*, std::vector<int>> helper_inputs;
  std::function<void(Node*, std::set<int>*)> resolve = [&](Node* n, std::set<int>* out) {
    for (Value* in : ExternalInputs(n)) {
      Node* p = in->node();
      if (p->kind() == c10::prim::Param || anchor_index.count(p)) {
        out->insert(ir.ValueOf(in));
        continue;
      }
      auto memo = helper_inputs.find(p);
      if (memo == helper_inputs.end()) {
        std::set<int> deps;
        resolve(p, &deps);
        memo = helper_inputs.emplace(p, std::vector<int>(deps.begin(), deps.end())).first;
      }
      out->insert(memo->second.begin(), memo->second.end());
    }
  };
  std::vector<std::vector<int>> anchor_inputs(anchors.size());
  for (size_t a = 0; a < anchors.size(); ++a) {
    std::set<int> deps;
    resolve(anchors[a], &deps);
    anchor_inputs[a].assign(deps.begin(), deps.end());
  }
  // Which anchors read each value (through helpers too).
  std::vector<int> last_reader(ir.values.size(), -1);
  std::vector<int> first_writer(ir.values.size(), -1);
  for (size_t a = 0; a < anchors.size(); ++a) {
    for (Value* o : anchors[a]->outputs()) first_writer[ir.ValueOf(o)] = static_cast<int>(a);
    for (int v : anchor_inputs[a]) last_reader[v] = std::max(last_reader[v], static_cast<int>(a));
  }

  // A cut must not separate a write from the reads of what it writes, nor send a non-tensor.
  std::vector<std::pair<int, int>> together;
  for (size_t a = 0; a < anchors.size(); ++a) {
    Node* n = anchors[a];
    for (Value* o : n->outputs()) {
      if (!IsTensor(o) && last_reader[ir.ValueOf(o)] > static_cast<int>(a)) {
        together.emplace_back(a, last_reader[ir.ValueOf(o)]);
      }
    }
    if (!alias_db->isMutable(n)) continue;
    std::vector<Value*> written;
    const c10::FunctionSchema* schema = n->maybeSchema();
    for (size_t i = 0; i < n->inputs().size(); ++i) {
      bool writes = schema == nullptr ||
                    (i < schema->arguments().size() && schema->arguments()[i].alias_info() &&
                     schema->arguments()[i].alias_info()->isWrite());
      if (writes && IsTensor(n->input(i))) written.push_back(n->input(i));
    }
    int first = static_cast<int>(a), last = static_cast<int>(a);
    for (Value* w : written) {
      for (size_t v = 0; v < ir.values.size(); ++v) {
        if (!ir.values[v].is_tensor || !alias_db->mayAlias(w, ir.values[v].jit)) continue;
        if (first_writer[v] >= 0) first = std::min(first, first_writer[v]);
        last = std::max(last, last_reader[v]);
      }
    }
    if (first < last) together.emplace_back(first, last);
  }
  // A rewritten mean loss stays one piece with its division (graph/loss_denominators.h).
  for (const LossDenominator& d : ir.loss_rewrite->denominators) {
    auto loss = anchor_index.find(d.loss);
    auto mean = anchor_index.find(d.mean);
    if (loss != anchor_index.end() && mean != anchor_index.end()) {
      together.emplace_back(loss->second, mean->second);
    }
  }
  std::vector<int> starts = MergeRanges(static_cast<int>(anchors.size()), together);

  // Atomic nodes.
  for (size_t s = 0; s < starts.size(); ++s) {
    int begin = starts[s];
    int end = s + 1 < starts.size() ? starts[s + 1] : static_cast<int>(anchors.size());
    IrNode node;
    std::set<int> produced, read;
    std::vector<std::string> kinds;
    for (int a = begin; a < end; ++a) {
      node.ops.push_back(anchors[a]);
      std::string kind = anchors[a]->kind().toQualString();
      if (kinds.empty() || kinds.back() != kind) kinds.push_back(kind);
      for (int v : anchor_inputs[a]) {
        if (!produced.count(v)) read.insert(v);
      }
      for (Value* o : anchors[a]->outputs()) produced.insert(ir.ValueOf(o));
    }
    node.inputs.assign(read.begin(), read.end());
    node.label = absl::StrJoin(kinds, ",");
    const int index = static_cast<int>(ir.nodes.size());
    for (int v : produced) {
      ir.values[v].producer = index;
      if (last_reader[v] >= end || ir.values[v].is_output) node.outputs.push_back(v);
    }
    for (int v : node.inputs) ir.values[v].consumers.push_back(index);
    ir.nodes.push_back(std::move(node));
  }

  {
    int position = 0;
    for (Node* n : graph.nodes()) ir.op_position[n] = position++;
    for (size_t i = 0; i < ir.nodes.size(); ++i) {
      for (Node* op : ir.nodes[i].ops) ir.node_of_op[op] = static_cast<int>(i);
    }
  }

  // Record every value at two small batches (the example's samples, repeated as needed): the
  // dimension that changes is the batch, and shapes at the example batch follow by
  // extrapolation, without running the model at full size. The model runs node by node; where
  // shapes follow from shapes alone, a node that repeats an earlier one (the same ops on inputs
  // of the same kinds: the next layer of a transformer) takes that node's values instead of
  // running, so a deep model costs about one of its layers. Buffers are restored.
  absl::StatusOr<std::vector<NodeProbe>> probes = BuildProbes(ir);
  if (!probes.ok()) return probes.status();
  const bool share = options.share_repeated_nodes && ShapesFollowFromShapes(graph);
  constexpr int64_t kProbeA = 2, kProbeB = 3;
  const SavedTensors saved(ir, tensors);
  auto batch_of = [&](int64_t samples) -> absl::StatusOr<std::vector<at::Tensor>> {
    std::vector<at::Tensor> client;
    for (const at::Tensor& t : example_inputs) client.push_back(RepeatSamples(t, samples));
    return WithStepInputs(ir, std::move(client), tensors);
  };
  absl::StatusOr<std::vector<at::Tensor>> batch_a = batch_of(kProbeA);
  if (!batch_a.ok()) return batch_a.status();
  absl::StatusOr<std::vector<at::Tensor>> batch_b = batch_of(kProbeB);
  if (!batch_b.ok()) return batch_b.status();
  std::vector<c10::IValue> inputs_a(batch_a->begin(), batch_a->end());
  std::vector<c10::IValue> inputs_b(batch_b->begin(), batch_b->end());
  for (const at::Tensor& t : tensors) {
    inputs_a.emplace_back(t);
    inputs_b.emplace_back(t);
  }
  absl::StatusOr<ProbeRun> run_a, run_b;
  {
    at::NoGradGuard no_grad;
    run_a = RunProbes(ir, *probes, inputs_a, share);
    saved.Restore();
    if (run_a.ok()) run_b = RunProbes(ir, *probes, inputs_b, share);
    saved.Restore();
  }
  for (const auto* run : {&run_a, &run_b}) {
    if (run->ok()) continue;
    // A model that fails on its example inputs as they are is simply wrong there (a shape, a
    // dtype); one that only fails on other batch sizes fixed its batch size. Only a failure
    // costs this run of the whole example.
    absl::StatusOr<std::vector<at::Tensor>> whole_batch =
        WithStepInputs(ir, example_inputs, tensors);
    if (!whole_batch.ok()) return whole_batch.status();
    std::vector<c10::IValue> example(whole_batch->begin(), whole_batch->end());
    example.insert(example.end(), tensors.begin(), tensors.end());
    absl::StatusOr<ProbeRun> whole;
    {
      at::NoGradGuard no_grad;
      whole = RunProbes(ir, *probes, example, /*share=*/false);
      saved.Restore();
    }
    if (!whole.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the model fails on its example inputs: ", whole.status().message()));
    }
    const int64_t probe = run == &run_a ? kProbeA : kProbeB;
    return absl::InvalidArgumentError(absl::StrCat(
        "the model fails with a batch of ", probe, " samples (the example has ",
        ir.example_batch, "), so it cannot be split into micro-batches; the trace probably "
        "fixed the batch size (e.g. x.view(", ir.example_batch, ", ...)): use x.size(0) or -1 "
        "instead. The error: ", run->status().message()));
  }
  ir.nodes_probed = run_a->nodes_run;
  std::unordered_map<const Value*, ValueFacts> facts;
  for (size_t i = 0; i < ir.values.size(); ++i) {
    IrValue& value = ir.values[i];
    if (!run_a->set[i] || !run_b->set[i]) continue;
    const c10::IValue& a = run_a->values[i];
    const c10::IValue& b = run_b->values[i];
    if (value.is_tensor && a.isTensor() && b.isTensor()) {
      const at::Tensor& ta = a.toTensor();
      const at::Tensor& tb = b.toTensor();
      value.dtype = ta.scalar_type();
      value.shape = ta.sizes().vec();
      if (value.role == ValueRole::kActivation || value.role == ValueRole::kInput) {
        if (ta.dim() != tb.dim()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "value %", value.name, " changes rank with the batch size (",
              DescribeTensor(ta.scalar_type(), ta.sizes()), " vs ",
              DescribeTensor(tb.scalar_type(), tb.sizes()), "); the planner cannot split it"));
        }
        ValueFacts& f = facts[value.jit];
        for (int64_t d = 0; d < ta.dim(); ++d) {
          if (ta.size(d) == tb.size(d)) continue;
          // A whole number of rows per sample, in one dimension only: what the runtime's
          // shards assume (PerSample).
          f.regular = f.regular && value.batch_dim < 0 &&
                      ta.size(d) * kProbeB == tb.size(d) * kProbeA;
          if (value.batch_dim >= 0) continue;
          value.batch_dim = static_cast<int>(d);
          // Sizes along the batch are affine in it (b, b * seq, ...).
          value.shape[d] = ta.size(d) + (tb.size(d) - ta.size(d)) * (ir.example_batch - kProbeA);
        }
        f.batch_dim = value.batch_dim;
        f.shape = value.shape;
      } else {
        facts[value.jit].shape = value.shape;
      }
      int64_t numel = 1;
      for (int64_t s : value.shape) numel *= s;
      value.bytes = numel * static_cast<int64_t>(ta.element_size());
    }
  }
  for (int id : ir.outputs) {
    IrValue& value = ir.values[id];
    value.is_loss = value.role == ValueRole::kActivation && value.batch_dim < 0;
  }

  // Whether the batch may be split: decided op by op (graph/batch_flow.h), then, for models
  // without random ops, checked on two samples run apart.
  BatchFlowInputs flow_inputs;
  flow_inputs.graph = &graph;
  flow_inputs.num_client_inputs = ir.num_client_inputs;
  flow_inputs.num_step_inputs = ir.num_user_inputs - ir.num_client_inputs;
  flow_inputs.example_batch = ir.example_batch;
  flow_inputs.losses = ir.loss_rewrite.get();
  flow_inputs.facts = [&](const Value* v) -> const ValueFacts* {
    auto it = facts.find(v);
    return it == facts.end() ? nullptr : &it->second;
  };
  BatchFlow flow;
  absl::Status analyzed = TorchCall(absl::StatusCode::kInternal, "following the batch", [&] {
    flow = AnalyzeBatchFlow(flow_inputs);
    return absl::OkStatus();
  });
  if (!analyzed.ok()) return analyzed;
  ir.batch_separable = flow.separable;
  ir.not_separable = flow.why;
  for (const auto& [v, reduction] : flow.reductions) {
    ir.values[ir.ValueOf(v)].reduction = reduction == SampleReduction::kMean
                                             ? IrValue::Reduction::kMean
                                             : IrValue::Reduction::kSum;
  }
  if (ir.batch_separable && !HasRandomOps(graph.block())) {
    absl::StatusOr<std::string> checked =
        CrossCheckSeparable(*batch_a, tensors, *probes, share, *run_a, ir);
    if (!checked.ok()) return checked.status();
    if (!checked->empty()) {
      spdlog::warn("the batch looked separable op by op, but {}; it stays whole", *checked);
      ir.batch_separable = false;
      ir.not_separable = *checked;
    }
  }
  if (!ir.batch_separable) {
    for (IrValue& v : ir.values) v.reduction = IrValue::Reduction::kUnknown;
  } else {
    // A value computed from the batch without a batch dimension (a sum over the samples) is
    // each shard's own: it cannot be re-split between stages of different replica counts, so
    // it never crosses a stage boundary.
    std::vector<std::pair<int, int>> keep;
    for (const IrValue& v : ir.values) {
      if (v.role != ValueRole::kActivation || !v.is_tensor || v.batch_dim >= 0 || v.producer < 0) {
        continue;
      }
      int last = v.producer;
      for (int c : v.consumers) last = std::max(last, c);
      if (last > v.producer) keep.emplace_back(v.producer, last);
    }
    if (!keep.empty()) MergeNodes(ir, keep);
  }

  // A structural hash: ops in order, how they connect, dtypes and non-batch shapes, constants.
  std::ostringstream sig;
  for (Node* n : graph.nodes()) {
    sig << n->kind().toQualString() << '(';
    for (Value* in : n->inputs()) sig << ir.ValueOf(in) << ',';
    sig << ")";
    if (n->kind() == c10::prim::Constant && n->outputs().size() == 1) {
      c10::optional<c10::IValue> c = torch::jit::toIValue(n->output());
      if (c && c->isTensor()) {
        sig << "tensor" << c->toTensor().sizes();
      } else if (c) {
        sig << *c;
      }
    }
    for (Value* o : n->outputs()) {
      const IrValue& v = ir.values[ir.ValueOf(o)];
      sig << ' ' << (v.role == ValueRole::kActivation ? 'a' : 'p');
      if (v.is_tensor) {
        sig << c10::toString(v.dtype) << '[';
        for (size_t d = 0; d < v.shape.size(); ++d) {
          sig << (static_cast<int>(d) == v.batch_dim ? -1 : v.shape[d]) << ',';
        }
        sig << ']';
      }
    }
    sig << ';';
  }
  for (size_t i = 0; i < ir.inputs.size(); ++i) {
    const IrValue& v = ir.values[i];
    sig << "in" << i << c10::toString(v.dtype) << v.shape.size() << ';';
  }
  ir.hash = StableHash(sig.str());
  return ir;
}

absl::StatusOr<std::vector<at::Tensor>> WithStepInputs(const IrGraph& ir,
                                                       std::vector<at::Tensor> client_inputs,
                                                       const LiftedTensor& lifted) {
  if (client_inputs.size() != ir.num_client_inputs) {
    return absl::InvalidArgumentError(absl::StrCat(client_inputs.size(), " inputs for ",
                                                   ir.num_client_inputs));
  }
  if (ir.loss_rewrite == nullptr || ir.loss_rewrite->denominators.empty()) return client_inputs;
  absl::StatusOr<std::vector<at::Tensor>> steps =
      DenominatorInputs(*ir.loss_rewrite, client_inputs, lifted);
  if (!steps.ok()) return steps.status();
  client_inputs.insert(client_inputs.end(), steps->begin(), steps->end());
  return client_inputs;
}

absl::StatusOr<std::vector<at::Tensor>> WithStepInputs(const IrGraph& ir,
                                                       std::vector<at::Tensor> client_inputs,
                                                       const std::vector<at::Tensor>& tensors) {
  return WithStepInputs(ir, std::move(client_inputs), [&](int i) { return tensors[i]; });
}

double CutBytesPerSample(const IrGraph& ir, int boundary) {
  double bytes = 0;
  for (const IrValue& v : ir.values) {
    if (v.producer < 0 || v.producer >= boundary || !v.is_tensor) continue;
    bool crosses = false;
    for (int c : v.consumers) crosses = crosses || c >= boundary;
    if (crosses) bytes += static_cast<double>(v.bytes) / ir.example_batch;
  }
  return bytes;
}

std::string DescribeIr(const IrGraph& ir) {
  std::ostringstream out;
  auto describe = [&](int id) {
    const IrValue& v = ir.values[id];
    std::string s = absl::StrCat("%", v.name, ":", ValueRoleName(v.role));
    if (v.is_tensor) absl::StrAppend(&s, ":", DescribeTensor(v.dtype, v.shape));
    if (v.batch_dim >= 0) absl::StrAppend(&s, "@", v.batch_dim);
    return s;
  };
  for (size_t i = 0; i < ir.nodes.size(); ++i) {
    const IrNode& n = ir.nodes[i];
    std::vector<std::string> ins, outs;
    for (int v : n.inputs) ins.push_back(describe(v));
    for (int v : n.outputs) outs.push_back(describe(v));
    out << i << ' ' << n.label << " (" << absl::StrJoin(ins, ", ") << ") -> ("
        << absl::StrJoin(outs, ", ") << ")\n";
  }
  return out.str();
}

}  // namespace rannc
