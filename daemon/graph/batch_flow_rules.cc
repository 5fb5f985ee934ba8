// The batch analysis's rules (batch_flow.h) for structure (lists, tuples, sizes, host numbers),
// elementwise ops and the linear combinations of means and sums, reductions, reshapes and
// rearrangements, tensors made from sizes, joins, and indexing. Each rule checks its op's
// operands, sets its outputs' flows, and returns "" or why the op keeps the batch whole.
#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/graph/batch_flow_analysis.h"

namespace rannc {
namespace batch_flow_internal {

std::string Analysis::ListConstruct(const Node* n) {
  bool shapes = false, other = false;
  for (const Value* in : n->inputs()) {
    const Kind k = KindOf(in);
    shapes = shapes || k == Kind::kShape;
    other = other || (k != Kind::kFree && k != Kind::kShape);
  }
  Set(n->output(), other ? Kind::kList : shapes ? Kind::kShape : Kind::kFree);
  return "";
}

// The element flows of a list value, when known: its construct's inputs, a size list's
// elements, or a split's pieces.
std::optional<std::vector<Flow>> Analysis::Elements(const Value* list, size_t count) const {
  const Node* p = list->node();
  const std::string qual = p->kind().toQualString();
  if (qual == "prim::ListConstruct" || qual == "prim::TupleConstruct") {
    std::vector<Flow> out;
    for (const Value* in : p->inputs()) out.push_back(FlowOf(in));
    return out;
  }
  const Flow f = FlowOf(list);
  std::vector<Flow> out(count);
  if (f.kind == Kind::kShape) {
    for (size_t i = 0; i < count; ++i) {
      out[i].kind = static_cast<int>(i) == f.batch_element || f.batch_element < 0 ? Kind::kShape
                                                                                   : Kind::kFree;
    }
    return out;
  }
  if (f.kind == Kind::kList && split_lists_.count(list)) {
    for (Flow& e : out) e.kind = Kind::kBatched;
    return out;
  }
  if (f.kind == Kind::kFree) return out;
  return std::nullopt;
}

std::string Analysis::Unpack(const Node* n) {
  std::optional<std::vector<Flow>> elements = Elements(n->input(0), n->outputs().size());
  if (!elements || elements->size() != n->outputs().size()) {
    return "unpacks a list whose elements the analysis cannot follow";
  }
  for (size_t i = 0; i < n->outputs().size(); ++i) {
    std::string why = CheckFacts(n->output(i), (*elements)[i].kind);
    if (!why.empty()) return why;
    flows_[n->output(i)] = (*elements)[i];
  }
  return "";
}

std::string Analysis::GetItem(const Node* n) {
  const std::optional<int64_t> index = ConstInt(n->input(1));
  const Flow list = FlowOf(n->input(0));
  if (list.kind == Kind::kShape) {
    const bool batch = index && *index == list.batch_element;
    Set(n->output(), list.batch_element < 0 || batch ? Kind::kShape : Kind::kFree);
    if (batch && sample_counts_.count(n->input(0))) sample_counts_.insert(n->output());
    return "";
  }
  if (!index) return "indexes a list of batch values at a computed position";
  std::optional<std::vector<Flow>> elements = Elements(n->input(0), *index + 1);
  if (!elements || *index < 0 || *index >= static_cast<int64_t>(elements->size())) {
    return "indexes a list whose elements the analysis cannot follow";
  }
  std::string why = CheckFacts(n->output(), (*elements)[*index].kind);
  if (!why.empty()) return why;
  flows_[n->output()] = (*elements)[*index];
  return "";
}

std::string Analysis::ScalarRead(const Node* n) {
  const Kind k = KindOf(n->input(0));
  if (k == Kind::kShape) {
    for (const Value* o : n->outputs()) {
      Set(o, Kind::kShape);
      if (sample_counts_.count(n->input(0))) sample_counts_.insert(o);
    }
    return "";
  }
  return "reads values computed from the batch into a host number";
}

std::string Analysis::Size(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape || KindOf(x) == Kind::kFree) {
    return SetAll(n, KindOf(x));
  }
  const std::string qual = n->kind().toQualString();
  const int bd = BatchDim(x);
  if (qual == "aten::numel") {
    Set(n->output(), bd >= 0 ? Kind::kShape : Kind::kFree);
    return "";
  }
  if (qual == "aten::len") {
    Set(n->output(), bd == 0 ? Kind::kShape : Kind::kFree);
    return "";
  }
  if (n->inputs().size() >= 2) {
    const std::optional<int64_t> d = ConstInt(n->input(1));
    if (!d) return "reads a computed dimension's size";
    const int64_t dim = *d < 0 ? *d + Rank(x) : *d;
    Set(n->output(), bd >= 0 && dim == bd ? Kind::kShape : Kind::kFree);
    if (bd >= 0 && dim == bd && Facts(x)->shape[bd] == in_.example_batch) {
      sample_counts_.insert(n->output());
    }
    return "";
  }
  // x.size(): the element that is the batch's size (an interleaved batch dimension's is not).
  Set(n->output(), bd >= 0 ? Kind::kShape : Kind::kFree,
      KindOf(x) == Kind::kInterleaved ? -1 : bd);
  if (bd >= 0 && Facts(x)->shape[bd] == in_.example_batch) sample_counts_.insert(n->output());
  return "";
}

std::string Analysis::Elementwise(const Node* n, const OpName& name) {
  std::vector<const Value*> batched, reduced;
  bool shape = false;
  for (const Value* in : n->inputs()) {
    const Kind k = KindOf(in);
    if (k == Kind::kBatched) batched.push_back(in);
    if (IsReduced(k)) reduced.push_back(in);
    if (k == Kind::kShape) shape = true;
    if (k == Kind::kList) return "reads a list of batch values";
  }
  const std::string& op = name.base;
  // Ops whose other operands give only a dtype, a device or a shape to copy.
  static const std::unordered_set<std::string> first_only = {
      "to", "type_as", "_to_copy", "zeros_like", "ones_like", "empty_like", "rand_like",
      "randn_like", "randint_like"};
  if (first_only.count(op)) {
    const Kind k = KindOf(n->input(0));
    if (k == Kind::kList) return "reads a list of batch values";
    return SetAll(n, k);
  }
  if (!batched.empty()) {
    if (!reduced.empty()) {
      return "combines per-sample values with a value reduced over the batch (a statistic "
             "of the whole batch, as BatchNorm in training mode computes)";
    }
    if (shape) return "computes with the batch's size";
    const Value* out = n->output(0);
    std::string why = CheckFacts(out, Kind::kBatched);
    if (!why.empty()) return why;
    for (const Value* in : batched) {
      if (!Aligned(in, out)) {
        return absl::StrCat("combines %", in->debugName(), " with other values along a "
                            "dimension that is not its batch dimension");
      }
    }
    for (const Value* o : n->outputs()) {
      if (o->type()->kind() == c10::TypeKind::TensorType) {
        why = CheckFacts(o, Kind::kBatched);
        if (!why.empty()) return why;
        Set(o, Kind::kBatched);
      }
    }
    return "";
  }
  if (!reduced.empty()) return Linear(n, op, reduced);
  // Arithmetic on the batch's size: still only a size.
  return SetAll(n, Kind::kShape);
}

// Means and sums over the batch combine linearly: sums and differences of the same kind,
// multiples by values free of the batch, casts. A mean plus a batch-free value is still a
// mean (each shard adds it once, and the shards' weights sum to one); a sum is not.
std::string Analysis::Linear(const Node* n, const std::string& op,
                             const std::vector<const Value*>& reduced) {
  std::set<Kind> kinds;
  for (const Value* r : reduced) kinds.insert(KindOf(r));
  bool shape = false;
  for (const Value* in : n->inputs()) shape = shape || KindOf(in) == Kind::kShape;
  if (kinds.size() > 1) return "adds a mean over the batch to a sum over it";
  const Kind k = *kinds.begin();
  const size_t tensors =
      std::count_if(n->inputs().begin(), n->inputs().end(), [](const Value* v) {
        return v->type()->kind() == c10::TypeKind::TensorType;
      });
  const bool first = !reduced.empty() && reduced[0] == n->input(0);
  if (op == "add" || op == "sub" || op == "subtract" || op == "rsub") {
    if (shape) return "adds the batch's size to a loss";
    if (reduced.size() == 1 && k == Kind::kSum && tensors > 1) {
      return "adds a batch-free value to a sum over the batch (each shard would add it)";
    }
    if (reduced.size() == 1 && k == Kind::kSum) {
      // sum + constant scalar: each shard would add the constant.
      const Value* other = n->input(1);
      std::optional<double> c = ConstDouble(other);
      std::optional<int64_t> ci = ConstInt(other);
      if (!(c && *c == 0) && !(ci && *ci == 0)) {
        return "adds a constant to a sum over the batch (each shard would add it)";
      }
    }
    return SetAll(n, k);
  }
  if (op == "mul" || op == "multiply") {
    if (reduced.size() > 1) return "multiplies two values reduced over the batch";
    if (shape) return "multiplies a loss by the batch's size";
    return SetAll(n, k);
  }
  if (op == "div" || op == "divide" || op == "true_divide") {
    if (reduced.size() > 1 || !first) return "divides by a value reduced over the batch";
    if (shape) {
      const Value* by = n->input(1);
      if (k == Kind::kSum && sample_counts_.count(by)) return SetAll(n, Kind::kMean);
      return "divides a loss by a size computed from the batch";
    }
    return SetAll(n, k);
  }
  static const std::unordered_set<std::string> casts = {
      "neg", "negative", "positive", "to", "_to_copy", "contiguous", "clone", "detach",
      "alias", "float", "double", "half", "bfloat16", "_autocast_to_reduced_precision",
      "_autocast_to_full_precision", "requires_grad"};
  if (casts.count(op)) return SetAll(n, k);
  return "is not linear, but reads a value reduced over the batch (a mean or sum of the "
         "samples' values)";
}

// A reduction over `dim` (or everything): per-sample if it spares the batch dimension; a sum
// or mean over the samples if it is linear and takes the batch dimension in.
std::string Analysis::Reduce(const Node* n, Kind kind) {
  const Value* x = n->input(0);
  const Kind k = KindOf(x);
  if (k == Kind::kShape) return SetAll(n, Kind::kShape);
  if (IsReduced(k)) return SetAll(n, k);  // a sum or mean of a loss: still one
  if (k != Kind::kBatched) return "reduces a list";
  bool unknown = false;
  std::optional<std::vector<int64_t>> dims = Dims(n, "dim", Rank(x), &unknown);
  if (unknown) return "reduces over a computed dimension";
  const int bd = BatchDim(x);
  const bool takes_batch = !dims || dims->empty() ||
                           std::find(dims->begin(), dims->end(), bd) != dims->end();
  if (!takes_batch) return SetAll(n, Kind::kBatched);
  return SetAll(n, kind);
}

// Ops whose `arg` dimensions must spare the batch's.
std::string Analysis::DimOnly(const Node* n, const char* arg) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape && n->outputs().size() == 1) return SetAll(n, Kind::kShape);
  if (KindOf(x) != Kind::kBatched) {
    return IsReduced(KindOf(x)) ? "is not linear, but reads a value reduced over the batch"
                                : "reads batch values in a way the rules do not cover";
  }
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    const Kind k = KindOf(n->input(i));
    if (k != Kind::kFree && k != Kind::kBatched) {
      return "takes a batch size or reduced value as an argument";
    }
    if (k == Kind::kBatched && !Aligned(n->input(i), x)) {
      return "combines two values that hold the batch in different dimensions";
    }
  }
  bool unknown = false;
  std::optional<std::vector<int64_t>> dims = Dims(n, arg, Rank(x), &unknown);
  if (unknown) return "works along a computed dimension";
  const int bd = BatchDim(x);
  if (!dims || dims->empty()) {
    return "works over the whole tensor, the batch dimension included";
  }
  if (std::find(dims->begin(), dims->end(), bd) != dims->end()) {
    return "works along the batch dimension";
  }
  return BatchedOutputs(n);
}

// Every tensor output per-sample, lists of per-sample tensors for list outputs.
std::string Analysis::BatchedOutputs(const Node* n) {
  for (const Value* o : n->outputs()) {
    if (o->type()->kind() == c10::TypeKind::ListType) {
      Set(o, Kind::kList);
      split_lists_.insert(o);
      continue;
    }
    if (o->type()->kind() != c10::TypeKind::TensorType) {
      Set(o, Kind::kFree);
      continue;
    }
    std::string why = CheckFacts(o, Kind::kBatched);
    if (!why.empty()) return why;
    Set(o, Kind::kBatched);
  }
  return "";
}

std::string Analysis::FullReduction(const Node* n) {
  const Kind k = KindOf(n->input(0));
  if (k == Kind::kShape) return SetAll(n, Kind::kShape);
  return "reduces over the whole tensor, the batch dimension included, and is not a sum or "
         "a mean";
}

// Ops on the last `tail` dimensions (pooling, padding, ...): the batch must be before them.
std::string Analysis::TailOnly(const Node* n, int tail) {
  const Value* x = n->input(0);
  if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree && !(KindOf(n->input(i)) == Kind::kBatched &&
                                                Aligned(n->input(i), x))) {
      return "takes batch values as an argument";
    }
  }
  if (BatchDim(x) >= Rank(x) - tail) {
    return absl::StrCat("works on the last ", tail, " dimension(s), which hold the batch");
  }
  return BatchedOutputs(n);
}

std::string Analysis::Squeeze(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
  if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
  bool unknown = false;
  std::optional<std::vector<int64_t>> dims = Dims(n, "dim", Rank(x), &unknown);
  if (unknown) return "squeezes a computed dimension";
  if (!dims) {
    return "squeezes every size-1 dimension, so a micro-batch of one sample would lose its "
           "batch dimension (name the dimension: squeeze(d))";
  }
  if (std::find(dims->begin(), dims->end(), BatchDim(x)) != dims->end()) {
    return "squeezes the batch dimension";
  }
  return BatchedOutputs(n);
}

std::string Analysis::Slice(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
  if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "slices at a position computed from the batch";
  }
  const Value* dim = NamedInput(n, "dim");
  std::optional<int64_t> d = dim ? ConstInt(dim) : std::optional<int64_t>(0);
  if (!d) return "slices a computed dimension";
  if (*d < 0) *d += Rank(x);
  if (*d == BatchDim(x)) {
    const Value* start = NamedInput(n, "start");
    const Value* end = NamedInput(n, "end");
    const Value* step = NamedInput(n, "step");
    const bool from_first = start == nullptr || IsNone(start) || ConstInt(start) == 0;
    const bool to_last = end == nullptr || IsNone(end) ||
                         (ConstInt(end) && *ConstInt(end) >= (int64_t{1} << 62));
    const bool every = step == nullptr || IsNone(step) || ConstInt(step) == 1;
    if (!(from_first && to_last && every)) return "takes only some of the samples";
  }
  return BatchedOutputs(n);
}

// view/reshape/flatten: each sample's elements stay together when everything before the
// batch dimension has the same extent before and after.
std::string Analysis::Reshape(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
  if (KindOf(x) != Kind::kBatched && KindOf(x) != Kind::kInterleaved) {
    return "reads batch values in a way the rules do not cover";
  }
  const Value* out = n->output();
  std::string why = CheckFacts(out, Kind::kBatched);
  if (!why.empty()) return why;
  const ValueFacts* a = Facts(x);
  const ValueFacts* b = Facts(out);
  // Row-major, x is (blocks, samples, each sample's elements in the block): the blocks are the
  // dimensions before the batch's, times an interleaved batch dimension's outer blocks.
  const int64_t outer = FlowOf(x).outer;
  int64_t blocks_in = outer, blocks_out = 1, row_out = 1;
  for (int d = 0; d < a->batch_dim; ++d) blocks_in *= a->shape[d];
  for (int d = 0; d < b->batch_dim; ++d) blocks_out *= b->shape[d];
  for (size_t d = b->batch_dim + 1; d < b->shape.size(); ++d) row_out *= b->shape[d];
  int64_t per_sample = a->shape[a->batch_dim] / (outer * in_.example_batch);
  for (size_t d = a->batch_dim + 1; d < a->shape.size(); ++d) per_sample *= a->shape[d];
  if (row_out == 0 || per_sample % row_out != 0) {
    return "reshapes so that a row of the batch dimension holds several samples' elements";
  }
  if (blocks_in == blocks_out) {
    Set(out, Kind::kBatched);
    return "";
  }
  // Fewer blocks before the batch: the rest joined the batch dimension, each block of it
  // holding every sample's rows.
  if (blocks_out < blocks_in && blocks_in % blocks_out == 0 &&
      b->shape[b->batch_dim] % (blocks_in / blocks_out * in_.example_batch) == 0) {
    Set(out, Kind::kInterleaved, -1, blocks_in / blocks_out);
    return "";
  }
  return "reshapes so that samples interleave (the dimensions before the batch change)";
}

// An op reading a kInterleaved value: its rows may be mapped one by one (linear, elementwise
// ops with nothing else to broadcast against them), its sizes read, and reshaped; nothing else.
std::string Analysis::InterleavedUse(const Node* n, const OpName& name) {
  const std::string& op = name.base;
  const std::string qual = n->kind().toQualString();
  const Value* x = n->input(0);
  if (KindOf(x) != Kind::kInterleaved) {
    return "reads a value whose samples interleave with other rows (a reshape merged "
           "dimensions before the batch's into its batch dimension) other than as its input";
  }
  // Options: a shape may come from the batch's size (x.view(length, batch, -1)).
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    const Kind k = KindOf(n->input(i));
    if (k != Kind::kFree && k != Kind::kShape) {
      return "combines a value whose samples interleave with other rows with batch values";
    }
  }
  if (qual == "aten::size" || qual == "aten::sym_size" || qual == "aten::numel" ||
      qual == "aten::len" || qual == "prim::shape") {
    return Size(n);
  }
  if (qual == "aten::dim" || qual == "prim::device" || qual == "prim::dtype" ||
      qual == "prim::layout") {
    return SetAll(n, Kind::kFree);
  }
  static const std::unordered_set<std::string> reshapes = {"view", "reshape", "_reshape_alias",
                                                           "_unsafe_view", "flatten"};
  if (reshapes.count(op)) return Reshape(n);
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) {
      return "computes with the batch's size on a value whose samples interleave with other "
             "rows";
    }
  }
  // Each element, or each row, on its own; other operands give only options (a dtype, a
  // dropout rate) or, for linear, the weights.
  static const std::unordered_set<std::string> rowwise = {
      "linear", "contiguous", "clone", "to", "_to_copy", "type_as", "detach", "alias", "float",
      "double", "half", "bfloat16", "requires_grad", "_autocast_to_reduced_precision",
      "_autocast_to_full_precision", "dropout", "native_dropout", "alpha_dropout", "relu",
      "gelu", "silu", "sigmoid", "tanh", "neg"};
  if (!rowwise.count(op)) {
    return "reads a value whose samples interleave with other rows (a reshape merged "
           "dimensions before the batch's into its batch dimension), which the rules follow "
           "only through reshapes, linear and elementwise ops";
  }
  const int bd = BatchDim(x);
  if (op == "linear") {
    if (bd == Rank(x) - 1) return "contracts the batch dimension";
  } else if (op != "type_as") {
    for (size_t i = 1; i < n->inputs().size(); ++i) {
      if (n->input(i)->type()->kind() == c10::TypeKind::TensorType) {
        return "combines a value whose samples interleave with other rows with a tensor";
      }
    }
  }
  for (const Value* o : n->outputs()) {
    if (o->type()->kind() != c10::TypeKind::TensorType) {
      Set(o, Kind::kFree);
      continue;
    }
    std::string why = CheckFacts(o, Kind::kBatched);
    if (!why.empty()) return why;
    const ValueFacts* f = Facts(o);
    if (f->batch_dim != bd || f->shape[bd] != Facts(x)->shape[bd]) {
      return "moves the batch dimension of a value whose samples interleave with other rows";
    }
    Set(o, Kind::kInterleaved, -1, FlowOf(x).outer);
  }
  return "";
}

std::string Analysis::Rearrange(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
  if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "takes batch values as options";
  }
  return BatchedOutputs(n);
}

std::string Analysis::Expand(const Node* n) {
  const Value* x = n->input(0);
  const Value* out = n->output();
  const Kind k = KindOf(x);
  if (IsReduced(k) || k == Kind::kList) return "expands a value reduced over the batch";
  if (k == Kind::kShape) return "expands a value computed from the batch's size";
  if (k == Kind::kBatched) {
    if (!Aligned(x, out)) return "expands along the batch dimension";
    return BatchedOutputs(n);
  }
  // A batch-free value expanded to the batch's size: the same for every sample.
  if (BatchDim(out) >= 0) return BatchedOutputs(n);
  return SetAll(n, Kind::kShape);
}

std::string Analysis::Repeat(const Node* n) {
  const Value* x = n->input(0);
  const Value* out = n->output();
  const Kind k = KindOf(x);
  if (k != Kind::kBatched && k != Kind::kFree) return "repeats a batch size or reduced value";
  if (k == Kind::kFree) {
    return BatchDim(out) >= 0 ? BatchedOutputs(n) : SetAll(n, Kind::kShape);
  }
  std::optional<std::vector<int64_t>> reps = ConstInts(n->input(1));
  if (!reps) return "repeats a computed number of times";
  const int pos = static_cast<int>(reps->size()) - (Rank(x) - BatchDim(x));
  if (pos < 0 || pos >= static_cast<int>(reps->size()) || (*reps)[pos] != 1) {
    return "repeats the samples (tiling along the batch dimension)";
  }
  return BatchedOutputs(n);
}

std::string Analysis::Factory(const Node* n) {
  // Only a size may come from the batch's (torch.zeros(x.size(0), d)); a fill value or data
  // computed from it would differ from shard to shard.
  const Value* size = NamedInput(n, "size");
  const bool new_like = absl::StartsWith(NameOf(n).base, "new_");
  for (const Value* in : n->inputs()) {
    const Kind k = KindOf(in);
    if (k == Kind::kFree || (new_like && in == n->input(0))) continue;
    if (k == Kind::kShape && in == size) continue;
    return k == Kind::kShape ? "fills a tensor with values computed from the batch's size"
                             : "makes a tensor from batch values";
  }
  // Its size comes from the batch's: the same (or independently random) for every sample.
  if (BatchDim(n->output()) >= 0) return BatchedOutputs(n);
  return SetAll(n, Kind::kShape);
}

std::string Analysis::SampleNumbers(const Node* n) {
  // torch.arange(B) or arange(0, B, 1), B the number of samples: each sample's number. Any
  // other range computed from the batch's size depends on how many samples a shard has.
  const Value* end = NamedInput(n, "end");
  const Value* start = NamedInput(n, "start");
  const Value* step = NamedInput(n, "step");
  const bool numbers = end != nullptr && sample_counts_.count(end) &&
                       (start == nullptr || ConstDouble(start) == 0.0) &&
                       (step == nullptr || ConstDouble(step) == 1.0);
  for (const Value* in : n->inputs()) {
    if (in != end && KindOf(in) != Kind::kFree) {
      return "numbers or orders the samples: its result depends on how many there are";
    }
  }
  if (!numbers) {
    return "numbers or orders the samples: its result depends on how many there are";
  }
  return SetAll(n, Kind::kSampleIndex);
}

std::string Analysis::SampleIndexUse(const Node* n, const OpName& name) {
  static const char* const kWhy =
      "computes with the samples' numbers (torch.arange over the batch's size), which a shard "
      "numbers anew";
  const std::string& op = name.base;
  if (n->kind() == c10::prim::ListConstruct) {
    // Indices of aten::index, which checks where each one indexes.
    for (const torch::jit::Use& use : n->output()->uses()) {
      if (use.user->kind() != c10::aten::index || use.offset != 1) return kWhy;
    }
    return SetAll(n, Kind::kList);
  }
  // Shape and dtype changes that keep each number at its sample's position: the batch the only
  // dimension longer than one, before and after.
  static const std::unordered_set<std::string> moves = {
      "unsqueeze", "view", "reshape", "_unsafe_view", "slice", "to", "contiguous", "clone",
      "detach", "alias", "lift_fresh", "long", "int"};
  if (!moves.count(op) || name.in_place || n->outputs().size() != 1 ||
      KindOf(n->input(0)) != Kind::kSampleIndex) {
    return kWhy;
  }
  for (size_t i = 1; i < n->inputs().size(); ++i) {
    const Kind k = KindOf(n->input(i));
    if (k != Kind::kFree && !(k == Kind::kShape && (op == "view" || op == "reshape"))) {
      return kWhy;
    }
  }
  const ValueFacts* in = Facts(n->input(0));
  const ValueFacts* out = Facts(n->output());
  if (in == nullptr || out == nullptr || out->batch_dim < 0) return kWhy;
  for (const ValueFacts* f : {in, out}) {
    for (size_t d = 0; d < f->shape.size(); ++d) {
      if (static_cast<int>(d) != f->batch_dim && f->shape[d] != 1) return kWhy;
    }
    if (f->shape[f->batch_dim] != in_.example_batch) return kWhy;
  }
  return SetAll(n, Kind::kSampleIndex);
}

std::string Analysis::Concat(const Node* n, const std::string& op) {
  const Node* list = n->input(0)->node();
  if (list->kind() != c10::prim::ListConstruct && list->kind() != c10::prim::TupleConstruct) {
    return "joins a list the analysis cannot follow";
  }
  const Value* out = n->output();
  bool batched = false;
  for (const Value* v : list->inputs()) {
    const Kind k = KindOf(v);
    if (k == Kind::kBatched) {
      batched = true;
      continue;
    }
    if (k != Kind::kFree) return "joins a batch size or reduced value with other values";
  }
  if (!batched) return SetAll(n, Kind::kShape);
  for (const Value* v : list->inputs()) {
    if (KindOf(v) != Kind::kBatched) return "joins per-sample values with batch-free ones";
  }
  const Value* first = list->input(0);
  for (const Value* v : list->inputs()) {
    if (BatchDim(v) != BatchDim(first) || Rank(v) != Rank(first)) {
      return "joins values that hold the batch in different dimensions";
    }
  }
  const bool stacks = op == "stack";
  if (!stacks) {
    const Value* dim = NamedInput(n, "dim");
    std::optional<int64_t> d = dim ? ConstInt(dim) : std::optional<int64_t>(0);
    if (op == "hstack" || op == "column_stack") d = Rank(first) == 1 ? 0 : 1;
    if (op == "vstack") d = 0;
    if (op == "dstack") d = 2;
    if (!d) return "joins along a computed dimension";
    if (*d < 0) *d += Rank(first);
    if (*d == BatchDim(first)) return "joins along the batch dimension";
  }
  for (const Value* v : list->inputs()) {
    if (!stacks && !Aligned(v, out)) return "joins values of different rows per sample";
  }
  return BatchedOutputs(n);
}

// broadcast_tensors([a, b, ...]): each output is its input expanded to the common shape, so
// with one per-sample input every output is per-sample (batch-free ones repeat per sample).
std::string Analysis::BroadcastTensors(const Node* n) {
  const Node* list = n->input(0)->node();
  if (list->kind() != c10::prim::ListConstruct) {
    return "broadcasts a list the analysis cannot read";
  }
  const Value* first = nullptr;
  for (const Value* v : list->inputs()) {
    const Kind k = KindOf(v);
    if (k == Kind::kFree) continue;
    if (k != Kind::kBatched) return "broadcasts a batch size or reduced value";
    if (first != nullptr && !Aligned(v, first)) {
      return "broadcasts values that hold the batch in different dimensions";
    }
    first = v;
  }
  if (first == nullptr) return "reads batch values in a way the rules do not cover";
  Set(n->output(), Kind::kList);
  split_lists_.insert(n->output());
  return "";
}

std::string Analysis::IndexSelect(const Node* n) {
  const Value* x = n->input(0);
  const Value* index = NamedInput(n, "index");
  const Kind kx = KindOf(x);
  const Kind ki = index ? KindOf(index) : Kind::kFree;
  if (kx == Kind::kBatched && ki == Kind::kFree) return DimOnly(n, "dim");
  if (kx == Kind::kFree && ki == Kind::kBatched) {
    // Rows of a batch-free table picked per sample, as embedding does.
    bool unknown = false;
    std::optional<std::vector<int64_t>> dims = Dims(n, "dim", Rank(x), &unknown);
    if (!dims || dims->size() != 1 || BatchDim(n->output()) != (*dims)[0]) {
      return "picks rows in a way the rules do not cover";
    }
    return BatchedOutputs(n);
  }
  return "picks rows of batch values by batch values";
}

// gather/scatter/index_add...: every per-sample operand lines up with the output, and the
// indexed dimension is not the batch's.
std::string Analysis::Indexed(const Node* n, const OpName& name) {
  const Value* out = n->output(0);
  const Value* self = n->input(0);
  bool any = false;
  for (size_t i = 0; i < n->inputs().size(); ++i) {
    const Value* v = n->input(i);
    const Kind k = KindOf(v);
    if (k == Kind::kFree) continue;
    if (k != Kind::kBatched) return "reads a batch size or reduced value";
    if (!Aligned(v, out)) return "combines values that hold the batch in different dimensions";
    any = true;
  }
  if (!any) return "reads batch values in a way the rules do not cover";
  if (KindOf(self) == Kind::kFree && name.in_place) {
    return "writes per-sample values into a tensor shared by every sample";
  }
  bool unknown = false;
  std::optional<std::vector<int64_t>> dims = Dims(n, "dim", Rank(out), &unknown);
  if (!dims || dims->size() != 1) return "indexes a computed dimension";
  if ((*dims)[0] == BatchDim(out)) return "indexes along the batch dimension";
  return BatchedOutputs(n);
}

// x[idx] (aten::index) and x[idx] = v (index_put): the batch dimension of a per-sample x is
// not indexed and the index tensors are batch-free; or a batch-free x is indexed by
// per-sample integer indices (a lookup, like embedding).
std::string Analysis::Index(const Node* n, const OpName& name) {
  const Value* x = n->input(0);
  const Node* list = n->input(1)->node();
  if (list->kind() != c10::prim::ListConstruct) {
    return "indexes with a list the analysis cannot read";
  }
  const Kind kx = KindOf(x);
  std::vector<const Value*> batched_indices;
  bool own_rows = false;  // x's batch dimension indexed by the samples' numbers
  for (size_t i = 0; i < list->inputs().size(); ++i) {
    const Value* idx = list->input(i);
    if (IsNone(idx)) continue;
    const Kind k = KindOf(idx);
    if (k == Kind::kSampleIndex) {
      // x[arange(B)[:, None], j]: each sample's own row, wherever the shard's samples are.
      if (name.base != "index" || kx != Kind::kBatched || static_cast<int>(i) != BatchDim(x) ||
          Facts(x)->shape[i] != in_.example_batch) {
        return "indexes with the samples' numbers other than to pick each sample's own row";
      }
      own_rows = true;
      continue;
    }
    if (k == Kind::kBatched) {
      batched_indices.push_back(idx);
    } else if (k != Kind::kFree) {
      return "indexes with a batch size or reduced value";
    }
    auto type = idx->type()->cast<c10::TensorType>();
    if (!type || !type->scalarType() || *type->scalarType() == at::kBool ||
        *type->scalarType() == at::kByte) {
      if (k != Kind::kFree) {
        return "indexes with a mask, which gives each sample a different number of rows";
      }
    }
  }
  if (name.base == "index_put") {
    const Value* values = n->input(2);
    if (kx != Kind::kBatched || !batched_indices.empty()) {
      return "writes per-sample values into a tensor at positions computed from the batch";
    }
    const int bd = BatchDim(x);
    if (bd < static_cast<int>(list->inputs().size()) && !IsNone(list->input(bd))) {
      return "writes at chosen samples";
    }
    if (KindOf(values) != Kind::kFree &&
        !(KindOf(values) == Kind::kBatched && Aligned(values, n->output()))) {
      return "writes values that hold the batch in another dimension";
    }
    return BatchedOutputs(n);
  }
  if (kx == Kind::kBatched) {
    if (!batched_indices.empty()) return "indexes batch values by batch values";
    const int bd = BatchDim(x);
    if (!own_rows && bd < static_cast<int>(list->inputs().size()) &&
        !IsNone(list->input(bd))) {
      return "picks some of the samples";
    }
    return BatchedOutputs(n);
  }
  if (kx == Kind::kFree && !batched_indices.empty()) {
    const Value* out = n->output();
    for (const Value* idx : batched_indices) {
      if (BatchDim(idx) != 0 || BatchDim(out) < 0) {
        return "looks up rows in a way the rules do not cover";
      }
    }
    return BatchedOutputs(n);
  }
  return "indexes batch values in a way the rules do not cover";
}

std::string Analysis::Diagonal(const Node* n) {
  const Value* x = n->input(0);
  if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
  const Value* d1 = NamedInput(n, "dim1");
  const Value* d2 = NamedInput(n, "dim2");
  if (d1 == nullptr || d2 == nullptr) return "takes a computed diagonal";
  std::optional<int64_t> a = ConstInt(d1);
  std::optional<int64_t> b = ConstInt(d2);
  if (!a || !b) return "takes a computed diagonal";
  const int rank = NameOf(n).base == "diagonal" ? Rank(x) : Rank(n->output());
  if (*a < 0) *a += rank;
  if (*b < 0) *b += rank;
  const int bd = NameOf(n).base == "diagonal" ? BatchDim(x) : BatchDim(n->output());
  if (*a == bd || *b == bd) return "takes a diagonal across the batch dimension";
  return BatchedOutputs(n);
}

std::string Analysis::Pad(const Node* n) {
  const Value* pad = NamedInput(n, "pad");
  std::optional<std::vector<int64_t>> p = ConstInts(pad ? pad : n->input(1));
  if (!p) return "pads by a computed amount";
  for (size_t i = 2; i < n->inputs().size(); ++i) {
    if (KindOf(n->input(i)) != Kind::kFree) return "pads with batch values";
  }
  return TailOnly(n, static_cast<int>(p->size() / 2));
}

}  // namespace batch_flow_internal
}  // namespace rannc
