// BuildIr's probes (ir_internal.h): each atomic node as a graph that runs alone, runs of them in
// order that record every value of one batch (sharing a repeated node's values where shapes
// follow from shapes), and the runtime check that the samples of a batch are independent.
#include <algorithm>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/graph/ir_internal.h"
#include "daemon/graph/structure.h"

namespace rannc {
namespace ir_internal {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

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

absl::StatusOr<ProbeRun> RunProbes(const IrGraph& ir, std::vector<NodeProbe>& probes,
                                   const std::vector<c10::IValue>& graph_inputs, bool share,
                                   const std::optional<c10::Device>& device) {
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
      if (device) {
        for (c10::IValue& v : stack) {
          if (v.isTensor()) v = v.toTensor().to(*device);
        }
      }
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

}  // namespace ir_internal
}  // namespace rannc
