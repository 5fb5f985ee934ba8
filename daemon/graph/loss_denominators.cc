#include "daemon/graph/loss_denominators.h"

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"

namespace rannc {

bool IsCountedMeanLoss(const torch::jit::Node* n) {
  const std::string kind = n->kind().toQualString();
  return kind == "aten::nll_loss" || kind == "aten::nll_loss2d" || kind == "aten::nll_loss_nd" ||
         kind == "aten::cross_entropy_loss";
}

namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

constexpr int64_t kReductionMean = 1;
constexpr int64_t kReductionSum = 2;

// The ops `target` is computed by, in graph order, when they read only the client's inputs and
// constants; otherwise why not.
absl::StatusOr<std::vector<Node*>> TargetSlice(Graph& graph, Value* target,
                                               size_t num_client_inputs) {
  std::unordered_set<Node*> members;
  std::vector<Value*> work = {target};
  while (!work.empty()) {
    Value* v = work.back();
    work.pop_back();
    Node* p = v->node();
    if (p->kind() == c10::prim::Param) {
      if (v->offset() >= num_client_inputs) {
        return absl::InvalidArgumentError(
            "its targets are computed from the model's parameters or buffers");
      }
      continue;
    }
    if (!p->blocks().empty()) {
      return absl::InvalidArgumentError("its targets are computed under control flow");
    }
    if (p->hasSideEffects() || p->kind() == c10::prim::Uninitialized) {
      return absl::InvalidArgumentError("its targets are computed by an op with side effects");
    }
    if (!members.insert(p).second) continue;
    for (Value* in : p->inputs()) work.push_back(in);
  }
  std::vector<Node*> ordered;
  for (Node* n : graph.nodes()) {
    if (members.count(n)) ordered.push_back(n);
  }
  return ordered;
}

// Values computed from the client's inputs at all.
std::unordered_set<const Value*> FromClientInputs(Graph& graph, size_t num_client_inputs) {
  std::unordered_set<const Value*> reached;
  for (size_t i = 0; i < num_client_inputs; ++i) reached.insert(graph.inputs()[i]);
  std::function<bool(torch::jit::Block*)> reads = [&](torch::jit::Block* b) {
    for (Node* n : b->nodes()) {
      for (Value* in : n->inputs()) {
        if (reached.count(in)) return true;
      }
      for (torch::jit::Block* inner : n->blocks()) {
        if (reads(inner)) return true;
      }
    }
    return false;
  };
  for (Node* n : graph.nodes()) {
    bool hit = false;
    for (Value* in : n->inputs()) hit = hit || reached.count(in) > 0;
    for (torch::jit::Block* b : n->blocks()) hit = hit || reads(b);
    if (hit) {
      for (Value* o : n->outputs()) reached.insert(o);
    }
  }
  return reached;
}

}  // namespace

absl::StatusOr<LossRewrite> RewriteMeanLosses(Graph& graph, size_t num_client_inputs) {
  LossRewrite rewrite;
  rewrite.num_client_inputs = num_client_inputs;
  absl::Status status = TorchCall(absl::StatusCode::kInternal, "rewriting mean losses", [&] {
    const std::unordered_set<const Value*> batch = FromClientInputs(graph, num_client_inputs);
    struct Candidate {
      Node* loss;
      std::vector<Node*> slice;
      LossDenominator d;
    };
    std::vector<Candidate> chosen;
    for (Node* n : graph.nodes()) {
      if (!IsCountedMeanLoss(n) || n->inputs().size() < 5 || !batch.count(n->input(0))) continue;
      const c10::optional<int64_t> reduction = torch::jit::constant_as<int64_t>(n->input(3));
      if (reduction && *reduction != kReductionMean) continue;
      auto refuse = [&](std::string why) { rewrite.refused[n] = std::move(why); };
      if (!reduction) {
        refuse("its reduction is not a constant");
        continue;
      }
      // Class probabilities as targets (cross_entropy only) make a plain mean over the samples;
      // a loaded graph rarely records the targets' dtype, so they are rewritten too and
      // DenominatorInputs tells them apart.
      Candidate c;
      c.loss = n;
      const c10::optional<int64_t> ignore = torch::jit::constant_as<int64_t>(n->input(4));
      if (!ignore) {
        refuse("its ignore_index is not a constant");
        continue;
      }
      c.d.ignore_index = *ignore;
      Value* weight = n->input(2);
      if (weight->node()->kind() == c10::prim::Constant) {
        c10::optional<c10::IValue> w = torch::jit::toIValue(weight);
        if (w && w->isTensor()) c.d.weight_constant = w->toTensor();
      } else if (weight->node()->kind() == c10::prim::Param &&
                 weight->offset() >= num_client_inputs) {
        c.d.weight_lifted = static_cast<int>(weight->offset() - num_client_inputs);
      } else {
        refuse("its class weights are computed in the model");
        continue;
      }
      absl::StatusOr<std::vector<Node*>> slice =
          TargetSlice(graph, n->input(1), num_client_inputs);
      if (!slice.ok()) {
        refuse(std::string(slice.status().message()));
        continue;
      }
      c.slice = std::move(*slice);
      chosen.push_back(std::move(c));
    }
    if (chosen.empty()) return absl::OkStatus();

    // The targets graph: client inputs -> every chosen loss's targets.
    rewrite.targets = std::make_shared<Graph>();
    std::unordered_map<const Value*, Value*> env;
    for (size_t i = 0; i < num_client_inputs; ++i) {
      env[graph.inputs()[i]] =
          rewrite.targets->addInput()->setType(graph.inputs()[i]->type());
    }
    for (const Candidate& c : chosen) {
      for (Node* n : c.slice) {
        if (env.count(n->output(0))) continue;  // shared with an earlier loss's targets
        Node* clone = rewrite.targets->insertNode(
            rewrite.targets->createClone(n, [&](Value* v) { return env.at(v); }));
        for (size_t o = 0; o < n->outputs().size(); ++o) env[n->output(o)] = clone->output(o);
      }
      rewrite.targets->registerOutput(env.at(c.loss->input(1)));
    }

    for (size_t k = 0; k < chosen.size(); ++k) {
      Candidate& c = chosen[k];
      Node* loss = c.loss;
      Value* step =
          graph.insertInput(num_client_inputs + k, absl::StrCat("loss_denominator_", k))
              ->setType(c10::TensorType::createContiguous(at::kDouble, at::kCPU, {}));
      Value* sum;
      {
        torch::jit::WithInsertPoint before(loss);
        sum = graph.insertConstant(kReductionSum);
      }
      loss->replaceInput(3, sum);
      Value* loss_value = loss->output();
      torch::jit::WithInsertPoint after(loss->next());
      Value* as_double = graph.insertConstant(static_cast<int64_t>(at::kDouble));
      Value* no = graph.insertConstant(false);
      Value* none = graph.insertConstant(c10::IValue());
      auto add = [&](c10::Symbol kind, std::vector<Value*> inputs, c10::TypePtr type) {
        Node* n = graph.insertNode(graph.create(kind, inputs));
        n->output()->setType(std::move(type));
        return n;
      };
      const c10::TypePtr as_double_type = c10::TensorType::get()->withScalarType(at::kDouble);
      Node* to = add(c10::aten::to, {loss_value, as_double, no, no, none}, as_double_type);
      const c10::Symbol numel = c10::Symbol::fromQualString("aten::numel");
      const c10::Symbol type_as = c10::Symbol::fromQualString("aten::type_as");
      Node* count = add(numel, {loss->input(1)}, c10::IntType::get());
      Node* denom = add(c10::aten::mul, {step, count->output()}, as_double_type);
      Node* quotient = add(c10::aten::div, {to->output(), denom->output()}, as_double_type);
      Node* mean = add(type_as, {quotient->output(), loss_value}, loss_value->type());
      loss_value->replaceAllUsesAfterNodeWith(mean, mean->output());
      c.d.loss = loss;
      c.d.mean = mean;
      c.d.added = {to, count, denom, quotient, mean};
      for (Node* n : {to, count, denom, quotient, mean}) {
        if (!n->maybeOperator()) {
          return absl::InternalError(absl::StrCat("no operator for ", n->kind().toQualString()));
        }
      }
      rewrite.denominators.push_back(c.d);
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return rewrite;
}

absl::StatusOr<std::vector<at::Tensor>> DenominatorInputs(
    const LossRewrite& rewrite, const std::vector<at::Tensor>& client_inputs,
    const LiftedTensor& lifted) {
  std::vector<at::Tensor> out;
  if (rewrite.denominators.empty()) return out;
  if (client_inputs.size() != rewrite.num_client_inputs) {
    return absl::InternalError(absl::StrCat("loss denominators: ", client_inputs.size(),
                                            " inputs for ", rewrite.num_client_inputs));
  }
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument,
                                  "computing the loss's target counts", [&] {
    at::NoGradGuard no_grad;
    torch::jit::Stack stack(client_inputs.begin(), client_inputs.end());
    torch::jit::Code code(rewrite.targets, "loss_targets");
    torch::jit::InterpreterState(code).run(stack);
    for (size_t k = 0; k < rewrite.denominators.size(); ++k) {
      const LossDenominator& d = rewrite.denominators[k];
      const at::Tensor target = stack.at(k).toTensor();
      if (at::isFloatingType(target.scalar_type())) {
        // Class probabilities: the mean over every position but the class dimension (1).
        const int64_t classes = target.dim() > 1 ? target.size(1) : 1;
        out.push_back(at::scalar_tensor(1.0 / static_cast<double>(classes), at::kDouble));
        continue;
      }
      const at::Tensor targets = target.cpu().reshape({-1});
      const at::Tensor valid = targets.ne(d.ignore_index);
      at::Tensor weight;
      if (d.weight_constant) weight = *d.weight_constant;
      if (d.weight_lifted >= 0 && lifted) weight = lifted(d.weight_lifted);
      at::Tensor total;
      if (weight.defined()) {
        weight = weight.detach().cpu().to(at::kDouble);
        // Ignored targets may be out of range (-100): any class will do, they weigh 0.
        const at::Tensor classes = targets.masked_fill(valid.logical_not(), 0);
        total = (weight.index_select(0, classes) * valid).sum();
      } else {
        total = valid.sum().to(at::kDouble);
      }
      const int64_t n = targets.numel();
      out.push_back(n > 0 ? total / static_cast<double>(n) : at::zeros({}, at::kDouble));
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return out;
}

}  // namespace rannc
