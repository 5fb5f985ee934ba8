// Which rule of the batch analysis each op follows (batch_flow.h): the tables of op names, by
// what the rule needs to know of them. An op on no list keeps the batch whole; adding one here
// (with a case in batch_flow_test.cc) is how the analysis learns an op.
#include <string>
#include <unordered_set>

#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/match.h"
#include "daemon/graph/batch_flow_analysis.h"
#include "daemon/graph/host_reads.h"

namespace rannc {
namespace batch_flow_internal {
namespace {

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

}  // namespace

std::string Analysis::Dispatch(const Node* n, const OpName& name) {
  const std::string& op = name.base;
  const std::string qual = n->kind().toQualString();
  for (const Value* in : n->inputs()) {
    if (KindOf(in) == Kind::kSampleIndex) return SampleIndexUse(n, name);
    if (KindOf(in) == Kind::kInterleaved) return InterleavedUse(n, name);
  }
  // Structure: lists, tuples, sizes, scalars.
  if (qual == "prim::ListConstruct" || qual == "prim::TupleConstruct") return ListConstruct(n);
  if (qual == "prim::ListUnpack" || qual == "prim::TupleUnpack") return Unpack(n);
  if (qual == "aten::__getitem__" || qual == "prim::TupleIndex") return GetItem(n);
  // A size made a tensor, and reads of tensor contents into host values (graph/host_reads.h).
  if (qual == "prim::NumToTensor" || IsHostRead(n)) return ScalarRead(n);
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
  if (op == "arange") return SampleNumbers(n);
  if (numbering.count(op)) {
    return "numbers or orders the samples: its result depends on how many there are";
  }
  if (op == "lstm" || op == "gru" || op == "rnn_tanh" || op == "rnn_relu") return Rnn(n);
  if (op == "index" || op == "index_put") return Index(n, name);
  if (op == "broadcast_tensors") return BroadcastTensors(n);
  return "is not known to keep samples apart";
}

}  // namespace batch_flow_internal
}  // namespace rannc
