#include "daemon/graph/index_bounds.h"

#include <set>
#include <unordered_set>

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

// Ops whose output holds some of their first input's values, rearranged: an index that is out
// of range in the output was out of range in the input.
bool RearrangesValues(const torch::jit::Node* n) {
  static const std::set<c10::Symbol> kinds = {
      c10::aten::view,      c10::aten::reshape,   c10::aten::flatten,  c10::aten::contiguous,
      c10::aten::squeeze,   c10::aten::unsqueeze, c10::aten::transpose, c10::aten::permute,
      c10::aten::t,         c10::aten::select,    c10::aten::slice,    c10::aten::narrow,
      c10::aten::expand,    c10::aten::expand_as, c10::aten::view_as,  c10::aten::reshape_as,
      c10::aten::clone,     c10::aten::detach,    c10::aten::to,       c10::aten::repeat,
      c10::aten::unflatten, c10::aten::movedim};
  return kinds.count(n->kind()) > 0 && n->outputs().size() == 1;
}

const IrValue* Known(const IrGraph& ir, const torch::jit::Value* v) {
  auto it = ir.value_index.find(v);
  if (it == ir.value_index.end()) return nullptr;
  const IrValue& value = ir.values[it->second];
  return value.is_tensor ? &value : nullptr;
}

// The module tensor a (possibly cast) weight reads, for messages; its debug name otherwise.
std::string WeightName(const IrGraph& ir, const torch::jit::Value* v) {
  while (v->node()->kind() == c10::aten::to || v->node()->kind() == c10::aten::detach ||
         v->node()->kind() == c10::aten::contiguous) {
    v = v->node()->input(0);
  }
  auto it = ir.value_index.find(v);
  if (it != ir.value_index.end()) {
    for (size_t k = 0; k < ir.tensor_names.size(); ++k) {
      if (ir.inputs[ir.num_user_inputs + k] == it->second) return ir.tensor_names[k];
    }
  }
  return v->debugName();
}

std::optional<int64_t> IntConstant(const torch::jit::Value* v) {
  std::optional<c10::IValue> value = torch::jit::toIValue(v);
  if (!value || !value->isInt()) return std::nullopt;
  return value->toInt();
}

// The bound a use of an index tensor `v` by `n` (as input `offset`) sets, if any.
std::optional<IndexBound> BoundOfUse(const IrGraph& ir, const torch::jit::Node* n,
                                     size_t offset) {
  const c10::Symbol kind = n->kind();
  // A table whose indexed dimension is the batch's has no fixed size (the batch varies): those
  // indices are not bounded here. (Such a model's samples are not independent, so the IR's
  // probes on sample subsets refuse it anyway; this keeps the bounds right regardless.)
  if (kind == c10::aten::embedding && offset == 1) {
    const IrValue* weight = Known(ir, n->input(0));
    if (weight == nullptr || weight->shape.empty() || weight->batch_dim == 0) return std::nullopt;
    IndexBound b;
    b.limit = weight->shape[0];
    b.what = absl::StrCat("the rows of embedding ", WeightName(ir, n->input(0)), " (", b.limit,
                          " rows)");
    return b;
  }
  const bool nll = kind == c10::aten::nll_loss || kind == c10::aten::nll_loss2d ||
                   kind == c10::aten::nll_loss_nd || kind == c10::aten::cross_entropy_loss;
  if (nll && offset == 1 && n->inputs().size() >= 5) {
    const IrValue* scores = Known(ir, n->input(0));
    const IrValue* target = Known(ir, n->input(1));
    // Class indices only (a floating target holds class probabilities).
    if (scores == nullptr || target == nullptr || scores->shape.empty() ||
        !at::isIntegralType(target->dtype, false)) {
      return std::nullopt;
    }
    const int classes = scores->shape.size() >= 2 ? 1 : 0;
    if (scores->batch_dim == classes) return std::nullopt;
    IndexBound b;
    b.limit = scores->shape[classes];
    b.ignore = IntConstant(n->input(4));
    b.what = absl::StrCat("the classes of ", kind.toUnqualString(), " (", b.limit, " classes",
                          b.ignore ? absl::StrCat(", ignore_index ", *b.ignore) : "", ")");
    return b;
  }
  if ((kind == c10::aten::index_select || kind == c10::aten::gather) && offset == 2) {
    const IrValue* self = Known(ir, n->input(0));
    std::optional<int64_t> dim = IntConstant(n->input(1));
    if (self == nullptr || !dim) return std::nullopt;
    const int64_t rank = static_cast<int64_t>(self->shape.size());
    const int64_t d = *dim < 0 ? *dim + rank : *dim;
    if (d < 0 || d >= rank || self->batch_dim == d) return std::nullopt;
    IndexBound b;
    b.limit = self->shape[d];
    b.what = absl::StrCat("dimension ", d, " of ", kind.toUnqualString(), "'s input (size ",
                          b.limit, ")");
    return b;
  }
  return std::nullopt;
}

}  // namespace

std::vector<IndexBound> FindIndexBounds(const IrGraph& ir) {
  std::vector<IndexBound> bounds;
  for (size_t i = 0; i < ir.num_user_inputs; ++i) {
    const IrValue& input = ir.values[ir.inputs[i]];
    if (!input.is_tensor || !at::isIntegralType(input.dtype, false)) continue;
    std::vector<const torch::jit::Value*> todo = {input.jit};
    std::unordered_set<const torch::jit::Value*> seen;
    while (!todo.empty()) {
      const torch::jit::Value* v = todo.back();
      todo.pop_back();
      if (!seen.insert(v).second) continue;
      for (const torch::jit::Use& use : v->uses()) {
        const torch::jit::Node* n = use.user;
        if (RearrangesValues(n) && use.offset == 0) {
          // Only while the values stay integers (a cast to float is no longer an index).
          const IrValue* out = Known(ir, n->output());
          if (out != nullptr && at::isIntegralType(out->dtype, false)) todo.push_back(n->output());
          continue;
        }
        std::optional<IndexBound> b = BoundOfUse(ir, n, use.offset);
        if (!b || b->limit <= 0) continue;
        b->input = static_cast<int>(i);
        bounds.push_back(std::move(*b));
      }
    }
  }
  return bounds;
}

}  // namespace rannc
