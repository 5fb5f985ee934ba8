#include "daemon/graph/batch_flow.h"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_set>

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/scope.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/graph/loss_denominators.h"

namespace rannc {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// What a value is with respect to the batch (see the header).
enum class Kind {
  kFree,     // independent of the batch
  kShape,    // computed from the batch's size (x.size(0)), not its values
  kBatched,  // per-sample: has the batch dimension, samples apart
  kMean,     // a mean over the samples of per-sample values
  kSum,      // a sum over the samples of per-sample values
  kList,     // a list or tuple holding per-sample or reduced values
};

struct Flow {
  Kind kind = Kind::kFree;
  // kShape lists (x.size()): the element that is the batch's size; -1 if none is known.
  int batch_element = -1;
};

bool IsReduced(Kind k) { return k == Kind::kMean || k == Kind::kSum; }

// The op's name without its namespace and without the trailing '_' of an in-place variant.
struct OpName {
  std::string base;
  bool in_place = false;
};
OpName NameOf(const Node* n) {
  OpName name;
  const std::string qual = n->kind().toQualString();
  const size_t colon = qual.rfind("::");
  name.base = colon == std::string::npos ? qual : qual.substr(colon + 2);
  if (name.base.size() > 1 && name.base.back() == '_' &&
      !(name.base.size() > 2 && name.base.substr(0, 2) == "__")) {
    name.base.pop_back();
    name.in_place = true;
  }
  return name;
}

// Constants' values, when they are constants of that type.
std::optional<c10::IValue> ConstValue(const Value* v) {
  if (v->node()->kind() != c10::prim::Constant) return std::nullopt;
  c10::optional<c10::IValue> iv = torch::jit::toIValue(v);
  if (!iv) return std::nullopt;
  return *iv;
}
std::optional<int64_t> ConstInt(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !iv->isInt()) return std::nullopt;
  return iv->toInt();
}
std::optional<double> ConstDouble(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !(iv->isDouble() || iv->isInt())) return std::nullopt;
  return iv->isDouble() ? iv->toDouble() : static_cast<double>(iv->toInt());
}
std::optional<bool> ConstBool(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !iv->isBool()) return std::nullopt;
  return iv->toBool();
}

bool IsNone(const Value* v) { return v->type()->kind() == c10::TypeKind::NoneType; }

// An int or int list that is constant (a prim::Constant or a ListConstruct of constants).
std::optional<std::vector<int64_t>> ConstInts(const Value* v) {
  if (auto one = ConstInt(v)) return std::vector<int64_t>{*one};
  if (std::optional<c10::IValue> iv = ConstValue(v); iv && iv->isIntList()) {
    return iv->toIntVector();
  }
  if (v->node()->kind() == c10::prim::ListConstruct) {
    std::vector<int64_t> out;
    for (const Value* in : v->node()->inputs()) {
      std::optional<int64_t> i = ConstInt(in);
      if (!i) return std::nullopt;
      out.push_back(*i);
    }
    return out;
  }
  return std::nullopt;
}

const Value* NamedInput(const Node* n, const char* name) {
  const c10::FunctionSchema* schema = n->maybeSchema();
  if (schema == nullptr) return nullptr;
  const c10::optional<int> i = schema->argumentIndexWithName(name);
  if (!i || *i >= static_cast<int>(n->inputs().size())) return nullptr;
  return n->input(*i);
}

// Ops that map each element (or each group of elements at one position) on its own, with
// broadcasting between tensor operands.
const std::unordered_set<std::string>& ElementwiseOps() {
  static const std::unordered_set<std::string> ops = {
      // unary
      "abs", "absolute", "neg", "negative", "positive", "relu", "relu6", "gelu", "silu",
      "sigmoid", "tanh", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "elu", "selu",
      "celu", "softplus", "mish", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
      "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
      "acosh", "atanh", "arcsin", "arccos", "arctan", "erf", "erfc", "erfinv", "square",
      "reciprocal", "sign", "sgn", "signbit", "floor", "ceil", "round", "trunc", "fix", "frac",
      "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "isneginf", "isposinf",
      "nan_to_num", "clamp", "clip", "clamp_min", "clamp_max", "threshold", "hardshrink",
      "softshrink", "logit", "rrelu", "rrelu_with_noise", "sinc", "deg2rad", "rad2deg",
      "angle", "conj", "real", "imag", "digamma", "lgamma", "i0",
      // dtype, device and copies
      "to", "type_as", "_to_copy", "contiguous", "clone", "detach", "alias", "lift_fresh",
      "float", "double", "half", "bfloat16", "int", "long", "bool", "requires_grad",
      "_autocast_to_reduced_precision", "_autocast_to_full_precision", "_cast_Float",
      "_cast_Half", "_cast_Long", "_cast_Int",
      // random, per element
      "dropout", "alpha_dropout", "bernoulli", "rand_like", "randn_like", "randint_like",
      "normal", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random",
      "native_dropout",
      // made like a tensor
      "zeros_like", "ones_like", "full_like", "empty_like", "fill", "zero",
      // binary and ternary, broadcasting
      "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
      "floor_divide", "remainder", "fmod", "pow", "float_power", "maximum", "minimum", "fmax",
      "fmin", "eq", "ne", "lt", "le", "gt", "ge", "greater", "less", "greater_equal",
      "less_equal", "not_equal", "logical_and", "logical_or", "logical_xor", "bitwise_and",
      "bitwise_or", "bitwise_xor", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__",
      "atan2", "arctan2", "hypot", "copysign", "xlogy", "where", "masked_fill", "lerp",
      "addcmul", "addcdiv", "copy", "heaviside", "logaddexp", "logaddexp2", "nextafter",
      "ldexp", "_masked_scale",
  };
  return ops;
}

// The module path of a node's inlined call.
std::string PathOf(const Node* n, std::string* type) {
  std::vector<std::string> path;
  if (auto cs = n->callstack()) {
    c10::optional<torch::jit::InlinedCallStackPtr> at = *cs;
    while (at) {
      if (auto info = (*at)->module_instance()) {
        std::string name = info->instance_name();
        if (absl::StartsWith(name, "__module.")) name = name.substr(9);
        if (!name.empty()) path.push_back(name);
        if (info->class_type() && info->class_type()->name()) {
          *type = info->class_type()->name()->name();
        }
      }
      at = (*at)->callee();
    }
  }
  // Traced instance names may repeat their parents' ("m", "m.features", "m.features.0").
  std::vector<std::string> parts;
  for (const std::string& p : path) {
    if (!parts.empty() && absl::StartsWith(p, absl::StrJoin(parts, ".") + ".")) {
      parts = absl::StrSplit(p, '.');
    } else {
      parts.push_back(p);
    }
  }
  return absl::StrJoin(parts, ".");
}

class Analysis {
 public:
  explicit Analysis(const BatchFlowInputs& in) : in_(in) {
    if (in.losses != nullptr) {
      for (const LossDenominator& d : in.losses->denominators) {
        rewritten_.insert(d.added.begin(), d.added.end());
        means_.insert(d.mean);
      }
    }
  }

  BatchFlow Run() {
    BatchFlow result;
    const Graph& graph = *in_.graph;
    for (size_t i = 0; i < graph.inputs().size(); ++i) {
      const Value* v = graph.inputs()[i];
      flows_[v] = {i < in_.num_client_inputs ? Kind::kBatched : Kind::kFree};
      if (i < in_.num_client_inputs) {
        const ValueFacts* f = in_.facts(v);
        if (f == nullptr || f->batch_dim != 0 || !f->regular) {
          return Fail(result, absl::StrCat("input ", i, " does not hold its samples along "
                                           "dimension 0 at a fixed size per sample"));
        }
      }
    }
    for (const Node* n : graph.nodes()) {
      std::string why = Visit(n);
      if (!why.empty()) {
        const std::string origin = ModuleOrigin(n);
        return Fail(result, absl::StrCat(n->kind().toQualString(),
                                         origin.empty() ? "" : absl::StrCat(" in ", origin), " ",
                                         why));
      }
    }
    if (!state_write_.empty()) return Fail(result, state_write_);
    for (const Value* out : graph.outputs()) {
      const Kind k = FlowOf(out).kind;
      if (k == Kind::kMean) result.reductions[out] = SampleReduction::kMean;
      if (k == Kind::kSum) result.reductions[out] = SampleReduction::kSum;
      if (k == Kind::kShape) {
        return Fail(result, absl::StrCat("output %", out->debugName(),
                                         " is computed from the batch's size"));
      }
      if (k == Kind::kList) {
        return Fail(result, absl::StrCat("output %", out->debugName(), " is a list"));
      }
    }
    return result;
  }

 private:
  static BatchFlow Fail(BatchFlow& result, std::string why) {
    result.separable = false;
    result.why = std::move(why);
    result.reductions.clear();
    return result;
  }

  // Whether `v` is a module tensor (a graph input after the client's and the step inputs), or
  // a view of one.
  bool WritesModuleTensor(const Value* v) const {
    static const std::unordered_set<std::string> views = {
        "view", "reshape", "select", "slice", "narrow", "expand", "expand_as", "transpose",
        "permute", "squeeze", "unsqueeze", "as_strided", "detach", "alias", "flatten", "t",
        "diagonal", "view_as", "unflatten", "split", "chunk", "unbind", "__getitem__",
        "ListUnpack"};
    while (v->node()->kind() != c10::prim::Param) {
      const Node* p = v->node();
      if (p->inputs().empty() || !views.count(NameOf(p).base)) return false;
      v = p->input(0);
    }
    return v->offset() >= in_.num_client_inputs + in_.num_step_inputs;
  }

  Flow FlowOf(const Value* v) const {
    auto it = flows_.find(v);
    return it == flows_.end() ? Flow{} : it->second;
  }
  Kind KindOf(const Value* v) const { return FlowOf(v).kind; }
  const ValueFacts* Facts(const Value* v) const { return in_.facts(v); }
  int BatchDim(const Value* v) const {
    const ValueFacts* f = Facts(v);
    return f == nullptr ? -1 : f->batch_dim;
  }
  int Rank(const Value* v) const {
    const ValueFacts* f = Facts(v);
    return f == nullptr ? -1 : static_cast<int>(f->shape.size());
  }

  void Set(const Value* v, Kind k, int batch_element = -1) { flows_[v] = {k, batch_element}; }

  // Every output of `n` gets `k`; per-sample tensors must have a recorded batch dimension.
  std::string SetAll(const Node* n, Kind k) {
    for (const Value* o : n->outputs()) {
      Kind ko = k;
      if (k == Kind::kBatched && o->type()->kind() != c10::TypeKind::TensorType) {
        ko = o->type()->kind() == c10::TypeKind::ListType ? Kind::kList : Kind::kFree;
        if (ko == Kind::kFree) continue;
      }
      std::string why = CheckFacts(o, ko);
      if (!why.empty()) return why;
      Set(o, ko);
    }
    return "";
  }

  // The recorded facts must agree with what the rule says a tensor is.
  std::string CheckFacts(const Value* v, Kind k) const {
    if (v->type()->kind() != c10::TypeKind::TensorType) return "";
    const ValueFacts* f = Facts(v);
    if (k == Kind::kBatched) {
      if (f == nullptr) {
        return absl::StrCat("makes %", v->debugName(), ", whose shape no run recorded");
      }
      if (f->batch_dim < 0) {
        return absl::StrCat("makes %", v->debugName(),
                            " without a batch dimension from per-sample values");
      }
      if (!f->regular) {
        return absl::StrCat("makes %", v->debugName(), ", whose batch dimension is not a whole "
                            "number of rows per sample");
      }
    } else if (f != nullptr && f->batch_dim >= 0) {
      return absl::StrCat("makes %", v->debugName(), " with a batch dimension the rules did not "
                          "expect");
    }
    return "";
  }

  // A per-sample tensor `in` lines up with `out`'s batch: the same dimension counted from the
  // right (broadcasting aligns trailing dimensions) and the same rows per sample.
  bool Aligned(const Value* in, const Value* out) const {
    const ValueFacts* a = Facts(in);
    const ValueFacts* b = Facts(out);
    if (a == nullptr || b == nullptr || a->batch_dim < 0 || b->batch_dim < 0) return false;
    return a->shape.size() - a->batch_dim == b->shape.size() - b->batch_dim &&
           a->shape[a->batch_dim] == b->shape[b->batch_dim];
  }

  // Normalized dims of the op's `name` argument: nullopt when absent or None ("all"), or
  // `unknown` when not a constant.
  std::optional<std::vector<int64_t>> Dims(const Node* n, const char* name, int rank,
                                           bool* unknown) const {
    *unknown = false;
    const Value* arg = NamedInput(n, name);
    if (arg == nullptr || IsNone(arg)) return std::nullopt;
    std::optional<std::vector<int64_t>> dims = ConstInts(arg);
    if (!dims) {
      *unknown = true;
      return std::nullopt;
    }
    for (int64_t& d : *dims) {
      if (d < 0) d += rank;
    }
    return dims;
  }

  std::string Visit(const Node* n) {
    if (n->kind() == c10::prim::Constant) return "";
    bool any = false;
    for (const Value* in : n->inputs()) any = any || KindOf(in) != Kind::kFree;
    if (!n->blocks().empty()) {
      std::function<bool(const torch::jit::Block*)> reads = [&](const torch::jit::Block* b) {
        for (const Node* inner : b->nodes()) {
          for (const Value* in : inner->inputs()) {
            if (KindOf(in) != Kind::kFree) return true;
          }
          for (const torch::jit::Block* bb : inner->blocks()) {
            if (reads(bb)) return true;
          }
        }
        return false;
      };
      for (const torch::jit::Block* b : n->blocks()) any = any || reads(b);
      if (any) return "runs control flow on batch values";
      return "";
    }
    const OpName name = NameOf(n);
    if (name.in_place && !n->inputs().empty() && WritesModuleTensor(n->input(0)) &&
        state_write_.empty()) {
      // Reported only if nothing else keeps the batch whole: BatchNorm's counter comes before
      // the normalization that says more.
      const std::string origin = ModuleOrigin(n);
      state_write_ = absl::StrCat(n->kind().toQualString(),
                                  origin.empty() ? "" : absl::StrCat(" in ", origin),
                                  " updates a parameter or buffer in forward, which a split "
                                  "batch would do once per shard");
    }
    if (!any) return "";  // parameters, constants and what is made of them
    if (rewritten_.count(n)) {
      // A rewritten mean loss (graph/loss_denominators.h): the shard's part of the mean.
      for (const Value* o : n->outputs()) Set(o, means_.count(n) ? Kind::kMean : Kind::kFree);
      return "";
    }
    std::string why = Dispatch(n, name);
    if (!why.empty()) return why;
    if (name.in_place && !n->inputs().empty() && !n->outputs().empty()) {
      // The op wrote its first operand: it is what the output is now.
      const Kind before = KindOf(n->input(0));
      const Kind after = KindOf(n->output(0));
      if (before != after && before != Kind::kBatched) {
        return "writes values computed from the batch into a tensor shared by every sample";
      }
      auto written = flows_.find(n->output(0));
      if (written != flows_.end()) flows_[n->input(0)] = written->second;
    }
    return "";
  }

  std::string Dispatch(const Node* n, const OpName& name) {
    const std::string& op = name.base;
    const std::string qual = n->kind().toQualString();
    // Structure: lists, tuples, sizes, scalars.
    if (qual == "prim::ListConstruct" || qual == "prim::TupleConstruct") return ListConstruct(n);
    if (qual == "prim::ListUnpack" || qual == "prim::TupleUnpack") return Unpack(n);
    if (qual == "aten::__getitem__" || qual == "prim::TupleIndex") return GetItem(n);
    if (qual == "prim::NumToTensor" || op == "ScalarImplicit" || op == "IntImplicit" ||
        op == "FloatImplicit" || op == "Int" || op == "Float" || op == "Bool" || op == "item" ||
        op == "_local_scalar_dense" || op == "tolist") {
      return ScalarRead(n);
    }
    if (qual == "aten::size" || qual == "aten::numel" || qual == "aten::len" ||
        qual == "prim::shape" || qual == "aten::sym_size") {
      return Size(n);
    }
    if (qual == "aten::dim" || qual == "prim::device" || qual == "prim::dtype" ||
        qual == "prim::layout" || op == "is_floating_point" || op == "is_complex" ||
        op == "__is__" || op == "__isnot__" || qual == "prim::is_cuda" || op == "get_device") {
      return SetAll(n, Kind::kFree);  // metadata, the same for every shard
    }
    if (n->kind().is_prim()) return "is not known to keep samples apart";

    if (op == "max" || op == "min") {
      if (NamedInput(n, "other") != nullptr) return Elementwise(n, name);
      if (NamedInput(n, "dim") != nullptr) return DimOnly(n, "dim");
      return FullReduction(n);
    }
    if (ElementwiseOps().count(op)) return Elementwise(n, name);
    if (op == "sum" || op == "nansum") return Reduce(n, Kind::kSum);
    if (op == "mean") return Reduce(n, Kind::kMean);
    static const std::unordered_set<std::string> dim_only = {
        "amax", "amin", "prod", "logsumexp", "std", "var", "std_mean", "var_mean", "all", "any",
        "norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm", "count_nonzero", "median",
        "nanmedian", "nanmean", "mode", "argmax", "argmin", "cumsum", "cumprod",
        "logcumsumexp", "cummax", "cummin", "softmax", "log_softmax", "_softmax",
        "_log_softmax", "sort", "argsort", "topk", "kthvalue", "glu", "cross", "diff",
        "select", "narrow", "unbind", "split", "split_with_sizes", "chunk", "tensor_split",
        "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes", "repeat_interleave",
        "cosine_similarity", "renorm", "index_fill", "index_copy", "index_add",
    };
    if (op == "index_select") return IndexSelect(n);
    if (op == "gather" || op == "take_along_dim" || op == "scatter" || op == "scatter_add" ||
        op == "scatter_reduce" || op == "index_add" || op == "index_copy" || op == "index_fill") {
      return Indexed(n, name);
    }
    if (op == "squeeze") return Squeeze(n);
    if (op == "flip" || op == "roll") return DimOnly(n, "dims");
    if (op == "unfold") return DimOnly(n, "dimension");
    if (dim_only.count(op)) return DimOnly(n, "dim");
    if (op == "slice") return Slice(n);
    static const std::unordered_set<std::string> reshapes = {
        "view", "reshape", "_reshape_alias", "_unsafe_view", "flatten", "unflatten", "view_as",
        "reshape_as"};
    if (reshapes.count(op)) return Reshape(n);
    static const std::unordered_set<std::string> rearranges = {
        "permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "unsqueeze",
        "one_hot", "numpy_T", "mT", "adjoint", "view_as_real", "view_as_complex", "atleast_1d",
        "atleast_2d", "atleast_3d", "align_as"};
    if (rearranges.count(op)) return Rearrange(n);
    if (op == "expand" || op == "expand_as" || op == "broadcast_to") return Expand(n);
    if (op == "repeat" || op == "tile") return Repeat(n);
    static const std::unordered_set<std::string> factories = {
        "zeros", "ones", "full", "empty", "empty_strided", "rand", "randn", "randint",
        "scalar_tensor", "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided",
        "tensor", "as_tensor"};
    if (factories.count(op)) return Factory(n);
    if (op == "cat" || op == "concat" || op == "concatenate" || op == "stack" ||
        op == "hstack" || op == "vstack" || op == "dstack" || op == "column_stack") {
      return Concat(n, op);
    }
    if (op == "linear") return LinearLayer(n, {1, 2});
    if (op == "_convolution" || op == "convolution" || op == "conv1d" || op == "conv2d" ||
        op == "conv3d" || op == "conv_transpose1d" || op == "conv_transpose2d" ||
        op == "conv_transpose3d" || op == "cudnn_convolution" || op == "mkldnn_convolution" ||
        op == "_convolution_mode") {
      return LeadingBatch(n, {0}, /*free=*/{1, 2});
    }
    if (op == "matmul") return Matmul(n);
    if (op == "mm") return LeadingBatch(n, {0}, {1});
    if (op == "bmm") return Bmm(n, 0, 1);
    if (op == "addmm") return Addmm(n);
    if (op == "baddbmm") return Baddbmm(n);
    if (op == "einsum") return Einsum(n);
    if (op == "scaled_dot_product_attention" || op == "_scaled_dot_product_attention" ||
        op == "_scaled_dot_product_flash_attention" ||
        op == "_scaled_dot_product_efficient_attention") {
      return Attention(n);
    }
    if (op == "embedding") return Embedding(n);
    if (op == "batch_norm" || op == "_batch_norm_impl_index" || op == "native_batch_norm" ||
        op == "cudnn_batch_norm" || op == "miopen_batch_norm") {
      return BatchNorm(n);
    }
    if (op == "instance_norm") return InstanceNorm(n);
    if (op == "group_norm") return LeadingBatch(n, {0}, {2, 3});
    if (op == "layer_norm" || op == "native_layer_norm" || op == "rms_norm") return LayerNorm(n);
    if (op == "prelu" || op == "_prelu_kernel") return LeadingBatch(n, {0}, {1});
    if (op == "feature_dropout" || op == "feature_alpha_dropout" || op == "dropout2d" ||
        op == "dropout3d" || op == "dropout1d") {
      return LeadingBatch(n, {0}, {});
    }
    if (op == "pixel_shuffle" || op == "pixel_unshuffle" || op == "channel_shuffle" ||
        op == "native_channel_shuffle") {
      return TailOnly(n, 3);
    }
    if (op == "tril" || op == "triu") return TailOnly(n, 2);
    if (op == "diagonal" || op == "diag_embed") return Diagonal(n);
    if (op == "im2col" || op == "col2im" || op == "grid_sampler" || op == "grid_sampler_2d" ||
        op == "grid_sampler_3d" || op == "affine_grid_generator") {
      return LeadingBatch(n, {0, 1}, {});
    }
    if (absl::StartsWith(op, "max_pool") || absl::StartsWith(op, "avg_pool") ||
        absl::StartsWith(op, "adaptive_avg_pool") || absl::StartsWith(op, "adaptive_max_pool") ||
        absl::StartsWith(op, "upsample_") || absl::StartsWith(op, "_upsample_") ||
        absl::StartsWith(op, "reflection_pad") || absl::StartsWith(op, "replication_pad") ||
        absl::StartsWith(op, "lp_pool") || absl::StartsWith(op, "mkldnn_max_pool") ||
        absl::StartsWith(op, "_adaptive_avg_pool") || absl::StartsWith(op, "quantized_max_pool")) {
      const char* digit = op.c_str() + op.find_first_of("123");
      if (op.find_first_of("123") == std::string::npos) return "is not known to keep samples apart";
      return TailOnly(n, *digit - '0');
    }
    if (op == "pad" || op == "constant_pad_nd" || op == "_pad_circular" || op == "_pad_enum") {
      return Pad(n);
    }
    if (op == "pairwise_distance") return TailOnly(n, 1);
    if (op == "cdist") return Cdist(n);
    if (op == "outer" || op == "ger") return Outer(n);
    static const std::unordered_set<std::string> losses = {
        "nll_loss", "nll_loss2d", "nll_loss_nd", "cross_entropy_loss", "mse_loss", "l1_loss",
        "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss",
        "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss",
        "multilabel_margin_loss", "multi_margin_loss", "triplet_margin_loss"};
    if (losses.count(op)) return Loss(n, op);
    static const std::unordered_set<std::string> numbering = {
        "arange", "linspace", "logspace", "range", "eye", "tril_indices", "triu_indices",
        "randperm"};
    if (numbering.count(op)) {
      return "numbers or orders the samples: its result depends on how many there are";
    }
    if (op == "lstm" || op == "gru" || op == "rnn_tanh" || op == "rnn_relu") return Rnn(n);
    if (op == "index" || op == "index_put") return Index(n, name);
    if (op == "broadcast_tensors") return BroadcastTensors(n);
    return "is not known to keep samples apart";
  }

  // --- rules -------------------------------------------------------------------------------

  std::string ListConstruct(const Node* n) {
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
  std::optional<std::vector<Flow>> Elements(const Value* list, size_t count) const {
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

  std::string Unpack(const Node* n) {
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

  std::string GetItem(const Node* n) {
    const std::optional<int64_t> index = ConstInt(n->input(1));
    const Flow list = FlowOf(n->input(0));
    if (list.kind == Kind::kShape) {
      Set(n->output(), list.batch_element < 0 || (index && *index == list.batch_element)
                           ? Kind::kShape
                           : Kind::kFree);
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

  std::string ScalarRead(const Node* n) {
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

  std::string Size(const Node* n) {
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
    Set(n->output(), bd >= 0 ? Kind::kShape : Kind::kFree, bd);
    return "";
  }

  std::string Elementwise(const Node* n, const OpName& name) {
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
  std::string Linear(const Node* n, const std::string& op,
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
  std::string Reduce(const Node* n, Kind kind) {
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
  std::string DimOnly(const Node* n, const char* arg) {
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
  std::string BatchedOutputs(const Node* n) {
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

  std::string FullReduction(const Node* n) {
    const Kind k = KindOf(n->input(0));
    if (k == Kind::kShape) return SetAll(n, Kind::kShape);
    return "reduces over the whole tensor, the batch dimension included, and is not a sum or "
           "a mean";
  }

  // Ops on the last `tail` dimensions (pooling, padding, ...): the batch must be before them.
  std::string TailOnly(const Node* n, int tail) {
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

  // Ops whose operands in `batched_args` must hold the batch in dimension 0 (convolutions,
  // group norm, mm's rows) and whose `free_args` must be free of it.
  std::string LeadingBatch(const Node* n, std::vector<int> batched_args,
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
  std::string LinearLayer(const Node* n, std::vector<int> free) {
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

  std::string Matmul(const Node* n) {
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

  std::string Bmm(const Node* n, int ai, int bi) {
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

  std::string Addmm(const Node* n) {
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

  std::string Baddbmm(const Node* n) {
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
  std::string Einsum(const Node* n) {
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

  std::string Attention(const Node* n) {
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

  std::string Embedding(const Node* n) {
    if (KindOf(n->input(0)) != Kind::kFree) return "reads batch values as its table";
    if (KindOf(n->input(1)) != Kind::kBatched) return "reads a batch size or reduced value";
    for (size_t i = 2; i < n->inputs().size(); ++i) {
      if (KindOf(n->input(i)) != Kind::kFree) return "takes batch values as options";
    }
    return BatchedOutputs(n);
  }

  std::string BatchNorm(const Node* n) {
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

  std::string InstanceNorm(const Node* n) {
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

  std::string LayerNorm(const Node* n) {
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

  std::string Squeeze(const Node* n) {
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

  std::string Slice(const Node* n) {
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
  std::string Reshape(const Node* n) {
    const Value* x = n->input(0);
    if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
    if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
    const Value* out = n->output();
    std::string why = CheckFacts(out, Kind::kBatched);
    if (!why.empty()) return why;
    const ValueFacts* a = Facts(x);
    const ValueFacts* b = Facts(out);
    int64_t before_in = 1, before_out = 1;
    for (int d = 0; d < a->batch_dim; ++d) before_in *= a->shape[d];
    for (int d = 0; d < b->batch_dim; ++d) before_out *= b->shape[d];
    if (before_in != before_out) {
      return "reshapes so that samples interleave (the dimensions before the batch change)";
    }
    Set(out, Kind::kBatched);
    return "";
  }

  std::string Rearrange(const Node* n) {
    const Value* x = n->input(0);
    if (KindOf(x) == Kind::kShape || IsReduced(KindOf(x))) return SetAll(n, KindOf(x));
    if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
    for (size_t i = 1; i < n->inputs().size(); ++i) {
      if (KindOf(n->input(i)) != Kind::kFree) return "takes batch values as options";
    }
    return BatchedOutputs(n);
  }

  std::string Expand(const Node* n) {
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

  std::string Repeat(const Node* n) {
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

  std::string Factory(const Node* n) {
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

  std::string Concat(const Node* n, const std::string& op) {
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
  std::string BroadcastTensors(const Node* n) {
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

  std::string IndexSelect(const Node* n) {
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
  std::string Indexed(const Node* n, const OpName& name) {
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
  std::string Index(const Node* n, const OpName& name) {
    const Value* x = n->input(0);
    const Node* list = n->input(1)->node();
    if (list->kind() != c10::prim::ListConstruct) {
      return "indexes with a list the analysis cannot read";
    }
    const Kind kx = KindOf(x);
    std::vector<const Value*> batched_indices;
    for (size_t i = 0; i < list->inputs().size(); ++i) {
      const Value* idx = list->input(i);
      if (IsNone(idx)) continue;
      const Kind k = KindOf(idx);
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
      if (bd < static_cast<int>(list->inputs().size()) && !IsNone(list->input(bd))) {
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

  std::string Diagonal(const Node* n) {
    const Value* x = n->input(0);
    if (KindOf(x) != Kind::kBatched) return "reads batch values in a way the rules do not cover";
    const Value* d1 = NamedInput(n, "dim1");
    const Value* d2 = NamedInput(n, "dim2");
    std::optional<int64_t> a = d1 ? ConstInt(d1) : std::nullopt;
    std::optional<int64_t> b = d2 ? ConstInt(d2) : std::nullopt;
    if (!a || !b) return "takes a computed diagonal";
    const int rank = NameOf(n).base == "diagonal" ? Rank(x) : Rank(n->output());
    if (*a < 0) *a += rank;
    if (*b < 0) *b += rank;
    const int bd = NameOf(n).base == "diagonal" ? BatchDim(x) : BatchDim(n->output());
    if (*a == bd || *b == bd) return "takes a diagonal across the batch dimension";
    return BatchedOutputs(n);
  }

  std::string Pad(const Node* n) {
    const Value* pad = NamedInput(n, "pad");
    std::optional<std::vector<int64_t>> p = ConstInts(pad ? pad : n->input(1));
    if (!p) return "pads by a computed amount";
    for (size_t i = 2; i < n->inputs().size(); ++i) {
      if (KindOf(n->input(i)) != Kind::kFree) return "pads with batch values";
    }
    return TailOnly(n, static_cast<int>(p->size() / 2));
  }

  std::string Cdist(const Node* n) {
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

  std::string Outer(const Node* n) {
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
  std::string Loss(const Node* n, const std::string& op) {
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

  std::string Rnn(const Node* n) {
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

  const BatchFlowInputs& in_;
  std::unordered_map<const Value*, Flow> flows_;
  std::string state_write_;  // the first op that writes a module tensor, described
  std::unordered_set<const Value*> split_lists_;
  // Sizes that are exactly the number of samples (x.size(0) of a tensor with a row per sample).
  std::unordered_set<const Value*> sample_counts_;
  std::unordered_set<const Node*> rewritten_, means_;
};

}  // namespace

std::string ModuleOrigin(const Node* node) {
  std::string type;
  std::string path = PathOf(node, &type);
  if (path.empty()) return "";
  const size_t dot = type.rfind('.');
  if (dot != std::string::npos) type = type.substr(dot + 1);
  return type.empty() ? path : absl::StrCat(path, " (", type, ")");
}

BatchFlow AnalyzeBatchFlow(const BatchFlowInputs& inputs) { return Analysis(inputs).Run(); }

}  // namespace rannc
