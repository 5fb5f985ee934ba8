// AnalyzeBatchFlow's driver (batch_flow.h): the walk over the graph in order, control flow and
// in-place writes, the checks of each rule's result against the recorded facts, and where in the
// model an op comes from. The rules themselves: batch_flow_analysis.h says which file has which.
#include "daemon/graph/batch_flow.h"

#include <functional>
#include <optional>
#include <unordered_set>

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/scope.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/graph/batch_flow_analysis.h"
#include "daemon/graph/loss_denominators.h"

namespace rannc {
namespace batch_flow_internal {

Analysis::Analysis(const BatchFlowInputs& in) : in_(in) {
  if (in.losses != nullptr) {
    for (const LossDenominator& d : in.losses->denominators) {
      rewritten_.insert(d.added.begin(), d.added.end());
      means_.insert(d.mean);
    }
  }
}

BatchFlow Analysis::Run() {
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
    if (k == Kind::kSampleIndex) {
      return Fail(result, absl::StrCat("output %", out->debugName(),
                                       " numbers the samples, which a shard numbers anew"));
    }
    if (k == Kind::kInterleaved) {
      return Fail(result, absl::StrCat("output %", out->debugName(), " interleaves the samples' "
                                       "rows with other rows (a reshape merged dimensions "
                                       "before the batch's into it)"));
    }
  }
  for (const auto& [v, flow] : flows_) {
    if (flow.kind == Kind::kInterleaved) result.interleaved[v] = flow.outer;
  }
  return result;
}

BatchFlow Analysis::Fail(BatchFlow& result, std::string why) {
  result.separable = false;
  result.why = std::move(why);
  result.reductions.clear();
  result.interleaved.clear();
  return result;
}

// Whether `v` is a module tensor (a graph input after the client's and the step inputs), or
// a view of one.
bool Analysis::WritesModuleTensor(const Value* v) const {
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

// Every output of `n` gets `k`; per-sample tensors must have a recorded batch dimension.
std::string Analysis::SetAll(const Node* n, Kind k) {
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
std::string Analysis::CheckFacts(const Value* v, Kind k) const {
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
  } else if (k == Kind::kSampleIndex) {
    if (f == nullptr || f->batch_dim < 0 || !f->regular) {
      return absl::StrCat("numbers the samples in %", v->debugName(),
                          ", whose batch dimension no run recorded");
    }
  } else if (f != nullptr && f->batch_dim >= 0) {
    return absl::StrCat("makes %", v->debugName(), " with a batch dimension the rules did not "
                        "expect");
  }
  return "";
}

// A per-sample tensor `in` lines up with `out`'s batch: the same dimension counted from the
// right (broadcasting aligns trailing dimensions) and the same rows per sample.
bool Analysis::Aligned(const Value* in, const Value* out) const {
  const ValueFacts* a = Facts(in);
  const ValueFacts* b = Facts(out);
  if (a == nullptr || b == nullptr || a->batch_dim < 0 || b->batch_dim < 0) return false;
  return a->shape.size() - a->batch_dim == b->shape.size() - b->batch_dim &&
         a->shape[a->batch_dim] == b->shape[b->batch_dim];
}

// Normalized dims of the op's `name` argument: nullopt when absent or None ("all"), or
// `unknown` when not a constant.
std::optional<std::vector<int64_t>> Analysis::Dims(const Node* n, const char* name, int rank,
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

std::string Analysis::Visit(const Node* n) {
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

}  // namespace batch_flow_internal

namespace {

using batch_flow_internal::Analysis;
using torch::jit::Node;

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
