#include "daemon/graph/ir.h"

#include <set>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

const IrValue& Input(const IrGraph& ir, size_t i) { return ir.values[ir.inputs[i]]; }

const IrValue* Lifted(const IrGraph& ir, const std::string& name) {
  for (size_t i = 0; i < ir.tensor_names.size(); ++i) {
    if (ir.tensor_names[i] == name) return &ir.values[ir.inputs[ir.num_user_inputs + i]];
  }
  return nullptr;
}

void CheckTopologicalAndConnected(const IrGraph& ir) {
  for (size_t n = 0; n < ir.nodes.size(); ++n) {
    CHECK_FALSE(ir.nodes[n].ops.empty());
    for (int v : ir.nodes[n].inputs) {
      CHECK(ir.values[v].producer < static_cast<int>(n));
      std::set<int> consumers(ir.values[v].consumers.begin(), ir.values[v].consumers.end());
      CHECK(consumers.count(n));
    }
    for (int v : ir.nodes[n].outputs) CHECK(ir.values[v].producer == static_cast<int>(n));
  }
}

TEST_CASE("BuildIr types an MLP with two inputs and a loss", "[graph]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  CheckTopologicalAndConnected(ir);
  // The client's two inputs, then the cross entropy's denominator (graph/loss_denominators.h).
  REQUIRE(ir.num_client_inputs == 2);
  REQUIRE(ir.num_user_inputs == 3);
  CHECK(Input(ir, 2).role == ValueRole::kInput);
  CHECK(Input(ir, 2).batch_dim == -1);
  CHECK(Input(ir, 0).role == ValueRole::kInput);
  CHECK(Input(ir, 0).batch_dim == 0);
  CHECK(Input(ir, 0).shape == std::vector<int64_t>{5, 6});
  CHECK(Input(ir, 1).dtype == at::kLong);
  CHECK(Lifted(ir, "fc1.weight")->role == ValueRole::kParam);
  REQUIRE(ir.outputs.size() == 1);
  const IrValue& loss = ir.values[ir.outputs[0]];
  CHECK(loss.is_loss);
  CHECK(loss.is_output);
  CHECK(loss.batch_dim == -1);
  CHECK(ir.example_batch == 5);
  // linear, relu, linear, cross_entropy: at least the three batch ops before the loss.
  CHECK(ir.nodes.size() >= 4);
  // fc1's output (8 floats per sample) crosses the boundary after the first node.
  CHECK(CutBytesPerSample(ir, 1) == Approx(8 * 4));
}

TEST_CASE("BuildIr finds how losses combine samples, and models whose samples interact",
          "[graph]") {
  for (const char* name : {"mlp", "multi_io", "tiny_gpt", "tied_lm"}) {
    INFO(name);
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    CHECK(f.ir->batch_separable);
    // A scalar loss alone can be differentiated before the client sees it; logits or several
    // floating outputs cannot.
    const std::string n = name;
    CHECK(FusesForwardBackward(*f.ir) == (n == "mlp" || n == "tiny_gpt"));
    const IrValue& first = f.ir->values[f.ir->outputs[0]];
    CHECK(first.reduction == (first.is_loss ? IrValue::Reduction::kMean
                                            : IrValue::Reduction::kUnknown));
  }
  // BatchNorm in training mode normalizes over the batch.
  FixtureIr bn = BuildFixtureIr("bn_net");
  REQUIRE(bn.ir.ok());
  CHECK_FALSE(bn.ir->batch_separable);
  CHECK_THAT(bn.ir->not_separable, Catch::Contains("normalizes over the batch"));
  // Random ops are followed op by op like any other (dropout keeps samples apart); only the
  // run of samples apart cannot check them.
  FixtureIr dropout = BuildFixtureIr("dropout_net");
  REQUIRE(dropout.ir.ok());
  CHECK(dropout.ir->batch_separable);
}

TEST_CASE("BuildIr gives a tied weight to every node that reads it", "[graph]") {
  FixtureIr f = BuildFixtureIr("tied_lm");
  REQUIRE(f.ir.ok());
  CheckTopologicalAndConnected(*f.ir);
  CHECK(Input(*f.ir, 0).dtype == at::kLong);
  CHECK(Input(*f.ir, 0).batch_dim == 0);
  // The trace reads the tied tensor under one name; the embedding and the head both consume it.
  const IrValue* emb = Lifted(*f.ir, "emb.weight");
  REQUIRE(emb != nullptr);
  CHECK(emb->consumers.size() >= 2);
  // The output [3, 4, 11] keeps the batch in dim 0.
  CHECK(f.ir->values[f.ir->outputs[0]].batch_dim == 0);
}

TEST_CASE("BuildIr marks buffers and restores them after its runs", "[graph]") {
  FixtureIr f = BuildFixtureIr("bn_net");
  REQUIRE(f.ir.ok());
  const IrValue* mean = Lifted(*f.ir, "bn.running_mean");
  REQUIRE(mean != nullptr);
  CHECK(mean->role == ValueRole::kBuffer);
  // Only what the model may write is saved and restored around the runs: buffers, and what
  // alias analysis cannot clear (it answers conservatively; here the convolution's weight
  // too); a transformer's parameters are only read.
  CHECK(mean->written);
  FixtureIr gpt = BuildFixtureIr("tiny_gpt");
  REQUIRE(gpt.ir.ok());
  const IrValue* qkv = Lifted(*gpt.ir, "blocks.0.qkv.weight");
  REQUIRE(qkv != nullptr);
  CHECK_FALSE(qkv->written);
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    if (f.ir->tensor_names[i] == "bn.running_mean") CHECK(at::equal(f.tensors[i], at::zeros({3})));
  }
}

TEST_CASE("BuildIr handles tuples, in-place ops, param-only ops and constants", "[graph]") {
  FixtureIr f = BuildFixtureIr("multi_io");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  CheckTopologicalAndConnected(ir);
  REQUIRE(ir.outputs.size() == 3);  // loss, (out, g * 3) flattened
  CHECK(ir.values[ir.outputs[0]].is_loss);
  CHECK(ir.values[ir.outputs[1]].shape == std::vector<int64_t>{4, 4});
  bool param_derived = false, constant = false;
  for (const IrValue& v : ir.values) {
    param_derived = param_derived || (v.role == ValueRole::kParamDerived && v.is_tensor);
    constant = constant || v.role == ValueRole::kConst;
    // Helpers never belong to a node: only batch ops are atomic.
    if (v.role == ValueRole::kParamDerived || v.role == ValueRole::kConst) CHECK(v.producer == -1);
  }
  CHECK(param_derived);  // w * 2 + 1
  CHECK(constant);
  // Running the prepared graph whole gives PyTorch's outputs.
  std::vector<c10::IValue> stack(f.fixture.inputs.begin(), f.fixture.inputs.end());
  for (const at::Tensor& t : f.tensors) stack.emplace_back(t);
  torch::jit::Code code(ir.graph, "whole");
  torch::jit::InterpreterState(code).run(stack);
  REQUIRE(stack.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(at::allclose(stack[i].toTensor(), f.fixture.ref.at("out_" + std::to_string(i)), 1e-5,
                       1e-6));
  }
}

TEST_CASE("BuildIr finds batch dimensions through views in attention", "[graph]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  CheckTopologicalAndConnected(*f.ir);
  int batched_4d = 0;
  for (const IrValue& v : f.ir->values) {
    if (v.role == ValueRole::kActivation && v.shape.size() == 4 && v.batch_dim == 0) ++batched_4d;
  }
  CHECK(batched_4d > 0);  // [B, heads, T, T] attention scores
  // `B, T = ids.size()` and the causal mask come from shapes alone: helpers, recomputed per
  // stage for its own shard, never atomic nodes whose results would travel.
  for (const IrNode& node : f.ir->nodes) {
    for (torch::jit::Node* op : node.ops) CHECK(op->kind() != c10::prim::NumToTensor);
  }
  CHECK(f.ir->values[f.ir->outputs[0]].is_loss);
  CHECK(f.ir->nodes.size() > 20);
}

TEST_CASE("Sharing repeated nodes builds the same IR, running each layer's kind once", "[graph]") {
  for (const char* name :
       {"mlp", "tied_lm", "bn_net", "multi_io", "tiny_gpt", "deep_gpt", "dropout_net"}) {
    INFO(name);
    FixtureIr f = BuildFixtureIr(name);  // shares (the default)
    REQUIRE(f.ir.ok());
    IrOptions every;
    every.share_repeated_nodes = false;
    absl::StatusOr<IrGraph> full = BuildIr(f.model, f.tensors, f.fixture.inputs, every);
    REQUIRE(full.ok());
    CHECK(full->nodes_probed == static_cast<int>(full->nodes.size()));
    CHECK(f.ir->hash == full->hash);
    CHECK(f.ir->batch_separable == full->batch_separable);
    CHECK(f.ir->not_separable == full->not_separable);
    REQUIRE(f.ir->values.size() == full->values.size());
    for (size_t v = 0; v < full->values.size(); ++v) {
      INFO("value %" << full->values[v].name);
      CHECK(f.ir->values[v].dtype == full->values[v].dtype);
      CHECK(f.ir->values[v].shape == full->values[v].shape);
      CHECK(f.ir->values[v].batch_dim == full->values[v].batch_dim);
      CHECK(f.ir->values[v].bytes == full->values[v].bytes);
      CHECK(f.ir->values[v].is_loss == full->values[v].is_loss);
      CHECK(f.ir->values[v].reduction == full->values[v].reduction);
    }
    REQUIRE(f.ir->nodes.size() == full->nodes.size());
    for (size_t n = 0; n < full->nodes.size(); ++n) {
      CHECK(f.ir->nodes[n].inputs == full->nodes[n].inputs);
      CHECK(f.ir->nodes[n].outputs == full->nodes[n].outputs);
    }
  }
  // Six identical layers: the second to sixth take the first's values. (The first layer
  // reads the embedding's sum, the others the residual stream, both [B, T, d].)
  FixtureIr deep = BuildFixtureIr("deep_gpt");
  FixtureIr tiny = BuildFixtureIr("tiny_gpt");
  REQUIRE(deep.ir.ok());
  REQUIRE(tiny.ir.ok());
  INFO(deep.ir->nodes_probed << " of " << deep.ir->nodes.size() << " nodes run");
  CHECK(deep.ir->nodes.size() > 2 * tiny.ir->nodes.size());
  CHECK(deep.ir->nodes_probed <= tiny.ir->nodes_probed);
}

TEST_CASE("Shapes follow from shapes unless an op reads contents into a size", "[graph]") {
  auto follows = [](const std::string& text) {
    auto graph = std::make_shared<torch::jit::Graph>();
    torch::jit::parseIR(text, graph.get());
    return ShapesFollowFromShapes(*graph);
  };
  // Sizes of inputs, arithmetic on them, views: shapes from shapes.
  CHECK(follows(R"IR(
graph(%x : Tensor, %w : Tensor):
  %zero : int = prim::Constant[value=0]()
  %b : int = aten::size(%x, %zero)
  %t : Tensor = prim::NumToTensor(%b)
  %n : int = aten::Int(%t)
  %minus : int = prim::Constant[value=-1]()
  %shape : int[] = prim::ListConstruct(%n, %minus)
  %y : Tensor = aten::matmul(%x, %w)
  %z : Tensor = aten::view(%y, %shape)
  return (%z))IR"));
  // A size read from contents (int(x.sum())), a count (nonzero), where(cond) alone.
  CHECK_FALSE(follows(R"IR(
graph(%x : Tensor):
  %none : NoneType = prim::Constant()
  %s : Tensor = aten::sum(%x, %none)
  %n : int = aten::Int(%s)
  %minus : int = prim::Constant[value=-1]()
  %shape : int[] = prim::ListConstruct(%n, %minus)
  %z : Tensor = aten::view(%x, %shape)
  return (%z))IR"));
  CHECK_FALSE(follows(R"IR(
graph(%x : Tensor):
  %z : Tensor = aten::nonzero(%x)
  return (%z))IR"));
  CHECK_FALSE(follows(R"IR(
graph(%x : Tensor):
  %z : Tensor[] = aten::where(%x)
  return (%z))IR"));
  // A parameter's contents count as contents too.
  CHECK_FALSE(follows(R"IR(
graph(%x : Tensor, %p : Tensor):
  %n : int = aten::Int(%p)
  %minus : int = prim::Constant[value=-1]()
  %shape : int[] = prim::ListConstruct(%n, %minus)
  %z : Tensor = aten::view(%x, %shape)
  return (%z))IR"));
}

TEST_CASE("BuildIr rejects a trace that fixed the batch size", "[graph]") {
  FixtureIr f = BuildFixtureIr("baked_batch");
  REQUIRE_FALSE(f.ir.ok());
  CHECK(f.ir.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(f.ir.status().message()),
             Catch::Contains("samples (the example has 4)") && Catch::Contains("x.size(0)"));
}

TEST_CASE("The IR hash is stable for a model and differs between models", "[graph]") {
  FixtureIr a = BuildFixtureIr("mlp");
  FixtureIr b = BuildFixtureIr("mlp");
  FixtureIr c = BuildFixtureIr("tied_lm");
  REQUIRE(a.ir.ok());
  REQUIRE(b.ir.ok());
  REQUIRE(c.ir.ok());
  CHECK(a.ir->hash.size() == 16);
  CHECK(a.ir->hash == b.ir->hash);
  CHECK(a.ir->hash != c.ir->hash);
}

}  // namespace
}  // namespace rannc
