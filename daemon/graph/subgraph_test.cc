#include "daemon/graph/subgraph.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

const char* kModels[] = {"mlp", "tied_lm", "bn_net", "multi_io", "tiny_gpt"};

TEST_CASE("Every two-way split of every model matches the whole model", "[graph]") {
  for (const char* name : kModels) {
    INFO(name);
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const int n = static_cast<int>(f.ir->nodes.size());
    for (int cut = 1; cut < n; ++cut) {
      INFO("cut before node " << cut);
      absl::Status s = VerifySplit(*f.ir, {0, cut}, f.tensors, f.fixture.inputs);
      CHECK(s.ok());
      if (!s.ok()) WARN(s.message());
    }
  }
}

TEST_CASE("Splitting a model into one stage per atomic node matches the whole model", "[graph]") {
  for (const char* name : kModels) {
    INFO(name);
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    std::vector<int> starts;
    for (size_t i = 0; i < f.ir->nodes.size(); ++i) starts.push_back(static_cast<int>(i));
    absl::Status s = VerifySplit(*f.ir, starts, f.tensors, f.fixture.inputs);
    CHECK(s.ok());
    if (!s.ok()) WARN(s.message());
  }
}

TEST_CASE("A stage graph has explicit inputs and outputs", "[graph]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  absl::StatusOr<Subgraph> first = BuildSubgraph(*f.ir, 0, 1);
  REQUIRE(first.ok());
  // x, fc1.weight, fc1.bias -> fc1's output.
  CHECK(first->graph->inputs().size() == first->inputs.size());
  CHECK(first->outputs.size() == 1);
  CHECK(f.ir->values[first->outputs[0]].shape == std::vector<int64_t>{5, 8});
  // The last stage reads the targets straight from the client's inputs.
  absl::StatusOr<Subgraph> last =
      BuildSubgraph(*f.ir, static_cast<int>(f.ir->nodes.size()) - 1, f.ir->nodes.size());
  REQUIRE(last.ok());
  bool reads_targets = false;
  for (int v : last->inputs) reads_targets = reads_targets || v == f.ir->inputs[1];
  CHECK(reads_targets);
  CHECK_FALSE(BuildSubgraph(*f.ir, 1, 1).ok());
  CHECK_FALSE(BuildSubgraph(*f.ir, 0, 99).ok());
}

TEST_CASE("Any convex set of nodes becomes a stage; a set that is not convex is refused",
          "[graph]") {
  FixtureIr f = BuildFixtureIr("multi_io");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  // The branch computed from input `b` alone (sigmoid(b @ w) * 0.5) against everything else:
  // two convex sets, which interleave in graph order.
  std::vector<bool> from_a(ir.nodes.size(), false);
  std::vector<int> branch_b, rest;
  for (size_t i = 0; i < ir.nodes.size(); ++i) {
    for (int v : ir.nodes[i].inputs) {
      const int p = ir.values[v].producer;
      from_a[i] = from_a[i] || v == ir.inputs[0] || (p >= 0 && from_a[p]);
    }
    (from_a[i] ? rest : branch_b).push_back(static_cast<int>(i));
  }
  REQUIRE_FALSE(branch_b.empty());
  REQUIRE_FALSE(rest.empty());
  absl::Status s = VerifyPartition(ir, {branch_b, rest}, f.tensors, f.fixture.inputs);
  CHECK(s.ok());
  if (!s.ok()) WARN(s.message());
  // The other order cannot run: `rest` reads the branch's result.
  CHECK(VerifyPartition(ir, {rest, branch_b}, f.tensors, f.fixture.inputs).code() ==
        absl::StatusCode::kInternal);
  // A node listed twice, or missing, is not a partition.
  CHECK(VerifyPartition(ir, {branch_b, branch_b}, f.tensors, f.fixture.inputs).code() ==
        absl::StatusCode::kInvalidArgument);

  // fc1 -> relu -> fc2: {fc1, fc2} without the relu between them is not convex.
  FixtureIr mlp = BuildFixtureIr("mlp");
  REQUIRE(mlp.ir.ok());
  REQUIRE(mlp.ir->nodes.size() >= 3);
  absl::StatusOr<Subgraph> gap = BuildSubgraph(*mlp.ir, std::vector<int>{0, 2});
  CHECK(gap.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(gap.status().message()), Catch::Contains("not a convex set"));
  CHECK(BuildSubgraph(*mlp.ir, std::vector<int>{0, 1}).ok());
}

TEST_CASE("VerifySplit catches a split whose result differs", "[graph]") {
  // Dropout draws new random numbers in each run, so the split cannot match the whole model.
  FixtureIr f = BuildFixtureIr("dropout_net");
  REQUIRE(f.ir.ok());
  absl::Status s = VerifySplit(*f.ir, {0, 1}, f.tensors, f.fixture.inputs);
  CHECK(s.code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(s.message()), Catch::Contains("differs from the whole model"));
  CHECK(VerifySplit(*f.ir, {1}, f.tensors, f.fixture.inputs).code() ==
        absl::StatusCode::kInvalidArgument);
}

// The device of each tensor constant of `graph`, in order.
std::vector<c10::Device> ConstantDevices(const torch::jit::Graph& graph) {
  std::vector<c10::Device> devices;
  for (const torch::jit::Node* n : graph.nodes()) {
    const bool tensor = n->output()->type()->kind() == c10::TypeKind::TensorType;
    if (n->kind() != c10::prim::Constant || !tensor) continue;
    devices.push_back(torch::jit::toIValue(n->output())->toTensor().device());
  }
  return devices;
}

TEST_CASE("PlaceOnDevice keeps the traced shape arithmetic's constants on the host", "[graph]") {
  // What torch.jit.trace records for `y = (x + bias) * half; n = x.size(1) // 4`: the size as a
  // 0-dim tensor (prim::NumToTensor), divided by a 0-dim integer tensor constant, read back with
  // aten::Int. That constant stays on the host (on the device, every aten::Int would wait for
  // the device); the others move. The meta device stands in for a GPU.
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::Value* x = graph->addInput("x");
  x->setType(c10::TensorType::get());
  torch::jit::Value* size = graph->insert(c10::aten::size, {x, 1});
  torch::jit::Node* to_tensor = graph->create(c10::prim::NumToTensor, {size});
  to_tensor->output()->setType(c10::TensorType::get());
  graph->insertNode(to_tensor);
  torch::jit::Value* four = graph->insertConstant(at::scalar_tensor(4, at::kLong));
  torch::jit::Value* heads = graph->insert(c10::aten::floor_divide, {to_tensor->output(), four});
  torch::jit::Value* n = graph->insert(c10::aten::Int, {heads});
  torch::jit::Value* bias = graph->insertConstant(at::ones({8}));
  torch::jit::Value* half = graph->insertConstant(at::scalar_tensor(0.5));
  // An integer constant that meets the device's data is not shape arithmetic: it moves.
  torch::jit::Value* two = graph->insertConstant(at::scalar_tensor(2, at::kLong));
  torch::jit::Value* shifted = graph->insert(c10::aten::add, {x, bias});
  torch::jit::Value* scaled = graph->insert(c10::aten::mul, {shifted, half});
  torch::jit::Value* y = graph->insert(c10::aten::mul, {scaled, two});
  graph->registerOutput(y);
  graph->registerOutput(n);

  const c10::Device meta(c10::kMeta);
  PlaceOnDevice(*graph, meta);
  const std::vector<c10::Device> devices = ConstantDevices(*graph);
  // four, bias, half, two (PlaceOnDevice re-inserts moved constants where they were).
  REQUIRE(devices.size() == 4);
  CHECK(devices[0].is_cpu());
  CHECK(devices[1] == meta);
  CHECK(devices[2] == meta);
  CHECK(devices[3] == meta);

  absl::StatusOr<std::vector<c10::IValue>> out =
      RunGraph(graph, {c10::IValue(at::empty({2, 8}, at::TensorOptions().device(meta)))});
  REQUIRE(out.ok());
  CHECK((*out)[0].toTensor().device() == meta);
  CHECK((*out)[1].toInt() == 2);
}

}  // namespace
}  // namespace rannc
