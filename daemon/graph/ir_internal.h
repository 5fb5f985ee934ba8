// Private to //daemon/graph:ir: what BuildIr's files share.
//   ir.cc          BuildIr: the graph prepared, values and roles, atomic nodes, the probe runs'
//                  facts, the batch's separability, the hash
//   ir_probes.cc   probes: each atomic node as a graph runnable alone, runs of them in order,
//                  and the runtime check that samples are independent
//   ir_queries.cc  questions about a graph or a built IR (ir.h's other functions)
// Used during one BuildIr, on its thread.
#ifndef RANNC_DAEMON_GRAPH_IR_INTERNAL_H_
#define RANNC_DAEMON_GRAPH_IR_INTERNAL_H_

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"

namespace rannc {
namespace ir_internal {

// Ops whose results are sizes or shapes, not data.
bool IsShapeOp(const torch::jit::Node* n);

// One atomic node, runnable alone: its ops and every helper they read, with every value it
// computes as an output, so a run of all probes in order records every top-level value.
struct NodeProbe {
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<int> inputs;   // IR value ids, in the graph's input order
  std::vector<int> outputs;  // IR value ids of every value the graph computes, in order
  std::string structure;     // CanonicalGraphText(*graph)
  std::unique_ptr<torch::jit::Code> code;  // made at the first run
};

// A probe per atomic node of `ir` (its op_position and node_of_op filled).
absl::StatusOr<std::vector<NodeProbe>> BuildProbes(const IrGraph& ir);

// The value of every IR value in one run of the model; `set[i]` says whether value i has one.
struct ProbeRun {
  std::vector<c10::IValue> values;
  std::vector<bool> set;
  int nodes_run = 0;
};

// Runs the probes in order on `graph_inputs` (user inputs, then lifted tensors). With `share`,
// a node whose ops and input kinds (dtype, sizes, strides) equal an earlier node's does not run:
// its values are that node's, which have the same shapes (ShapesFollowFromShapes), so the
// layers of a deep model cost one layer's run. With `device`, each probe's tensor inputs are
// copied there before it runs (the lifted tensors for that probe only), so its outputs are
// computed there and stay there.
absl::StatusOr<ProbeRun> RunProbes(const IrGraph& ir, std::vector<NodeProbe>& probes,
                                   const std::vector<c10::IValue>& graph_inputs, bool share,
                                   const std::optional<c10::Device>& device = std::nullopt);

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
                                                const ProbeRun& run_pair, const IrGraph& ir);

}  // namespace ir_internal
}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_IR_INTERNAL_H_
