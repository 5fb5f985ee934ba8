// The daemon's IR of a model: the imported TorchScript graph, prepared for splitting, with every
// value typed by an example run (dtype, shape, which dimension is the batch, what role it
// plays) and the graph's batch-dependent tensor ops grouped into atomic nodes in one
// topological order. A contiguous range of atomic nodes is convex, so any range can become a
// pipeline stage (graph/subgraph.h turns a range back into a runnable graph).
//
// Atomic nodes follow RaNNC: every op that computes a tensor from the batch's values is (part
// of) a node; ops that only touch parameters and constants, ops that produce non-tensor values
// (sizes, lists, tuples), and tensors made from shapes alone (a traced x.size(0), a causal mask
// of the sequence length) are "helpers" that join every node that consumes them, so they are
// recomputed in each stage that needs them, for its own shard of the batch, and never cross a
// stage boundary. In-place ops on
// batch values, and non-tensor outputs of a batch op, force their producer and consumers into
// one atomic node, so a cut can never separate a write from a read.
//
//   absl::StatusOr<IrGraph> ir = BuildIr(imported, param_tensors, example_inputs);
//   for (const IrNode& node : ir->nodes) ...;  // node.inputs/outputs index ir->values
//
// An IrGraph is immutable once built and may be read from any thread; it owns its graph.
#ifndef RANNC_DAEMON_GRAPH_IR_H_
#define RANNC_DAEMON_GRAPH_IR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/graph/loss_denominators.h"
#include "daemon/graph/torchscript_import.h"

namespace torch {
namespace jit {
struct Block;
struct Graph;
struct Node;
struct Value;
}  // namespace jit
}  // namespace torch

namespace rannc {

enum class ValueRole {
  kInput,         // a forward argument from the client (batched along dim 0), or a step input
  kParam,         // a lifted parameter
  kBuffer,        // a lifted buffer (BatchNorm statistics; may be mutated by the model)
  kActivation,    // computed from the batch
  kParamDerived,  // computed from parameters, buffers and constants only
  kConst,         // a constant in the graph
};
const char* ValueRoleName(ValueRole role);

struct IrValue {
  torch::jit::Value* jit = nullptr;  // in IrGraph::graph
  std::string name;                  // the graph's debug name
  ValueRole role = ValueRole::kConst;
  bool is_tensor = false;
  // Tensors, from the example run: dtype, shape at the example batch size, and the dimension
  // that scales with the batch (-1 when none: a loss, a mean over the batch, a parameter).
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;
  int batch_dim = -1;
  // > 1: the batch dimension holds this many blocks, each with every sample's rows in order
  // (graph/batch_flow.h, BatchFlow::interleaved): its samples are not whole runs of rows, so a
  // stage boundary that reshards it between different replica counts is not planned.
  int64_t interleave = 1;
  bool is_loss = false;        // a model output with no batch dimension that depends on the batch
  // For a loss: how the whole batch's value combines its samples' (found by running the model
  // on samples apart), so shards of the batch can be combined exactly.
  enum class Reduction { kUnknown, kMean, kSum } reduction = Reduction::kUnknown;
  int producer = -1;           // the atomic node that computes it; -1 for inputs and helpers
  std::vector<int> consumers;  // atomic nodes that read it (directly or through helpers)
  bool is_output = false;      // one of the model's (flattened) outputs
  // For graph inputs: an op of the graph may write it in place (a BatchNorm buffer), so a run
  // on the model's own tensors must save and restore it.
  bool written = false;
  int64_t bytes = 0;           // at the example batch size
};

struct IrNode {
  std::vector<torch::jit::Node*> ops;  // the batch ops of this node, in graph order
  std::vector<int> inputs;   // values read from outside the node (through helpers too)
  std::vector<int> outputs;  // values computed here and read by later nodes or returned
  std::string label;         // the ops' kinds, for plans a person reads ("aten::linear")
};

struct IrGraph {
  // Inlined, parameters lifted to inputs, tensor mutation removed where LibTorch can, tuples
  // lowered, outputs flattened in the order ModelRunner returns them.
  std::shared_ptr<torch::jit::Graph> graph;
  std::shared_ptr<torch::jit::Module> module;  // keeps call stacks alive (see ImportedModel)
  std::vector<IrValue> values;
  std::unordered_map<const torch::jit::Value*, int> value_index;
  std::vector<IrNode> nodes;  // atomic nodes, topologically ordered
  std::vector<int> inputs;    // graph inputs: user inputs, then lifted tensors
  std::vector<int> outputs;   // flattened model outputs
  // User inputs: the client's forward arguments, then the step inputs, values the daemon
  // computes from each whole batch and every shard reads whole (the denominators of mean
  // losses over counted targets: WithStepInputs).
  size_t num_user_inputs = 0;
  size_t num_client_inputs = 0;
  std::shared_ptr<const LossRewrite> loss_rewrite;
  std::vector<std::string> tensor_names;  // per lifted input, the module tensor's dotted name
  int64_t example_batch = 0;
  // Whether the model treats samples independently: batched outputs of a batch are its
  // samples' outputs, and every loss is a mean or a sum of its samples'. BatchNorm in training
  // mode (statistics over the batch) is not. A model that is not cannot have its batch split
  // into micro-batches or replicas without changing its results; `not_separable` says why (the
  // op, where it is in the model, what it does). Decided op by op (graph/batch_flow.h) and, for
  // models without random ops, checked on two samples run apart.
  bool batch_separable = true;
  std::string not_separable;
  // A stable hash of the graph's structure, dtypes and non-batch shapes: equal for retraces of
  // the same model, different for a different one. Deployment files record it.
  std::string hash;
  // Atomic nodes that ran in BuildIr's first probe run; the others repeat one of them and took
  // its values (IrOptions::share_repeated_nodes). For logs and tests.
  int nodes_probed = 0;

  // For building stage graphs fast (graph/subgraph.h): each top-level op's position in `graph`,
  // and the atomic node of each op that belongs to one. Filled by BuildIr.
  std::unordered_map<const torch::jit::Node*, int> op_position;
  std::unordered_map<const torch::jit::Node*, int> node_of_op;

  int ValueOf(const torch::jit::Value* v) const { return value_index.at(v); }
};

struct IrOptions {
  // Runs a node that repeats an earlier one (the same ops, constants and attributes on inputs of
  // the same dtypes, sizes and strides: the next layer of a transformer) only once per run,
  // giving the repeat the earlier node's values. Applies only to models whose shapes follow
  // from the shapes of their inputs (no op turns tensor contents into sizes or scalars); the
  // IR is the same either way, only faster to build. False runs every node (tests compare).
  bool share_repeated_nodes = true;
  // Where the job's stages run when that is not the host (a CUDA device): the values' dtypes
  // are then those of one more run, on that device, under the caller's autocast for it (CUDA's
  // autocast casts other ops than the CPU's: softmax and LayerNorm to fp32, for one), so that
  // the values stages send each other have the dtypes the device computes. Everything else
  // comes from the host's runs. The run is skipped, with a warning, where the model cannot run
  // there node by node (a tensor constant baked into the trace on the host).
  std::optional<c10::Device> dtype_device;
};

// Builds the IR. `tensors` are the lifted inputs' values in model.graph_tensor_names order.
// The model runs twice without gradients, at batches of 2 and 3 samples made from the example's,
// to find each value's batch dimension (shapes at the example batch are extrapolated), and on
// each of the first two samples alone to check that samples are independent (batch_separable);
// buffers are restored afterwards. The runs go atomic node by atomic node (see IrOptions).
// INVALID_ARGUMENT when the model fails, returns something other than tensors, or bakes the
// batch size in.
absl::StatusOr<IrGraph> BuildIr(const ImportedModel& model, const std::vector<at::Tensor>& tensors,
                                const std::vector<at::Tensor>& example_inputs,
                                const IrOptions& options = {});

// Whether every value's shape in `graph` follows from the shapes (not the contents) of its
// inputs: no op turns tensor contents into a scalar (a size, a count: item, int(t)) or makes a
// shape from contents (nonzero, unique, boolean indexing), and no control flow depends on
// contents. Only then may BuildIr give a repeated node an earlier node's values.
bool ShapesFollowFromShapes(torch::jit::Graph& graph);

// The bytes per sample of the activations live across the boundary before atomic node
// `boundary` (1..nodes.size()-1): what a stage cut there sends forward. A cut across an
// interleaved value (IrValue::interleave) counts kNoCutBytes for it, so that no plan cuts
// there while another boundary will do.
constexpr double kNoCutBytes = 1e15;
double CutBytesPerSample(const IrGraph& ir, int boundary);

// A stable 64-bit hash (FNV-1a) of `bytes` as 16 hex digits: the same in every process and
// build, so it can name things in files (IR hashes in deployments, profile cache keys).
std::string StableHash(const std::string& bytes);

// Whether a training step can run each micro-batch's backward right after its forward, in a
// pipeline schedule, before the client has seen the outputs: true when the first output is a
// floating scalar loss and no other output is floating (so the client's only gradient is the
// loss's, a scalar the runtime can apply afterwards). Otherwise every micro-batch's forward
// must keep its graph until the client's output gradients arrive (GPipe's order and memory).
bool FusesForwardBackward(const IrGraph& ir);

// The dtype lifted parameter `lifted` is read in when the graph reads it only through one cast
// to a narrower floating dtype (amp_level=O2's casts, graph/low_precision.h) whose result
// nothing writes in place: a copy of the parameter in that dtype computes exactly what the
// parameter does, and its gradient is the parameter's, before the cast widens it. nullopt for
// any other parameter, and for buffers and inputs.
std::optional<at::ScalarType> LowPrecisionRead(const IrGraph& ir, int lifted);

// The graph's user inputs for one batch: `client_inputs` (the whole batch), then the step inputs
// computed from them. `lifted(i)`: the module tensor of lifted input i (loss class weights).
absl::StatusOr<std::vector<at::Tensor>> WithStepInputs(const IrGraph& ir,
                                                       std::vector<at::Tensor> client_inputs,
                                                       const LiftedTensor& lifted);
// The same with every lifted tensor at hand (`tensors`, in IrGraph::tensor_names order).
absl::StatusOr<std::vector<at::Tensor>> WithStepInputs(const IrGraph& ir,
                                                       std::vector<at::Tensor> client_inputs,
                                                       const std::vector<at::Tensor>& tensors);

// Whether `block` (or a block nested in it) has an op that draws from a random generator
// (dropout, bernoulli, rand*, ...).
bool HasRandomOps(const torch::jit::Block* block);

// `t` with `n` samples along dim 0: its first n, or its samples repeated in order.
at::Tensor RepeatSamples(const at::Tensor& t, int64_t n);

// Inputs of `n` and of the nodes nested in its blocks that are defined outside `n`, each once.
std::vector<torch::jit::Value*> ExternalInputs(torch::jit::Node* n);

// One line per atomic node: index, label, inputs, outputs with shapes (for logs and tests).
std::string DescribeIr(const IrGraph& ir);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_IR_H_
