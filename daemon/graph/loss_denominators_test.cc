#include "daemon/graph/loss_denominators.h"

#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir.h"
#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

// Runs the IR's whole graph on `user` inputs (client's, then step inputs) and `tensors`.
at::Tensor Loss(const IrGraph& ir, const std::vector<at::Tensor>& user,
                const std::vector<at::Tensor>& tensors) {
  torch::jit::Stack stack(user.begin(), user.end());
  stack.insert(stack.end(), tensors.begin(), tensors.end());
  torch::jit::Code code(ir.graph, "test");
  torch::jit::InterpreterState(code).run(stack);
  return stack.at(0).toTensor();
}

std::vector<at::Tensor> Rows(const std::vector<at::Tensor>& user, size_t clients, int64_t from,
                             int64_t count) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < user.size(); ++i) {
    out.push_back(i < clients ? user[i].narrow(0, from, count) : user[i]);
  }
  return out;
}

TEST_CASE("A mean over counted targets gives PyTorch's value under any split of the batch",
          "[graph]") {
  // padded_lm: cross_entropy(weight=class weights, ignore_index=0) on shifted targets; its
  // samples ignore different numbers of targets.
  FixtureIr f = BuildFixtureIr("padded_lm");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  REQUIRE(ir.loss_rewrite->denominators.size() == 1);
  CHECK(ir.loss_rewrite->refused.empty());
  CHECK(ir.loss_rewrite->denominators[0].ignore_index == 0);
  CHECK(ir.loss_rewrite->denominators[0].weight_lifted >= 0);
  REQUIRE(f.user_inputs.size() == 3);

  // The step input: the class weights of the counted targets over their number.
  const at::Tensor targets = f.fixture.inputs[1].narrow(1, 1, 5).reshape(-1);
  const at::Tensor weights = at::linspace(0.5, 1.5, 9, at::kDouble);
  const at::Tensor counted = targets.ne(0);
  const double d = (weights.index_select(0, targets) * counted).sum().item<double>();
  CHECK(f.user_inputs[2].item<double>() == Approx(d / targets.numel()).epsilon(1e-12));

  // Unsplit: PyTorch's float result, to the bit.
  const at::Tensor whole = Loss(ir, f.user_inputs, f.tensors);
  CHECK(at::equal(whole, f.fixture.ref.at("out_0")));

  // Shards weighted by their samples (the runtime's mean) add up to the whole batch's mean,
  // however they split it, though their counts differ.
  for (const std::vector<int64_t>& split :
       std::vector<std::vector<int64_t>>{{1, 3}, {2, 2}, {3, 1}, {1, 1, 1, 1}}) {
    INFO("split " << split.size());
    at::Tensor combined = at::zeros({}, at::kDouble);
    int64_t from = 0;
    for (int64_t n : split) {
      const at::Tensor part = Loss(ir, Rows(f.user_inputs, 2, from, n), f.tensors);
      CHECK(std::isfinite(part.item<double>()));
      combined += part.to(at::kDouble) * (static_cast<double>(n) / 4);
      from += n;
    }
    CHECK(combined.item<double>() == Approx(whole.item<double>()).epsilon(1e-6));
  }
}

TEST_CASE("A shard whose targets are all ignored adds nothing", "[graph]") {
  FixtureIr f = BuildFixtureIr("padded_lm");
  REQUIRE(f.ir.ok());
  std::vector<at::Tensor> user = f.user_inputs;
  user[1] = user[1].clone();
  user[1][2].fill_(0);  // sample 2 ignores every target
  absl::StatusOr<std::vector<at::Tensor>> step =
      DenominatorInputs(*f.ir->loss_rewrite, {user[0], user[1]},
                        [&](int i) { return f.tensors[i]; });
  REQUIRE(step.ok());
  user[2] = (*step)[0];
  const at::Tensor part = Loss(*f.ir, Rows(user, 2, 2, 1), f.tensors);
  CHECK(part.item<double>() == 0.0);
}

TEST_CASE("RewriteMeanLosses leaves losses it cannot count, and says why", "[graph]") {
  // The targets come from a module tensor (a label map): a shard cannot count them alone.
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(R"IR(
graph(%x : Float(4, 3), %y : Long(4), %map : Long(3)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %ignore : int = prim::Constant[value=-100]()
  %smooth : float = prim::Constant[value=0.]()
  %zero : int = prim::Constant[value=0]()
  %t : Tensor = aten::index_select(%map, %zero, %y)
  %loss : Tensor = aten::cross_entropy_loss(%x, %t, %none, %one, %ignore, %smooth)
  return (%loss)
)IR",
                      graph.get());
  absl::StatusOr<LossRewrite> r = RewriteMeanLosses(*graph, 2);
  REQUIRE(r.ok());
  CHECK(r->denominators.empty());
  REQUIRE(r->refused.size() == 1);
  CHECK_THAT(r->refused.begin()->second, Catch::Contains("parameters or buffers"));
  CHECK(graph->inputs().size() == 3);

  // Sums and losses of no batch are left alone; a mean of the batch gets one step input.
  graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(R"IR(
graph(%x : Float(4, 3), %y : Long(4)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %ignore : int = prim::Constant[value=-100]()
  %s : Tensor = aten::nll_loss(%x, %y, %none, %two, %ignore)
  %m : Tensor = aten::nll_loss(%x, %y, %none, %one, %ignore)
  return (%s, %m)
)IR",
                      graph.get());
  r = RewriteMeanLosses(*graph, 2);
  REQUIRE(r.ok());
  CHECK(r->denominators.size() == 1);
  CHECK(graph->inputs().size() == 3);
  CHECK(graph->inputs()[2]->debugName() == "loss_denominator_0");
}

}  // namespace
}  // namespace rannc
