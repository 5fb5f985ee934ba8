// Questions about a TorchScript graph (whether its shapes follow from shapes, its random ops, a
// node's inputs from outside it) and about a built IR (ir.h), apart from building one.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <set>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/host_reads.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/ir_internal.h"

namespace rannc {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// Ops that draw from a generator. Node::isNondeterministic() knows most of them from their
// schemas; the names also catch ops whose schema it does not list (and are cheap to over-lock).
bool IsRandomKind(const torch::jit::Node* n) {
  static const std::set<std::string> kinds = {
      "aten::dropout",          "aten::dropout_",         "aten::feature_dropout",
      "aten::feature_dropout_", "aten::alpha_dropout",    "aten::alpha_dropout_",
      "aten::feature_alpha_dropout", "aten::feature_alpha_dropout_", "aten::native_dropout",
      "aten::_fused_dropout",   "aten::bernoulli",        "aten::bernoulli_",
      "aten::rand",             "aten::rand_like",        "aten::randn",
      "aten::randn_like",       "aten::randint",          "aten::randint_like",
      "aten::randperm",         "aten::normal",           "aten::normal_",
      "aten::uniform_",         "aten::multinomial",      "aten::poisson",
      "aten::binomial",         "aten::exponential_",     "aten::geometric_",
      "aten::cauchy_",          "aten::log_normal_",      "aten::random_",
      "aten::rrelu",            "aten::rrelu_",           "aten::rrelu_with_noise",
      "aten::rrelu_with_noise_", "aten::_standard_gamma", "aten::_sample_dirichlet",
  };
  return kinds.count(n->kind().toQualString()) > 0;
}

}  // namespace

namespace ir_internal {

bool IsShapeOp(const Node* n) {
  static const std::unordered_set<std::string> kinds = {
      "aten::size", "aten::dim", "aten::numel", "prim::shape", "aten::len"};
  return kinds.count(n->kind().toQualString()) > 0;
}

}  // namespace ir_internal

bool ShapesFollowFromShapes(Graph& graph) {
  // Ops that make a shape from contents, and reads of contents into host values (host_reads.h)
  // or host bools.
  static const std::unordered_set<std::string> kinds = {
      "aten::nonzero",    "aten::nonzero_numpy", "aten::argwhere",       "aten::masked_select",
      "aten::unique",     "aten::_unique",       "aten::_unique2",       "aten::unique_dim",
      "aten::unique_consecutive", "aten::unique_dim_consecutive",         "aten::bincount",
      "aten::repeat_interleave",  "aten::equal", "aten::is_nonzero",     "aten::allclose",
      "aten::index",
  };
  // where(condition) alone is nonzero by another name.
  auto contents_to_shape = [&](const Node* n) {
    return IsHostRead(n) || kinds.count(n->kind().toQualString()) > 0 ||
           (n->kind() == c10::aten::where && n->inputs().size() == 1);
  };
  std::function<bool(torch::jit::Block*)> nested_ok = [&](torch::jit::Block* b) {
    for (Node* n : b->nodes()) {
      if (contents_to_shape(n)) return false;
      for (torch::jit::Block* inner : n->blocks()) {
        if (!nested_ok(inner)) return false;
      }
    }
    return true;
  };
  std::unordered_set<const Value*> from_contents(graph.inputs().begin(), graph.inputs().end());
  for (Node* n : graph.nodes()) {
    bool contents = false;
    for (Value* in : ExternalInputs(n)) contents = contents || from_contents.count(in) > 0;
    if (contents && (contents_to_shape(n) || !n->blocks().empty())) {
      return false;
    }
    for (torch::jit::Block* b : n->blocks()) {
      if (!nested_ok(b)) return false;
    }
    if (contents && !ir_internal::IsShapeOp(n)) {
      for (Value* o : n->outputs()) from_contents.insert(o);
    }
  }
  return true;
}

bool FusesForwardBackward(const IrGraph& ir) {
  if (ir.outputs.empty()) return false;
  const IrValue& first = ir.values[ir.outputs[0]];
  if (!first.is_loss || !first.shape.empty() || !at::isFloatingType(first.dtype)) return false;
  for (size_t i = 1; i < ir.outputs.size(); ++i) {
    if (at::isFloatingType(ir.values[ir.outputs[i]].dtype)) return false;
  }
  return true;
}

std::optional<at::ScalarType> LowPrecisionRead(const IrGraph& ir, int lifted) {
  const size_t input = ir.num_user_inputs + static_cast<size_t>(lifted);
  if (lifted < 0 || input >= ir.inputs.size()) return std::nullopt;
  const IrValue& param = ir.values[ir.inputs[input]];
  if (param.role != ValueRole::kParam || !at::isFloatingType(param.dtype)) return std::nullopt;
  const auto& uses = param.jit->uses();
  if (uses.size() != 1 || uses[0].offset != 0) return std::nullopt;
  const Node* cast = uses[0].user;
  if (cast->kind() != c10::aten::to || cast->outputs().size() != 1) return std::nullopt;
  auto out = ir.value_index.find(cast->output());
  if (out == ir.value_index.end()) return std::nullopt;
  const at::ScalarType dtype = ir.values[out->second].dtype;
  if (!at::isFloatingType(dtype) || at::elementSize(dtype) >= at::elementSize(param.dtype)) {
    return std::nullopt;
  }
  // The cast of a parameter already in its dtype returns the parameter itself: nothing may
  // write what it returns.
  for (const torch::jit::Use& use : cast->output()->uses()) {
    const std::string kind = use.user->kind().toQualString();
    if (kind.size() > 1 && kind.back() == '_' && kind[kind.size() - 2] != '_') {
      return std::nullopt;
    }
  }
  return dtype;
}

bool HasRandomOps(const torch::jit::Block* block) {
  for (const torch::jit::Node* n : block->nodes()) {
    if (IsRandomKind(n) || n->isNondeterministic()) return true;
    for (const torch::jit::Block* b : n->blocks()) {
      if (HasRandomOps(b)) return true;
    }
  }
  return false;
}

std::vector<Value*> ExternalInputs(Node* n) {
  std::vector<Value*> out(n->inputs().begin(), n->inputs().end());
  if (n->blocks().empty()) return out;
  std::unordered_set<const Value*> inside;
  std::function<void(torch::jit::Block*)> visit = [&](torch::jit::Block* b) {
    for (Value* p : b->inputs()) inside.insert(p);
    for (Node* inner : b->nodes()) {
      for (Value* v : inner->inputs()) {
        if (!inside.count(v)) out.push_back(v);
      }
      for (Value* o : inner->outputs()) inside.insert(o);
      for (torch::jit::Block* nested : inner->blocks()) visit(nested);
    }
    for (Value* v : b->outputs()) {
      if (!inside.count(v)) out.push_back(v);
    }
  };
  for (torch::jit::Block* b : n->blocks()) visit(b);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string StableHash(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

at::Tensor RepeatSamples(const at::Tensor& t, int64_t n) {
  return t.index_select(0, at::arange(n, t.options().dtype(at::kLong)).remainder(t.size(0)));
}

const char* ValueRoleName(ValueRole role) {
  switch (role) {
    case ValueRole::kInput: return "input";
    case ValueRole::kParam: return "param";
    case ValueRole::kBuffer: return "buffer";
    case ValueRole::kActivation: return "activation";
    case ValueRole::kParamDerived: return "param-derived";
    case ValueRole::kConst: return "const";
  }
  return "unknown";
}

double CutBytesPerSample(const IrGraph& ir, int boundary) {
  double bytes = 0;
  for (const IrValue& v : ir.values) {
    if (v.producer < 0 || v.producer >= boundary || !v.is_tensor) continue;
    bool crosses = false;
    for (int c : v.consumers) crosses = crosses || c >= boundary;
    if (crosses) {
      bytes += v.interleave > 1 ? kNoCutBytes : static_cast<double>(v.bytes) / ir.example_batch;
    }
  }
  return bytes;
}

std::string DescribeIr(const IrGraph& ir) {
  std::ostringstream out;
  auto describe = [&](int id) {
    const IrValue& v = ir.values[id];
    std::string s = absl::StrCat("%", v.name, ":", ValueRoleName(v.role));
    if (v.is_tensor) absl::StrAppend(&s, ":", DescribeTensor(v.dtype, v.shape));
    if (v.batch_dim >= 0) absl::StrAppend(&s, "@", v.batch_dim);
    return s;
  };
  for (size_t i = 0; i < ir.nodes.size(); ++i) {
    const IrNode& n = ir.nodes[i];
    std::vector<std::string> ins, outs;
    for (int v : n.inputs) ins.push_back(describe(v));
    for (int v : n.outputs) outs.push_back(describe(v));
    out << i << ' ' << n.label << " (" << absl::StrJoin(ins, ", ") << ") -> ("
        << absl::StrJoin(outs, ", ") << ")\n";
  }
  return out.str();
}

}  // namespace rannc
