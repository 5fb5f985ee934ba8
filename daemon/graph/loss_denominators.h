// Mean losses whose denominator depends on the targets, made exact under any split of the batch.
//
// F.cross_entropy and F.nll_loss with reduction='mean' divide the sum of the per-target losses
// by the number of targets that are not `ignore_index` (or by the sum of their class weights).
// A shard of the batch (a micro-batch, a replica's part) only sees its own count, and shards
// that ignore different numbers of targets weigh their means wrongly when combined: the result
// is not one-device PyTorch's (DDP has this flaw). So the daemon rewrites each such op in the
// IR's graph to
//
//   loss = sum_of_shard_losses / (R * numel(shard's targets)),   R = D / numel(batch's targets)
//
// where D is the whole batch's denominator. R is a "step input": a 0-dim double the daemon
// computes per batch from the client's inputs (the ops that make the targets, rerun alone on
// the host) and hands whole to every shard. A shard's value is then its sum over D times
// batch/shard, and the runtime's mean of the shards (each weighted by its samples) is exactly
// sum / D. The division runs in double and is cast back, so an unsplit batch gives PyTorch's
// float result to the bit; a shard that ignores every target adds 0, not NaN.
//
// Only ops with a constant reduction of 'mean', integer targets computed from the client's
// inputs alone, a constant ignore_index, and a weight that is None, a constant or a module
// tensor are rewritten. The others are reported (`refused`), and the batch of a model with one
// is never split (graph/batch_flow.h).
//
//   absl::StatusOr<LossRewrite> r = RewriteMeanLosses(graph, num_client_inputs);
//   // graph has r->denominators.size() new inputs after the client's, before the lifted ones.
//   auto step = DenominatorInputs(*r, client_inputs, lifted_tensor);
//
// RewriteMeanLosses edits the graph in place; call it once per graph, before anything records
// the graph's values. A LossRewrite is immutable afterwards and may be read from any thread.
#ifndef RANNC_DAEMON_GRAPH_LOSS_DENOMINATORS_H_
#define RANNC_DAEMON_GRAPH_LOSS_DENOMINATORS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace torch {
namespace jit {
struct Graph;
struct Node;
}  // namespace jit
}  // namespace torch

namespace rannc {

struct LossDenominator {
  const torch::jit::Node* loss = nullptr;  // the loss op, now reduction='sum'
  const torch::jit::Node* mean = nullptr;  // the op whose output replaced the loss's
  std::unordered_set<const torch::jit::Node*> added;  // the ops added after the loss
  int64_t ignore_index = -100;
  // The class weights: none, a constant, or lifted module tensor `weight_lifted` (an index into
  // the graph's inputs after the client's and the step inputs).
  std::optional<at::Tensor> weight_constant;
  int weight_lifted = -1;
};

struct LossRewrite {
  // One per step input, in the graph's input order.
  std::vector<LossDenominator> denominators;
  // Mean losses left as they were, and why: their batch must stay whole.
  std::unordered_map<const torch::jit::Node*, std::string> refused;
  // Client inputs -> each denominator's targets (the model's own ops that make them).
  std::shared_ptr<torch::jit::Graph> targets;
  size_t num_client_inputs = 0;
};

// The ops this rewrites when their reduction is 'mean': nll_loss (and its 2d and nd forms) and
// cross_entropy_loss, all laid out (self, target, weight, reduction, ignore_index, ...).
bool IsCountedMeanLoss(const torch::jit::Node* n);

// Rewrites the graph as the header says. `num_client_inputs`: the graph's first inputs, the
// client's (batched); the step inputs are inserted right after them.
absl::StatusOr<LossRewrite> RewriteMeanLosses(torch::jit::Graph& graph, size_t num_client_inputs);

// The module tensor at lifted index i (the graph input num_client + steps + i), on any device;
// or an undefined tensor where the caller holds no copy of it (a daemon running other stages of
// a job: only the stage holding a loss's class weights reads its denominator).
using LiftedTensor = std::function<at::Tensor(int)>;

// The step inputs for one batch: per denominator, a 0-dim double CPU tensor D / N (N: the
// batch's target count). `client_inputs` are the whole batch's. An empty vector when there are
// no denominators. INVALID_ARGUMENT when the targets cannot be computed from these inputs.
absl::StatusOr<std::vector<at::Tensor>> DenominatorInputs(
    const LossRewrite& rewrite, const std::vector<at::Tensor>& client_inputs,
    const LiftedTensor& lifted);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_LOSS_DENOMINATORS_H_
