// The batch analysis's rules (batch_flow.h) for layers: linear, convolution and the matrix
// products, attention, embedding, the normalizations, distances, the nn.functional losses and
// the recurrences. Each holds the batch where the layer keeps samples apart (never in what it
// contracts), and its weights free of the batch.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/graph/batch_flow_analysis.h"
#include "daemon/graph/loss_denominators.h"

namespace rannc {
namespace batch_flow_internal {

// Ops whose operands in `batched_args` must hold the batch in dimension 0 (convolutions,
// group norm, mm's rows) and whose `free_args` must be free of it.
std::string Analysis::LeadingBatch(const Node* n, std::vector<int> batched_args,
                                   std::vector<int> free_args) {
  bool any = false;
  for (int i : batched_args) {
    if (i >= static_cast<int>(n->inputs().size())) continue;
    const Value* v = n->input(i);
    const Kind k = KindOf(v);
    if (k == Kind::kFree) continue;
    if (k != Kind::kBatched) return "takes a batch size or reduced value as an operand";
    if (BatchDim(v) != 0) return "holds the batch in a dimension other than 0";
    any = true;
  }
  if (!any) return "reads batch values where it expects weights";
  for (size_t i = 0; i < n->inputs().size(); ++i) {
    const bool listed_batched =
        std::find(batched_args.begin(), batched_args.end(), static_cast<int>(i)) !=
        batched_args.end();
    if (listed_batched) continue;
    const bool listed_free =
        std::find(free_args.begin(), free_args.end(), static_cast<int>(i)) != free_args.end();
    const Kind k = KindOf(n->input(i));
    if (k == Kind::kFree) continue;
    if (listed_free || k != Kind::kShape) {
      return "reads batch values where it expects weights or options";
    }
  }
  return BatchedOutputs(n);
}

// linear(x, w, b): the batch anywhere but x's last dimension.
std::string Analysis::LinearLayer(const Node* n, std::vector<int> free) {
  const Value* x = n->input(0);
  if (KindOf(x) != Kind::kBatched) return "reads batch values where it expects weights";
  for (int i : free) {
    if (i < static_cast<int>(n->inputs().size()) && KindOf(n->input(i)) != Kind::kFree) {
      return "reads batch values where it expects weights";
    }
  }
  if (BatchDim(x) == Rank(x) - 1) return "contracts the batch dimension";
  return BatchedOutputs(n);
}

std::string Analysis::Matmul(const Node* n) {
  const Value* a = n->input(0);
  const Value* b = n->input(1);
  const Kind ka = KindOf(a), kb = KindOf(b);
  if ((ka != Kind::kFree && ka != Kind::kBatched) ||
      (kb != Kind::kFree && kb != Kind::kBatched)) {
    return "multiplies a batch size or reduced value";
  }
  const int ra = Rank(a), rb = Rank(b);
  const Value* out = n->output();
  if (ka == Kind::kBatched && kb == Kind::kBatched) {
    // Both hold samples: only their stacked (broadcast) dimensions may be the batch's.
    if (BatchDim(a) >= ra - 2 || BatchDim(b) >= rb - 2 || !Aligned(a, out) || !Aligned(b, out)) {
      return "multiplies two batch values across the batch (contracts or pairs up samples)";
    }
    return BatchedOutputs(n);
  }
  if (ka == Kind::kBatched) {
    // a @ W: any dimension of a but the contracted last one (a 1-D a is all contracted).
    if (ra < 2 || BatchDim(a) == ra - 1) return "contracts the batch dimension";
    return BatchedOutputs(n);
  }
  // W @ b: b's rows are contracted; its columns and stacked dimensions are fine.
  if (rb < 2 || BatchDim(b) == rb - 2) return "contracts the batch dimension";
  return BatchedOutputs(n);
}

std::string Analysis::Bmm(const Node* n, int ai, int bi) {
  const Value* a = n->input(ai);
  const Value* b = n->input(bi);
  const Kind ka = KindOf(a), kb = KindOf(b);
  if (ka == Kind::kBatched && kb == Kind::kBatched) {
    if (BatchDim(a) != 0 || BatchDim(b) != 0 || !Aligned(a, b)) {
      return "multiplies two batch values across the batch";
    }
    return BatchedOutputs(n);
  }
  if (ka == Kind::kBatched && kb == Kind::kFree && BatchDim(a) == 1) return BatchedOutputs(n);
  if (kb == Kind::kBatched && ka == Kind::kFree && BatchDim(b) == 2) return BatchedOutputs(n);
  return "multiplies batch values in a way the rules do not cover";
}

std::string Analysis::Addmm(const Node* n) {
  // addmm(bias, a, b): a's rows may be the batch; bias per row or free.
  const Value* bias = n->input(0);
  const Value* a = n->input(1);
  if (KindOf(a) != Kind::kBatched || KindOf(n->input(2)) != Kind::kFree ||
      BatchDim(a) != 0) {
    return "multiplies batch values in a way the rules do not cover";
  }
  if (KindOf(bias) == Kind::kBatched && !Aligned(bias, n->output())) {
    return "adds a bias that holds the batch in another dimension";
  }
  if (KindOf(bias) != Kind::kFree && KindOf(bias) != Kind::kBatched) {
    return "adds a batch size or reduced value";
  }
  for (size_t i = 3; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "scales by batch values";
  }
  return BatchedOutputs(n);
}

std::string Analysis::Baddbmm(const Node* n) {
  const Value* bias = n->input(0);
  std::string why = Bmm(n, 1, 2);
  if (!why.empty()) return why;
  if (KindOf(bias) == Kind::kBatched && !Aligned(bias, n->output())) {
    return "adds a bias that holds the batch in another dimension";
  }
  if (IsReduced(KindOf(bias)) || KindOf(bias) == Kind::kShape) return "adds a batch value";
  for (size_t i = 3; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "scales by batch values";
  }
  return "";
}

// einsum("bij,bjk->bik", [a, b]): the batch dimension of each batched operand must carry one
// letter, the same for all of them, that the output keeps.
std::string Analysis::Einsum(const Node* n) {
  std::optional<c10::IValue> eq_value = ConstValue(n->input(0));
  std::optional<std::string> eq;
  if (eq_value && eq_value->isString()) eq = eq_value->toStringRef();
  const Node* list = n->input(1)->node();
  if (!eq || list->kind() != c10::prim::ListConstruct) {
    return "has an equation or operands the analysis cannot read";
  }
  std::string equation;
  for (char c : *eq) {
    if (c != ' ') equation.push_back(c);
  }
  if (equation.find("...") != std::string::npos) return "uses '...' in its equation";
  const size_t arrow = equation.find("->");
  if (arrow == std::string::npos) return "has an equation without '->'";
  const std::string output = equation.substr(arrow + 2);
  std::vector<std::string> terms = absl::StrSplit(equation.substr(0, arrow), ',');
  if (terms.size() != list->inputs().size()) return "has an equation that does not match";
  char letter = 0;
  for (size_t i = 0; i < terms.size(); ++i) {
    const Value* v = list->input(i);
    const Kind k = KindOf(v);
    if (k == Kind::kFree) continue;
    if (k != Kind::kBatched) return "reads a batch size or reduced value";
    const int bd = BatchDim(v);
    if (bd < 0 || bd >= static_cast<int>(terms[i].size())) {
      return "has an equation that does not match";
    }
    if (letter != 0 && terms[i][bd] != letter) return "pairs up samples of two operands";
    letter = terms[i][bd];
  }
  if (letter == 0 || output.find(letter) == std::string::npos) {
    return "sums over the batch dimension";
  }
  for (size_t i = 0; i < terms.size(); ++i) {
    if (KindOf(list->input(i)) == Kind::kFree &&
        terms[i].find(letter) != std::string::npos) {
      return "pairs up samples with a batch-free operand";
    }
  }
  return BatchedOutputs(n);
}

std::string Analysis::Attention(const Node* n) {
  const Value* out = n->output(0);
  for (size_t i = 0; i < n->inputs().size(); ++i) {
    const Value* v = n->input(i);
    const Kind k = KindOf(v);
    if (k == Kind::kFree) continue;
    if (k != Kind::kBatched) return "reads a batch size or reduced value";
    if (BatchDim(v) >= Rank(v) - 2 || !Aligned(v, out)) {
      return "holds the batch in the sequence or feature dimensions";
    }
  }
  return BatchedOutputs(n);
}

std::string Analysis::Embedding(const Node* n) {
  if (KindOf(n->input(0)) != Kind::kFree) return "reads batch values as its table";
  if (KindOf(n->input(1)) != Kind::kBatched) return "reads a batch size or reduced value";
  for (size_t i = 2; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "takes batch values as options";
  }
  return BatchedOutputs(n);
}

std::string Analysis::BatchNorm(const Node* n) {
  const Value* training = NamedInput(n, "training");
  const std::optional<bool> train =
      training ? ConstBool(training) : std::nullopt;
  if (!train) return "may normalize over the batch (its training flag is not a constant)";
  if (*train) {
    return "normalizes over the batch: BatchNorm in training mode computes its statistics "
           "from all samples (call model.eval() before the first forward, or use GroupNorm "
           "or LayerNorm, to let the planner split the batch)";
  }
  return LeadingBatch(n, {0}, {1, 2, 3, 4});
}

std::string Analysis::InstanceNorm(const Node* n) {
  const Value* stats = NamedInput(n, "use_input_stats");
  const Value* running = NamedInput(n, "running_mean");
  const std::optional<bool> use =
      stats ? ConstBool(stats) : std::nullopt;
  if (!use) return "may update running statistics from the batch";
  if (*use && running != nullptr && !IsNone(running)) {
    return "updates its running statistics from every sample of the batch "
           "(track_running_stats=True in training mode)";
  }
  return LeadingBatch(n, {0}, {1, 2, 3, 4});
}

std::string Analysis::LayerNorm(const Node* n) {
  std::optional<std::vector<int64_t>> shape =
      ConstInts(NamedInput(n, "normalized_shape") ? NamedInput(n, "normalized_shape")
                                                  : n->input(1));
  if (!shape) return "normalizes over a computed shape";
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    const Kind k = KindOf(n->input(i));
    if (k != Kind::kFree && k != Kind::kShape) return "reads batch values as weights";
  }
  return TailOnly(n, static_cast<int>(shape->size()));
}

std::string Analysis::Cdist(const Node* n) {
  const Value* a = n->input(0);
  const Value* b = n->input(1);
  const Kind ka = KindOf(a), kb = KindOf(b);
  if (ka == Kind::kBatched && kb == Kind::kFree && BatchDim(a) <= Rank(a) - 2) {
    return BatchedOutputs(n);
  }
  if (ka == Kind::kBatched && kb == Kind::kBatched && BatchDim(a) < Rank(a) - 2 &&
      Aligned(a, n->output()) && Aligned(b, n->output())) {
    return BatchedOutputs(n);
  }
  return "pairs up samples";
}

std::string Analysis::Outer(const Node* n) {
  if (KindOf(n->input(0)) == Kind::kBatched && KindOf(n->input(1)) == Kind::kFree) {
    return BatchedOutputs(n);
  }
  if (KindOf(n->input(0)) == Kind::kFree && KindOf(n->input(1)) == Kind::kBatched) {
    return BatchedOutputs(n);
  }
  return "pairs up samples";
}

// The nn.functional losses: elementwise in their operands (which must line up on the batch,
// samples in the same rows), then reduced as `reduction` says: none keeps the samples, sum and
// mean reduce over them.
std::string Analysis::Loss(const Node* n, const std::string& op) {
  const Value* red = NamedInput(n, "reduction");
  std::optional<int64_t> reduction = red ? ConstInt(red) : std::nullopt;
  if (!reduction) return "reduces by a computed reduction";
  std::vector<const Value*> batched;
  for (const Value* in : n->inputs()) {
    const Kind k = KindOf(in);
    if (k == Kind::kBatched) batched.push_back(in);
    if (k != Kind::kBatched && k != Kind::kFree) return "reads a batch size or reduced value";
  }
  if (batched.empty()) return "reads batch values in a way the rules do not cover";
  const Value* x = n->input(0);
  if (KindOf(x) != Kind::kBatched) return "takes batch values only as its targets or weights";
  for (const Value* v : batched) {
    const ValueFacts* f = Facts(v);
    const ValueFacts* fx = Facts(x);
    if (f == nullptr || fx == nullptr || f->batch_dim != fx->batch_dim ||
        f->shape[f->batch_dim] != fx->shape[fx->batch_dim]) {
      return "pairs inputs and targets that hold the batch differently";
    }
  }
  const bool classes = IsCountedMeanLoss(n) || op == "multi_margin_loss" ||
                       op == "multilabel_margin_loss";
  if (classes && BatchDim(x) != 0) return "holds the batch in a dimension other than 0";
  switch (*reduction) {
    case 0:
      return BatchedOutputs(n);
    case 2:
      return SetAll(n, Kind::kSum);
    case 1: {
      if (in_.losses != nullptr) {
        auto refused = in_.losses->refused.find(n);
        if (refused != in_.losses->refused.end()) {
          return absl::StrCat("takes a mean over targets whose count a shard cannot know: ",
                              refused->second);
        }
      }
      if (IsCountedMeanLoss(n)) {
        return "takes a mean over the targets it does not ignore, which no rewrite covered";
      }
      return SetAll(n, Kind::kMean);
    }
    default:
      return "reduces in a way the rules do not cover";
  }
}

std::string Analysis::Rnn(const Node* n) {
  // lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
  // batch_first): samples along dim 0 (batch_first) or 1 of the input, 1 of the states.
  const Value* x = n->input(0);
  const Value* batch_first = NamedInput(n, "batch_first");
  std::optional<bool> first =
      batch_first ? ConstBool(batch_first) : std::nullopt;
  if (!first || KindOf(x) != Kind::kBatched || BatchDim(x) != (*first ? 0 : 1)) {
    return "holds the batch where the recurrence does not expect it";
  }
  const Value* hx = n->input(1);
  if (KindOf(hx) == Kind::kList) {
    const Node* list = hx->node();
    if (list->kind() != c10::prim::ListConstruct) return "takes states the analysis cannot read";
    for (const Value* h : list->inputs()) {
      if (KindOf(h) != Kind::kFree && !(KindOf(h) == Kind::kBatched && BatchDim(h) == 1)) {
        return "takes states that hold the batch outside dimension 1";
      }
    }
  } else if (KindOf(hx) == Kind::kBatched) {
    if (BatchDim(hx) != 1) return "takes states that hold the batch outside dimension 1";
  }
  for (size_t i = 2; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "takes batch values as weights";
  }
  return BatchedOutputs(n);
}

}  // namespace batch_flow_internal
}  // namespace rannc
