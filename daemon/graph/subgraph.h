// Turns a convex set of an IrGraph's atomic nodes (for instance a contiguous range, which is
// always convex) back into a runnable torch::jit::Graph with explicit inputs and outputs: the
// set's ops plus every helper they need (parameter-only ops, constants, size computations),
// recomputed locally. This is what a pipeline stage runs, and what the profiler times.
//
// VerifySplit runs the stages of a split in sequence on one device and compares the outputs,
// and the parameter gradients of their sum, with the whole model: the check behind the
// `verify_partitioning` config key and the split tests.
//
//   absl::StatusOr<Subgraph> stage = BuildSubgraph(ir, /*begin=*/0, /*end=*/3);
//   // run: one stack value per stage->inputs[i] (IR value ids), returns stage->outputs.
//
// Pure functions of the IrGraph; safe from any thread. A Subgraph owns its graph.
#ifndef RANNC_DAEMON_GRAPH_SUBGRAPH_H_
#define RANNC_DAEMON_GRAPH_SUBGRAPH_H_

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"

namespace rannc {

struct Subgraph {
  std::vector<int> nodes;  // the atomic nodes it runs, ascending
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<int> inputs;   // IrGraph value ids, in the graph's input order
  std::vector<int> outputs;  // IrGraph value ids, in the graph's output order
};

// INVALID_ARGUMENT for an empty or out-of-range set, or one that is not convex (a node outside
// it both depends on the set and feeds it, so no stage could run the set at once).
absl::StatusOr<Subgraph> BuildSubgraph(const IrGraph& ir, std::vector<int> nodes);
// The nodes [begin, end).
absl::StatusOr<Subgraph> BuildSubgraph(const IrGraph& ir, int begin, int end);

// Splits the atomic nodes [begin, end) into consecutive blocks for parameter offload's streaming
// (runtime/pipeline_engine_offload.cc): the first node of each block, `begin` first. A block
// takes nodes while the parameters they read (counted once per block, where the block first
// reads them) stay within `max_param_bytes`; a node that reads more alone makes a block of its
// own, and nodes that read no parameter join the block before them (the first block, before
// any). One block when `max_param_bytes` <= 0 or the range reads no more than that.
std::vector<int> ParamBlockStarts(const IrGraph& ir, int begin, int end, int64_t max_param_bytes);

// For running `graph` on `device` (a CUDA device; nothing for the CPU): the host the model was
// traced on becomes the device. Its device constants naming the CPU (factory ops such as
// torch.ones(..., device="cpu") recorded by torch.jit.trace) name `device`, and its tensor
// constants move there, except 0-dim integer constants of the shape arithmetic torch.jit.trace
// records (x.size(2) // heads, read back with aten::Int): those stay host scalars, so that
// reading the result does not wait for the device. A model that moves a value to the host on
// purpose then keeps it on the device.
void PlaceOnDevice(torch::jit::Graph& graph, c10::Device device);

// Runs `graph` (any graph whose outputs are values, e.g. a Subgraph's) on `inputs`.
absl::StatusOr<std::vector<c10::IValue>> RunGraph(const std::shared_ptr<torch::jit::Graph>& graph,
                                                  std::vector<c10::IValue> inputs);

// Splits `ir` at `stage_starts` (the first atomic node of each stage; must start with 0 and
// increase) and checks, on copies of `tensors` (the lifted inputs) and the client's `inputs`
// (the step inputs are computed from them), that running the stages in
// sequence gives the whole model's outputs, and the same gradients of the sum of its floating
// outputs, within rtol/atol. INTERNAL with the first mismatch otherwise.
absl::Status VerifySplit(const IrGraph& ir, const std::vector<int>& stage_starts,
                         const std::vector<at::Tensor>& tensors,
                         const std::vector<at::Tensor>& inputs, double rtol = 1e-5,
                         double atol = 1e-6);

// The same for any partition of the atomic nodes into convex sets, run in the order given
// (each set may read only what earlier sets produced).
absl::Status VerifyPartition(const IrGraph& ir, const std::vector<std::vector<int>>& stages,
                             const std::vector<at::Tensor>& tensors,
                             const std::vector<at::Tensor>& inputs, double rtol = 1e-5,
                             double atol = 1e-6);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_SUBGRAPH_H_
