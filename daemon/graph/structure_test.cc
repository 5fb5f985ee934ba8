#include "daemon/graph/structure.h"

#include <memory>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"
#include "daemon/graph/subgraph.h"

namespace rannc {
namespace {

std::string Text(const std::string& ir) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  return CanonicalGraphText(*graph);
}

TEST_CASE("CanonicalGraphText ignores names and nothing else", "[graph]") {
  const std::string base = Text(R"IR(
graph(%x : Tensor, %w : Tensor):
  %a : int = prim::Constant[value=1]()
  %y : Tensor = aten::matmul(%x, %w)
  %z : Tensor = aten::add(%y, %x, %a)
  return (%z))IR");
  // Other names for the same values.
  CHECK(Text(R"IR(
graph(%input.7 : Tensor, %blocks.3.weight : Tensor):
  %c1 : int = prim::Constant[value=1]()
  %h : Tensor = aten::matmul(%input.7, %blocks.3.weight)
  %out.2 : Tensor = aten::add(%h, %input.7, %c1)
  return (%out.2))IR") == base);
  // Another constant, op, wiring or output each make a different graph.
  CHECK(Text(R"IR(
graph(%x : Tensor, %w : Tensor):
  %a : int = prim::Constant[value=2]()
  %y : Tensor = aten::matmul(%x, %w)
  %z : Tensor = aten::add(%y, %x, %a)
  return (%z))IR") != base);
  CHECK(Text(R"IR(
graph(%x : Tensor, %w : Tensor):
  %a : int = prim::Constant[value=1]()
  %y : Tensor = aten::matmul(%x, %w)
  %z : Tensor = aten::sub(%y, %x, %a)
  return (%z))IR") != base);
  CHECK(Text(R"IR(
graph(%x : Tensor, %w : Tensor):
  %a : int = prim::Constant[value=1]()
  %y : Tensor = aten::matmul(%w, %x)
  %z : Tensor = aten::add(%y, %x, %a)
  return (%z))IR") != base);
  CHECK(Text(R"IR(
graph(%x : Tensor, %w : Tensor):
  %a : int = prim::Constant[value=1]()
  %y : Tensor = aten::matmul(%x, %w)
  %z : Tensor = aten::add(%y, %x, %a)
  return (%y, %z))IR") != base);
  // Constant tensors count by content, not only shape.
  auto with_constant = [](float value) {
    auto graph = std::make_shared<torch::jit::Graph>();
    torch::jit::Value* x = graph->addInput("x");
    torch::jit::Value* c = graph->insertConstant(at::full({2}, value));
    graph->registerOutput(graph->insert(c10::aten::mul, {x, c}));
    return CanonicalGraphText(*graph);
  };
  CHECK(with_constant(1.5f) == with_constant(1.5f));
  CHECK(with_constant(1.5f) != with_constant(2.5f));
}

TEST_CASE("The layers of a transformer have one structure, its other parts others", "[graph]") {
  testing::FixtureIr f = testing::BuildFixtureIr("deep_gpt");
  REQUIRE(f.ir.ok());
  const int n = static_cast<int>(f.ir->nodes.size());
  std::vector<std::string> texts;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(*f.ir, i, i + 1);
    REQUIRE(sub.ok());
    texts.push_back(CanonicalGraphText(*sub->graph));
  }
  // The layer's period: the smallest p with texts[i] == texts[i + p] over a long stretch.
  int period = 0;
  for (int p = 1; p < n / 2 && period == 0; ++p) {
    int run = 0;
    for (int i = 0; i + p < n; ++i) {
      run = texts[i] == texts[i + p] ? run + 1 : 0;
      if (run >= 4 * p) period = p;
    }
  }
  REQUIRE(period > 5);
  // Six layers: five repeats of the period, back to back, and the whole stack does not repeat
  // into the head.
  int longest = 0, run = 0;
  for (int i = 0; i + period < n; ++i) {
    run = texts[i] == texts[i + period] ? run + 1 : 0;
    longest = std::max(longest, run);
  }
  CHECK(longest >= 5 * period - 1);
  CHECK(longest < 6 * period);
}

TEST_CASE("DescribeRuntimeValue tells apart what changes a run", "[graph]") {
  const at::Tensor a = at::zeros({2, 3});
  CHECK(DescribeRuntimeValue(a) == DescribeRuntimeValue(at::ones({2, 3})));  // not contents
  CHECK(DescribeRuntimeValue(a) != DescribeRuntimeValue(at::zeros({3, 2})));
  CHECK(DescribeRuntimeValue(a) != DescribeRuntimeValue(at::zeros({2, 3}, at::kDouble)));
  CHECK(DescribeRuntimeValue(a) != DescribeRuntimeValue(at::zeros({3, 2}).t()));  // strides
  CHECK(DescribeRuntimeValue(a) != DescribeRuntimeValue(at::zeros({2, 3}).requires_grad_()));
  CHECK(DescribeRuntimeValue(c10::IValue(int64_t{3})) != DescribeRuntimeValue(c10::IValue(int64_t{4})));
}

}  // namespace
}  // namespace rannc
