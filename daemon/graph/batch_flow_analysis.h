// Private to //daemon/graph:batch_flow: the analysis behind AnalyzeBatchFlow (batch_flow.h),
// shared by its files:
//   batch_flow.cc         the driver: the walk over the graph, control flow, in-place writes,
//                         the checks of each rule's result against the recorded facts
//   batch_flow_ops.cc     which rule each op follows: the tables of op names
//   batch_flow_rules.cc   the rules of structure, elementwise ops, reductions, reshapes and
//                         indexing
//   batch_flow_layers.cc  the rules of layers: linear, convolution, matmul, attention,
//                         normalizations, losses, recurrences
// An Analysis runs once, on one thread; nothing here outlives AnalyzeBatchFlow.
#ifndef RANNC_DAEMON_GRAPH_BATCH_FLOW_ANALYSIS_H_
#define RANNC_DAEMON_GRAPH_BATCH_FLOW_ANALYSIS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include "daemon/graph/batch_flow.h"

namespace rannc {
namespace batch_flow_internal {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// What a value is with respect to the batch (see batch_flow.h).
enum class Kind {
  kFree,     // independent of the batch
  kShape,    // computed from the batch's size (x.size(0)), not its values
  kBatched,  // per-sample: has the batch dimension, samples apart
  kMean,     // a mean over the samples of per-sample values
  kSum,      // a sum over the samples of per-sample values
  kList,     // a list or tuple holding per-sample or reduced values
  // Each sample's number in the batch (torch.arange(x.size(0)), maybe unsqueezed): used only
  // to pick each sample's own row of a per-sample tensor (x[arange(B)[:, None], j], as Hugging
  // Face's attention masks do), where a shard's numbers pick the same samples' rows.
  kSampleIndex,
  // Per-sample, but a reshape merged dimensions before the batch's into it: the batch dimension
  // holds `outer` blocks, each with every sample's rows in order (nn.MultiheadAttention's
  // (seq * batch, embed) view before its output projection). Followed only through ops that
  // treat each row of it apart (linear, elementwise ops with nothing else to broadcast) and
  // reshapes, until one splits the blocks out again; a stage boundary may not reshard it
  // (IrValue::interleave).
  kInterleaved,
};

struct Flow {
  Kind kind = Kind::kFree;
  // kShape lists (x.size()): the element that is the batch's size; -1 if none is known.
  int batch_element = -1;
  int64_t outer = 1;  // kInterleaved: the blocks along the batch dimension
};

inline bool IsReduced(Kind k) { return k == Kind::kMean || k == Kind::kSum; }

// The op's name without its namespace and without the trailing '_' of an in-place variant.
struct OpName {
  std::string base;
  bool in_place = false;
};
inline OpName NameOf(const Node* n) {
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
inline std::optional<c10::IValue> ConstValue(const Value* v) {
  if (v->node()->kind() != c10::prim::Constant) return std::nullopt;
  c10::optional<c10::IValue> iv = torch::jit::toIValue(v);
  if (!iv) return std::nullopt;
  return *iv;
}
inline std::optional<int64_t> ConstInt(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !iv->isInt()) return std::nullopt;
  return iv->toInt();
}
inline std::optional<double> ConstDouble(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !(iv->isDouble() || iv->isInt())) return std::nullopt;
  return iv->isDouble() ? iv->toDouble() : static_cast<double>(iv->toInt());
}
inline std::optional<bool> ConstBool(const Value* v) {
  std::optional<c10::IValue> iv = ConstValue(v);
  if (!iv || !iv->isBool()) return std::nullopt;
  return iv->toBool();
}

inline bool IsNone(const Value* v) { return v->type()->kind() == c10::TypeKind::NoneType; }

// An int or int list that is constant (a prim::Constant or a ListConstruct of constants).
inline std::optional<std::vector<int64_t>> ConstInts(const Value* v) {
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

// The input of `n` that its schema names `name`; nullptr when it has none.
inline const Value* NamedInput(const Node* n, const char* name) {
  const c10::FunctionSchema* schema = n->maybeSchema();
  if (schema == nullptr) return nullptr;
  const c10::optional<int> i = schema->argumentIndexWithName(name);
  if (!i || *i >= static_cast<int>(n->inputs().size())) return nullptr;
  return n->input(*i);
}

// Follows the batch through one graph: each rule looks at one op, checks its operands' flows and
// sets its outputs', and returns "" or why the op keeps the batch whole.
class Analysis {
 public:
  explicit Analysis(const BatchFlowInputs& in);
  BatchFlow Run();

 private:
  // --- the driver (batch_flow.cc) --------------------------------------------------------------
  static BatchFlow Fail(BatchFlow& result, std::string why);
  bool WritesModuleTensor(const Value* v) const;
  std::string SetAll(const Node* n, Kind k);
  std::string CheckFacts(const Value* v, Kind k) const;
  bool Aligned(const Value* in, const Value* out) const;
  std::optional<std::vector<int64_t>> Dims(const Node* n, const char* name, int rank,
                                           bool* unknown) const;
  std::string Visit(const Node* n);

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
  void Set(const Value* v, Kind k, int batch_element = -1, int64_t outer = 1) {
    flows_[v] = {k, batch_element, outer};
  }

  // --- which rule an op follows (batch_flow_ops.cc) --------------------------------------------
  std::string Dispatch(const Node* n, const OpName& name);

  // --- structure, elementwise ops, reductions, reshapes, indexing (batch_flow_rules.cc) --------
  std::string ListConstruct(const Node* n);
  std::optional<std::vector<Flow>> Elements(const Value* list, size_t count) const;
  std::string Unpack(const Node* n);
  std::string GetItem(const Node* n);
  std::string ScalarRead(const Node* n);
  std::string Size(const Node* n);
  std::string Elementwise(const Node* n, const OpName& name);
  std::string Linear(const Node* n, const std::string& op,
                     const std::vector<const Value*>& reduced);
  std::string Reduce(const Node* n, Kind kind);
  std::string DimOnly(const Node* n, const char* arg);
  std::string BatchedOutputs(const Node* n);
  std::string FullReduction(const Node* n);
  std::string TailOnly(const Node* n, int tail);
  std::string Squeeze(const Node* n);
  std::string Slice(const Node* n);
  std::string Reshape(const Node* n);
  std::string InterleavedUse(const Node* n, const OpName& name);
  std::string Rearrange(const Node* n);
  std::string Expand(const Node* n);
  std::string Repeat(const Node* n);
  std::string Factory(const Node* n);
  std::string SampleNumbers(const Node* n);
  std::string SampleIndexUse(const Node* n, const OpName& name);
  std::string Concat(const Node* n, const std::string& op);
  std::string BroadcastTensors(const Node* n);
  std::string IndexSelect(const Node* n);
  std::string Indexed(const Node* n, const OpName& name);
  std::string Index(const Node* n, const OpName& name);
  std::string Diagonal(const Node* n);
  std::string Pad(const Node* n);

  // --- layers (batch_flow_layers.cc) -----------------------------------------------------------
  std::string LeadingBatch(const Node* n, std::vector<int> batched_args,
                           std::vector<int> free_args);
  std::string LinearLayer(const Node* n, std::vector<int> free);
  std::string Matmul(const Node* n);
  std::string Bmm(const Node* n, int ai, int bi);
  std::string Addmm(const Node* n);
  std::string Baddbmm(const Node* n);
  std::string Einsum(const Node* n);
  std::string Attention(const Node* n);
  std::string Embedding(const Node* n);
  std::string BatchNorm(const Node* n);
  std::string InstanceNorm(const Node* n);
  std::string LayerNorm(const Node* n);
  std::string Cdist(const Node* n);
  std::string Outer(const Node* n);
  std::string Loss(const Node* n, const std::string& op);
  std::string Rnn(const Node* n);

  const BatchFlowInputs& in_;
  std::unordered_map<const Value*, Flow> flows_;
  std::string state_write_;  // the first op that writes a module tensor, described
  std::unordered_set<const Value*> split_lists_;
  // Sizes that are exactly the number of samples (x.size(0) of a tensor with a row per sample).
  std::unordered_set<const Value*> sample_counts_;
  std::unordered_set<const Node*> rewritten_, means_;
};

}  // namespace batch_flow_internal
}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_BATCH_FLOW_ANALYSIS_H_
