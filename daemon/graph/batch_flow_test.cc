#include "daemon/graph/batch_flow.h"

#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir.h"
#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

// The IR of a graph written in TorchScript IR: its first `inputs.size()` inputs are the
// client's, the rest module tensors (`tensors`, named t0, t1, ...).
absl::StatusOr<IrGraph> IrOf(const std::string& text, std::vector<at::Tensor> inputs,
                             std::vector<at::Tensor> tensors = {}) {
  ImportedModel model;
  model.graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(text, model.graph.get());
  for (size_t i = 0; i < inputs.size(); ++i) model.input_names.push_back("in" + std::to_string(i));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "t" + std::to_string(i);
    model.graph_tensor_names.push_back(name);
    model.tensors.push_back({name, tensors[i], true});
  }
  return BuildIr(model, tensors, inputs);
}

at::Tensor Randn(std::vector<int64_t> shape) {
  static at::Generator g = at::make_generator<at::CPUGeneratorImpl>(3);
  return at::randn(shape, g);
}

void CheckSeparable(const std::string& text, std::vector<at::Tensor> inputs,
                    std::vector<at::Tensor> tensors = {}) {
  absl::StatusOr<IrGraph> ir = IrOf(text, inputs, tensors);
  INFO(ir.status().message());
  REQUIRE(ir.ok());
  INFO(ir->not_separable);
  CHECK(ir->batch_separable);
}

void CheckWhole(const std::string& text, const std::string& why, std::vector<at::Tensor> inputs,
                std::vector<at::Tensor> tensors = {}) {
  absl::StatusOr<IrGraph> ir = IrOf(text, inputs, tensors);
  INFO(ir.status().message());
  REQUIRE(ir.ok());
  CHECK_FALSE(ir->batch_separable);
  CHECK_THAT(ir->not_separable, Catch::Contains(why));
}

IrValue::Reduction OutputReduction(const IrGraph& ir, size_t i) {
  return ir.values[ir.outputs[i]].reduction;
}

TEST_CASE("AnalyzeBatchFlow lets per-sample layers and mean losses split", "[graph]") {
  absl::StatusOr<IrGraph> ir = IrOf(R"IR(
graph(%x : Float(4, 6), %y : Long(4), %w : Float(5, 6), %b : Float(5)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %ignore : int = prim::Constant[value=-100]()
  %smooth : float = prim::Constant[value=0.]()
  %h : Tensor = aten::linear(%x, %w, %b)
  %r : Tensor = aten::relu(%h)
  %loss : Tensor = aten::cross_entropy_loss(%r, %y, %none, %one, %ignore, %smooth)
  return (%loss)
)IR",
                                    {Randn({4, 6}), at::randint(0, 5, {4})},
                                    {Randn({5, 6}), Randn({5})});
  REQUIRE(ir.ok());
  CHECK(ir->batch_separable);
  CHECK(OutputReduction(*ir, 0) == IrValue::Reduction::kMean);
  // The cross entropy over counted targets was rewritten: one step input, its denominator.
  CHECK(ir->num_client_inputs == 2);
  CHECK(ir->num_user_inputs == 3);
}

TEST_CASE("AnalyzeBatchFlow keeps the batch of a batch norm in training mode whole",
          "[graph]") {
  const std::string bn = R"IR(
graph(%x : Float(4, 3, 5, 5), %w : Float(3), %b : Float(3), %m : Float(3), %v : Float(3)):
  %training : bool = prim::Constant[value=TRAINING]()
  %momentum : float = prim::Constant[value=0.1]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %cudnn : bool = prim::Constant[value=1]()
  %y : Tensor = aten::batch_norm(%x, %w, %b, %m, %v, %training, %momentum, %eps, %cudnn)
  return (%y)
)IR";
  auto with = [&](const char* training) {
    std::string text = bn;
    text.replace(text.find("TRAINING"), 8, training);
    return text;
  };
  std::vector<at::Tensor> tensors = {at::ones({3}), at::zeros({3}), at::zeros({3}), at::ones({3})};
  CheckWhole(with("1"), "normalizes over the batch", {Randn({4, 3, 5, 5})}, tensors);
  CheckSeparable(with("0"), {Randn({4, 3, 5, 5})}, tensors);
}

TEST_CASE("AnalyzeBatchFlow refuses what mixes or reorders samples", "[graph]") {
  const std::vector<at::Tensor> x = {Randn({4, 6})};
  // A statistic of the batch subtracted from each sample.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %dims : int[] = prim::Constant[value=[0]]()
  %keep : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %m : Tensor = aten::mean(%x, %dims, %keep, %none)
  %y : Tensor = aten::sub(%x, %m, %one)
  return (%y)
)IR",
             "combines per-sample values with a value reduced over the batch", x);
  // A softmax across the samples.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %none : NoneType = prim::Constant()
  %y : Tensor = aten::softmax(%x, %zero, %none)
  return (%y)
)IR",
             "works along the batch dimension", x);
  // Samples mixed within rows by a transpose and a reshape.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %t : Tensor = aten::transpose(%x, %zero, %one)
  %shape : int[] = prim::Constant[value=[-1, 2]]()
  %y : Tensor = aten::reshape(%t, %shape)
  return (%y)
)IR",
             "a row of the batch dimension holds several samples' elements", x);
  // Only some of the samples.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %end : int = prim::Constant[value=9223372036854775807]()
  %y : Tensor = aten::slice(%x, %zero, %one, %end, %one)
  return (%y)
)IR",
             "takes only some of the samples", x);
  // squeeze() would drop the batch of a one-sample micro-batch.
  CheckWhole(R"IR(
graph(%x : Float(4, 1, 6)):
  %y : Tensor = aten::squeeze(%x)
  return (%y)
)IR",
             "squeezes every size-1 dimension", {Randn({4, 1, 6})});
  // An op the rules do not know.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %y : Tensor = aten::trace(%x)
  return (%y)
)IR",
             "aten::trace is not known to keep samples apart", x);
  // A counter in a buffer: a split batch would count once per shard.
  CheckWhole(R"IR(
graph(%x : Float(4, 6), %count : Long(1)):
  %one : int = prim::Constant[value=1]()
  %c : Tensor = aten::add_(%count, %one, %one)
  %y : Tensor = aten::relu(%x)
  return (%y)
)IR",
             "updates a parameter or buffer in forward", x, {at::zeros({1}, at::kLong)});
  // A tensor filled with the batch's size: each shard would see its own.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %six : int = prim::Constant[value=6]()
  %none : NoneType = prim::Constant()
  %b : int = aten::size(%x, %zero)
  %shape : int[] = prim::ListConstruct(%b, %six)
  %f : Tensor = aten::full(%shape, %b, %none, %none, %none, %none)
  %y : Tensor = aten::mul(%x, %f)
  return (%y)
)IR",
             "fills a tensor with values computed from the batch's size", x);
  // Reading a batch value into the host.
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %none : NoneType = prim::Constant()
  %s : Tensor = aten::sum(%x, %none)
  %f : float = aten::Float(%s)
  %y : Tensor = aten::mul(%x, %f)
  return (%y)
)IR",
             "reads values computed from the batch into a host number", x);
}

TEST_CASE("AnalyzeBatchFlow lets the samples' numbers pick each sample's own rows", "[graph]") {
  // Hugging Face's attention masks: arange(B)[:, None] with arange(L) picks mask[b, l] for every
  // sample b, which a shard's own numbers pick alike.
  const std::string gather = R"IR(
graph(%x : Float(4, 6), %m : Long(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %b : int = aten::size(%x, %zero)
  %l : int = aten::size(%x, %one)
  %bi : Tensor = aten::arange(%b, %none, %none, %none, %none)
  %bj : Tensor = aten::unsqueeze(%bi, %one)
  %li : Tensor = aten::arange(%l, %none, %none, %none, %none)
  %idx : Tensor?[] = prim::ListConstruct(%bj, %li)
  %g : Tensor = aten::index(%m, %idx)
  %f : Tensor = aten::to(%g, %DTYPE, %FALSE, %FALSE, %none)
  %y : Tensor = aten::mul(%x, %f)
  return (%y)
)IR";
  auto text = [&](const std::string& body) {
    std::string t = body;
    t.replace(t.find("%DTYPE"), 6, "%six");
    t.replace(t.find("%FALSE"), 6, "%false");
    t.replace(t.find("%FALSE"), 6, "%false");
    t.insert(t.find("  %b : int"), "  %six : int = prim::Constant[value=6]()\n"
                                      "  %false : bool = prim::Constant[value=0]()\n");
    return t;
  };
  const std::vector<at::Tensor> inputs = {Randn({4, 6}), at::randint(0, 2, {4, 6})};
  CheckSeparable(text(gather), inputs);

  // The numbers used as values, or to pick other rows than each sample's own, or a range that
  // does not start at 0: a shard's would differ.
  std::string as_values = text(gather);
  as_values.replace(as_values.find("aten::index(%m, %idx)"), 21, "aten::add(%bj, %li, %one)");
  CheckWhole(as_values, "computes with the samples' numbers", inputs);
  std::string other_tensor = text(gather);  // rows of a module tensor, by sample number
  other_tensor.replace(other_tensor.find("%m : Long(4, 6))"), 16,
                       "%m : Long(4, 6), %t : Float(4, 6))");
  other_tensor.replace(other_tensor.find("aten::index(%m, %idx)"), 21, "aten::index(%t, %idx)");
  CheckWhole(other_tensor, "other than to pick each sample's own row", inputs, {Randn({4, 6})});
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %b : int = aten::size(%x, %zero)
  %end : int = aten::add(%b, %one)
  %r : Tensor = aten::arange(%one, %end, %one, %none, %none, %none, %none)
  %c : Tensor = aten::unsqueeze(%r, %one)
  %y : Tensor = aten::mul(%x, %c)
  return (%y)
)IR",
             "numbers or orders the samples", {Randn({4, 6})});
}

TEST_CASE("AnalyzeBatchFlow follows reshapes, sizes and reductions that keep samples apart",
          "[graph]") {
  // x.view(B * T, C) of a [B, T, C] value, its size read from x.
  CheckSeparable(R"IR(
graph(%x : Float(4, 3, 6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %c : int = prim::Constant[value=6]()
  %b : int = aten::size(%x, %zero)
  %t : int = aten::size(%x, %one)
  %bt : int = aten::mul(%b, %t)
  %shape : int[] = prim::ListConstruct(%bt, %c)
  %y : Tensor = aten::view(%x, %shape)
  %dims : int[] = prim::Constant[value=[1]]()
  %keep : bool = prim::Constant[value=0]()
  %none : NoneType = prim::Constant()
  %s : Tensor = aten::sum(%y, %dims, %keep, %none)
  return (%s)
)IR",
                 {Randn({4, 3, 6})});
  // A sum over everything is a sum over the samples; a mean plus a batch-free value is a mean,
  // a sum plus a constant is not a sum.
  absl::StatusOr<IrGraph> ir = IrOf(R"IR(
graph(%x : Float(4, 6), %w : Float(6)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %s : Tensor = aten::sum(%x, %none)
  %m : Tensor = aten::mean(%x, %none)
  %reg : Tensor = aten::sum(%w, %none)
  %loss : Tensor = aten::add(%m, %reg, %one)
  return (%s, %loss)
)IR",
                                    {Randn({4, 6})}, {Randn({6})});
  REQUIRE(ir.ok());
  CHECK(ir->batch_separable);
  CHECK(OutputReduction(*ir, 0) == IrValue::Reduction::kSum);
  CHECK(OutputReduction(*ir, 1) == IrValue::Reduction::kMean);
  CheckWhole(R"IR(
graph(%x : Float(4, 6)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %s : Tensor = aten::sum(%x, %none)
  %loss : Tensor = aten::add(%s, %two, %one)
  return (%loss)
)IR",
             "adds a constant to a sum over the batch", {Randn({4, 6})});
  // kl_div(reduction='batchmean') divides a sum by x.size(0): a mean over the samples.
  ir = IrOf(R"IR(
graph(%x : Float(4, 6), %y : Float(4, 6)):
  %zero : int = prim::Constant[value=0]()
  %two : int = prim::Constant[value=2]()
  %no : bool = prim::Constant[value=0]()
  %kl : Tensor = aten::kl_div(%x, %y, %two, %no)
  %b : int = aten::size(%x, %zero)
  %bt : Tensor = prim::NumToTensor(%b)
  %loss : Tensor = aten::div(%kl, %bt)
  return (%loss)
)IR",
            {Randn({4, 6}), at::rand({4, 6})});
  REQUIRE(ir.ok());
  CHECK(ir->batch_separable);
  CHECK(OutputReduction(*ir, 0) == IrValue::Reduction::kMean);
}

TEST_CASE("BuildIr keeps a value reduced over the batch inside one atomic node", "[graph]") {
  // A sum over the batch, then per-sample work, then the sum used: a stage cut in between
  // would hand one shard's sum to shards of another split.
  absl::StatusOr<IrGraph> ir = IrOf(R"IR(
graph(%x : Float(4, 6), %w : Float(6, 6)):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %sq : Tensor = aten::mul(%x, %x)
  %s : Tensor = aten::sum(%sq, %none)
  %h : Tensor = aten::linear(%x, %w, %none)
  %r : Tensor = aten::relu(%h)
  %t : Tensor = aten::sum(%r, %none)
  %loss : Tensor = aten::add(%s, %t, %one)
  return (%loss)
)IR",
                                    {Randn({4, 6})}, {Randn({6, 6})});
  REQUIRE(ir.ok());
  CHECK(ir->batch_separable);
  CHECK(OutputReduction(*ir, 0) == IrValue::Reduction::kSum);
  for (const IrValue& v : ir->values) {
    if (v.role != ValueRole::kActivation || v.batch_dim >= 0 || v.producer < 0) continue;
    INFO(v.name);
    for (int c : v.consumers) CHECK(c == v.producer);
  }
  // The per-sample part before the sum may still be cut off.
  CHECK(ir->nodes.size() >= 2);
}

TEST_CASE("AnalyzeBatchFlow lets attention over the sequence split by samples", "[graph]") {
  CheckSeparable(R"IR(
graph(%q : Float(4, 2, 5, 3), %k : Float(4, 2, 5, 3)):
  %m2 : int = prim::Constant[value=-2]()
  %m1 : int = prim::Constant[value=-1]()
  %none : NoneType = prim::Constant()
  %kt : Tensor = aten::transpose(%k, %m2, %m1)
  %a : Tensor = aten::matmul(%q, %kt)
  %p : Tensor = aten::softmax(%a, %m1, %none)
  %o : Tensor = aten::matmul(%p, %q)
  return (%o)
)IR",
                 {Randn({4, 2, 5, 3}), Randn({4, 2, 5, 3})});
  // x.T @ x sums over the samples.
  CheckWhole(R"IR(
graph(%x : Float(4, 3)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %xt : Tensor = aten::transpose(%x, %zero, %one)
  %g : Tensor = aten::matmul(%xt, %x)
  return (%g)
)IR",
             "across the batch", {Randn({4, 3})});
}

// nn.MultiheadAttention's output projection: (batch, length, embed) made (length * batch, embed)
// rows, projected, and made (length, batch, embed) again.
constexpr char kInterleavedProjection[] = R"IR(
graph(%x : Float(4, 3, 6), %w : Float(6, 6), %b : Float(6)):
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %format : int = prim::Constant[value=0]()
  %rows : int[] = prim::Constant[value=[-1, 6]]()
  %t : Tensor = aten::transpose(%x, %zero, %one)
  %c : Tensor = aten::contiguous(%t, %format)
  %r : Tensor = aten::view(%c, %rows)
  %p : Tensor = aten::linear(%r, %w, %b)
  %BODY
)IR";

std::string Projection(const std::string& body) {
  std::string text = kInterleavedProjection;
  return text.replace(text.find("%BODY"), 5, body);
}

TEST_CASE("AnalyzeBatchFlow follows rows of length * batch through a projection", "[graph]") {
  const std::vector<at::Tensor> x = {Randn({4, 3, 6})};
  const std::vector<at::Tensor> w = {Randn({6, 6}), Randn({6})};
  {
    absl::StatusOr<IrGraph> ir = IrOf(Projection(R"IR(%s : int = aten::size(%p, %one)
  %three : int = prim::Constant[value=3]()
  %m1 : int = prim::Constant[value=-1]()
  %exact : str = prim::Constant[value="none"]()
  %shape : int[] = prim::ListConstruct(%three, %m1, %s)
  %g : Tensor = aten::gelu(%p, %exact)
  %v : Tensor = aten::view(%g, %shape)
  %y : Tensor = aten::transpose(%v, %zero, %one)
  return (%y))IR"), x, w);
    INFO(ir.status().message());
    REQUIRE(ir.ok());
    INFO(ir->not_separable);
    CHECK(ir->batch_separable);
    // The (12, 6) rows are 3 blocks of the 4 samples' rows: a stage may not cut them.
    int interleaved = 0;
    for (const IrValue& v : ir->values) {
      if (v.interleave == 1) continue;
      ++interleaved;
      CHECK(v.interleave == 3);
      CHECK(v.shape == std::vector<int64_t>{12, 6});
    }
    CHECK(interleaved == 3);  // the view, the projection, the gelu
  }
  // Returned as they are: a shard's rows would not be its samples'.
  CheckWhole(Projection("return (%p)"), "interleaves the samples' rows", x, w);
  // A softmax across the rows mixes the samples.
  CheckWhole(Projection(R"IR(%none : NoneType = prim::Constant()
  %y : Tensor = aten::softmax(%p, %zero, %none)
  return (%y))IR"), "follow only through reshapes, linear and elementwise ops", x, w);
  // A bias over every row: each row's own.
  CheckWhole(Projection(R"IR(%y : Tensor = aten::add(%p, %p, %one)
  return (%y))IR"), "combines a value whose samples interleave", x, w);
  // Split into (length, batch) the wrong way round.
  CheckWhole(Projection(R"IR(%wrong : int[] = prim::Constant[value=[-1, 3, 6]]()
  %y : Tensor = aten::view(%p, %wrong)
  return (%y))IR"), "holds several samples' elements", x, w);
}

TEST_CASE("AnalyzeBatchFlow says which module keeps the batch whole", "[graph]") {
  // BatchNorm behind a dropout (p=0) and an in-place hardswish: MobileNetV3's pattern, which the
  // sample-apart run could not check (random ops) and so once let through.
  FixtureIr f = BuildFixtureIr("bn_dropout_net");
  REQUIRE(f.ir.ok());
  CHECK_FALSE(f.ir->batch_separable);
  CHECK_THAT(f.ir->not_separable, Catch::Contains("aten::batch_norm"));
  CHECK_THAT(f.ir->not_separable, Catch::Contains("features.1 (BatchNorm2d)"));
  CHECK_THAT(f.ir->not_separable, Catch::Contains("normalizes over the batch"));
  FixtureIr bn = BuildFixtureIr("bn_net");
  REQUIRE(bn.ir.ok());
  CHECK_THAT(bn.ir->not_separable, Catch::Contains("bn (BatchNorm2d)"));
}

TEST_CASE("AnalyzeBatchFlow splits every fixture model that keeps samples apart", "[graph]") {
  for (const char* name :
       {"mlp", "tied_lm", "multi_io", "tiny_gpt", "deep_gpt", "dropout_net", "padded_lm"}) {
    INFO(name);
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    INFO(f.ir->not_separable);
    CHECK(f.ir->batch_separable);
  }
}

}  // namespace
}  // namespace rannc
