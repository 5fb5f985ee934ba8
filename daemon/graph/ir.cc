// BuildIr (ir.h): the imported graph prepared, its values and their roles, the atomic nodes and
// what must stay together, each value's facts from the probe runs (ir_probes.cc), whether the
// batch may be split, and the structural hash; and the step inputs of a batch.
#include "daemon/graph/ir.h"

#include <algorithm>
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

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/batch_flow.h"
#include "daemon/graph/ir_internal.h"

namespace rannc {
namespace {

using ir_internal::BuildProbes;
using ir_internal::CrossCheckSeparable;
using ir_internal::IsShapeOp;
using ir_internal::NodeProbe;
using ir_internal::ProbeRun;
using ir_internal::RunProbes;
using ir_internal::SavedTensors;

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

// IrOptions::dtype_device: each tensor value's dtype as `device` computes it.
void TakeDeviceDtypes(IrGraph& ir, std::vector<NodeProbe>& probes,
                      const std::vector<c10::IValue>& inputs, bool share,
                      const c10::Device& device) {
  absl::StatusOr<ProbeRun> run;
  {
    at::NoGradGuard no_grad;
    run = RunProbes(ir, probes, inputs, share, device);  // host tensors stay as they were
  }
  if (!run.ok()) {
    spdlog::warn("the model does not run node by node on {} ({}): the IR keeps the host's "
                 "dtypes, and a stage casts what it sends to them",
                 device.str(), std::string(run.status().message()));
    return;
  }
  int changed = 0;
  for (size_t i = 0; i < ir.values.size(); ++i) {
    IrValue& value = ir.values[i];
    if (!run->set[i] || !value.is_tensor || !run->values[i].isTensor()) continue;
    const c10::ScalarType dtype = run->values[i].toTensor().scalar_type();
    if (dtype == value.dtype) continue;
    value.bytes = value.bytes / static_cast<int64_t>(c10::elementSize(value.dtype)) *
                  static_cast<int64_t>(c10::elementSize(dtype));
    value.dtype = dtype;
    ++changed;
  }
  spdlog::info("IR: {} values have other dtypes on {} than on the host (its autocast)", changed,
               device.str());
}

}  // namespace

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
  if (options.dtype_device.has_value()) {
    TakeDeviceDtypes(ir, *probes, inputs_a, share, *options.dtype_device);
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
  for (const auto& [v, outer] : flow.interleaved) {
    auto it = ir.value_index.find(v);
    if (it != ir.value_index.end()) ir.values[it->second].interleave = outer;
  }
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

}  // namespace rannc
