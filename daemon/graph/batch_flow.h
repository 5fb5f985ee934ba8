// Whether a model treats the samples of its batch independently, decided op by op: the check
// that allows the planner to split the batch into micro-batches and replicas.
//
// Splitting the batch is exact only when each sample's outputs depend on that sample alone, and
// every output without a batch dimension (a loss) is a mean or a sum of per-sample values. The
// analysis follows the batch through the graph in order. Each value is free of the batch
// (parameters, constants, what is computed from them), a size of the batch (x.size(0) and
// arithmetic on it), per-sample (it has the batch dimension, samples apart), a mean or a sum
// over the samples, or a list of such values. An op keeps samples apart only if it is on a list
// of ops known to, under that op's conditions: elementwise ops whose operands line up on the
// batch dimension; linear, convolution, matmul and attention where the batch is not what they
// contract; normalizations and softmax over dimensions other than the batch's (batch_norm only
// in eval mode); reshapes that keep each sample's elements together; reductions over other
// dimensions; sum and mean over the batch, and sums, differences and constant multiples of such
// reductions. Anything else that touches the batch - an op not on the list, a listed op outside
// its conditions, control flow, reading batch values into host numbers, computing with the
// batch size - keeps the batch whole, and the result says which op it was and where in the model
// (the module path of the inlined call). The list is conservative by design: an op missing from
// it costs parallelism, never correctness.
//
// Runs on an IR's graph after its probe runs (graph/ir.h), which give each value's batch
// dimension and shape; mean losses with target-dependent denominators are expected rewritten
// (graph/loss_denominators.h).
//
//   BatchFlow flow = AnalyzeBatchFlow(inputs);
//   if (!flow.separable) spdlog::info("batch kept whole: {}", flow.why);
//
// A pure function of its inputs; safe from any thread that may read the graph.
#ifndef RANNC_DAEMON_GRAPH_BATCH_FLOW_H_
#define RANNC_DAEMON_GRAPH_BATCH_FLOW_H_

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch {
namespace jit {
struct Graph;
struct Node;
struct Value;
}  // namespace jit
}  // namespace torch

namespace rannc {

struct LossRewrite;

// What the probe runs recorded of one tensor value.
struct ValueFacts {
  int batch_dim = -1;           // the dimension that grows with the batch; -1: none
  std::vector<int64_t> shape;   // at the example batch
  // The batch dimension holds a whole number of rows per sample, and no other dimension grows
  // with the batch.
  bool regular = true;
};

struct BatchFlowInputs {
  const torch::jit::Graph* graph = nullptr;
  // The graph's first inputs are the client's (batched along dim 0), then the step inputs
  // (whole-batch values every shard reads whole: loss denominators), then module tensors.
  size_t num_client_inputs = 0;
  size_t num_step_inputs = 0;
  int64_t example_batch = 0;  // samples in the batch the facts were recorded at
  // The facts of a top-level tensor value; nullptr when none were recorded.
  std::function<const ValueFacts*(const torch::jit::Value*)> facts;
  const LossRewrite* losses = nullptr;  // may be null: no rewritten losses
};

enum class SampleReduction { kMean, kSum };

struct BatchFlow {
  bool separable = true;
  // When not: which op, where in the model, and what it does to the batch.
  std::string why;
  // Each graph output computed from the batch that has no batch dimension: how the whole batch's
  // value combines the per-sample values (a mean: shards weighted by their samples).
  std::unordered_map<const torch::jit::Value*, SampleReduction> reductions;
  // Tensors whose batch dimension holds `outer` blocks of every sample's rows (a view merged
  // dimensions before the batch's into it: nn.MultiheadAttention's (seq * batch, embed)):
  // exact within a shard, but not to be split into rows per sample.
  std::unordered_map<const torch::jit::Value*, int64_t> interleaved;
};

BatchFlow AnalyzeBatchFlow(const BatchFlowInputs& inputs);

// Where `node` comes from in the model: the module path of its inlined call and the module's
// class ("features.3.block.1 (BatchNorm2d)"), or "" for an op of the top module's own forward.
std::string ModuleOrigin(const torch::jit::Node* node);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_BATCH_FLOW_H_
