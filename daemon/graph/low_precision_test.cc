#include "daemon/graph/low_precision.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>
// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <catch2/catch.hpp>

#include "daemon/graph/ir.h"
#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

ImportedModel Import(const testing::Fixture& f) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes);
  if (!model.ok()) throw std::runtime_error(std::string(model.status().message()));
  return std::move(*model);
}

std::vector<c10::ScalarType> Dtypes(const std::vector<at::Tensor>& inputs) {
  std::vector<c10::ScalarType> out;
  for (const at::Tensor& t : inputs) out.push_back(t.scalar_type());
  return out;
}

// Per graph input after the user inputs, the module's tensor, as a fresh leaf.
std::vector<at::Tensor> Leaves(const ImportedModel& model) {
  std::vector<at::Tensor> out;
  for (const std::string& name : model.graph_tensor_names) {
    for (const ModuleTensor& t : model.tensors) {
      if (t.name != name) continue;
      at::Tensor leaf = t.tensor.detach().clone();
      if (t.is_parameter) leaf.requires_grad_(true);
      out.push_back(leaf);
      break;
    }
  }
  return out;
}

at::Tensor RunFirstOutput(const ImportedModel& model, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& tensors) {
  std::vector<c10::IValue> stack(inputs.begin(), inputs.end());
  stack.insert(stack.end(), tensors.begin(), tensors.end());
  torch::jit::Code code(model.graph, "test");
  torch::jit::InterpreterState(code).run(stack);
  return stack.at(0).toTensor();
}

// Whether the graph reads lifted tensor `name` only through a cast to `dtype`.
bool ReadAs(const ImportedModel& model, const std::string& name, c10::ScalarType dtype) {
  for (size_t k = 0; k < model.graph_tensor_names.size(); ++k) {
    if (model.graph_tensor_names[k] != name) continue;
    const torch::jit::Value* v = model.graph->inputs()[model.input_names.size() + k];
    for (const torch::jit::Use& use : v->uses()) {
      if (use.user->kind() != c10::aten::to) return false;
      if (torch::jit::toIValue(use.user->input(1))->toInt() != static_cast<int64_t>(dtype)) {
        return false;
      }
    }
    return !v->uses().empty();
  }
  return false;
}

// The rewritten graph on fp32 parameters must compute exactly what the original graph computes
// on bf16 copies of them (leaves of their own), and each fp32 parameter's gradient must be the
// copy's gradient, widened.
void CheckComputesInBf16(const std::string& fixture) {
  testing::Fixture f = testing::LoadFixture(fixture);
  ImportedModel original = Import(f);
  ImportedModel cast = Import(f);
  REQUIRE(CastForwardTo(&cast, at::kBFloat16, Dtypes(f.inputs)).ok());

  std::vector<at::Tensor> params = Leaves(cast);
  at::Tensor out = RunFirstOutput(cast, f.inputs, params);
  CHECK(out.scalar_type() == at::kBFloat16);

  std::vector<at::Tensor> inputs16, params16;
  for (const at::Tensor& x : f.inputs) {
    inputs16.push_back(x.is_floating_point() ? x.to(at::kBFloat16) : x);
  }
  for (const at::Tensor& p : Leaves(original)) {
    params16.push_back(p.requires_grad() ? p.detach().to(at::kBFloat16).requires_grad_(true) : p);
  }
  at::Tensor ref = RunFirstOutput(original, inputs16, params16);
  REQUIRE(ref.scalar_type() == at::kBFloat16);
  CHECK(at::equal(out, ref));

  torch::autograd::backward({out.sum()});
  torch::autograd::backward({ref.sum()});
  for (size_t k = 0; k < params.size(); ++k) {
    INFO(cast.graph_tensor_names[k]);
    if (!params[k].requires_grad()) continue;
    REQUIRE(params[k].grad().defined());
    CHECK(params[k].grad().scalar_type() == at::kFloat);  // the master's gradient
    CHECK(at::equal(params[k].grad(), params16[k].grad().to(at::kFloat)));
  }
}

TEST_CASE("CastForwardTo runs an MLP with a float input in bf16", "[graph]") {
  CheckComputesInBf16("mlp");
}

TEST_CASE("CastForwardTo casts a tied weight once and leaves integer inputs", "[graph]") {
  CheckComputesInBf16("tied_lm");
  testing::Fixture f = testing::LoadFixture("tied_lm");
  ImportedModel model = Import(f);
  REQUIRE(CastForwardTo(&model, at::kBFloat16, Dtypes(f.inputs)).ok());
  int casts = 0;
  for (const torch::jit::Node* node : model.graph->nodes()) casts += node->kind() == c10::aten::to;
  CHECK(casts == 3);  // emb.weight (= head.weight), mix.weight, mix.bias; not the ids
  CHECK(ReadAs(model, "mix.weight", at::kBFloat16));
}

TEST_CASE("CastForwardTo keeps batch norm's parameters and buffers fp32", "[graph]") {
  testing::Fixture f = testing::LoadFixture("bn_net");
  ImportedModel model = Import(f);
  REQUIRE(CastForwardTo(&model, at::kBFloat16, Dtypes(f.inputs)).ok());
  CHECK(ReadAs(model, "conv.weight", at::kBFloat16));
  CHECK(ReadAs(model, "conv.bias", at::kBFloat16));
  for (const char* name : {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"}) {
    INFO(name);
    CHECK_FALSE(ReadAs(model, name, at::kBFloat16));
  }
  // So a bf16 copy of batch norm's parameters would not compute what they do.
  std::vector<at::Tensor> tensors;
  for (const at::Tensor& t : Leaves(model)) tensors.push_back(t.detach());
  absl::StatusOr<IrGraph> ir = BuildIr(model, tensors, f.inputs);
  REQUIRE(ir.ok());
  int low = 0;
  for (size_t li = 0; li < tensors.size(); ++li) {
    const std::string& name = ir->tensor_names[li];
    INFO(name);
    const bool conv = name.rfind("conv.", 0) == 0;
    const bool param = ir->values[ir->inputs[ir->num_user_inputs + li]].role == ValueRole::kParam;
    CHECK(LowPrecisionRead(*ir, static_cast<int>(li)).has_value() == (conv && param));
    low += conv && param;
  }
  CHECK(low == 2);
}

TEST_CASE("The IR makes parameter casts helpers, so no stage sends a bf16 weight", "[graph]") {
  testing::Fixture f = testing::LoadFixture("tiny_gpt");
  ImportedModel fp32 = Import(f);
  ImportedModel model = Import(f);
  REQUIRE(CastForwardTo(&model, at::kBFloat16, Dtypes(f.inputs)).ok());
  std::vector<at::Tensor> tensors;
  for (const at::Tensor& t : Leaves(model)) tensors.push_back(t.detach());
  absl::StatusOr<IrGraph> ir = BuildIr(model, tensors, f.inputs);
  REQUIRE(ir.ok());
  absl::StatusOr<IrGraph> ir32 = BuildIr(fp32, tensors, f.inputs);
  REQUIRE(ir32.ok());
  CHECK(ir->nodes.size() == ir32->nodes.size());  // the same cut points
  CHECK(ir->hash != ir32->hash);  // a deployment planned in fp32 is not taken for this one
  int casts = 0;
  for (const IrValue& v : ir->values) {
    if (v.jit->node()->kind() != c10::aten::to || v.role != ValueRole::kParamDerived) continue;
    ++casts;
    CHECK(v.producer == -1);
    CHECK(v.dtype == at::kBFloat16);
  }
  CHECK(casts > 0);
  // Every parameter is read through its cast alone (the tied embedding's one cast too): a bf16
  // copy computes what it does. Not so in fp32.
  int params = 0;
  for (size_t li = 0; li < tensors.size(); ++li) {
    INFO(ir->tensor_names[li]);
    const bool param = ir->values[ir->inputs[ir->num_user_inputs + li]].role == ValueRole::kParam;
    params += param;
    CHECK(LowPrecisionRead(*ir, static_cast<int>(li)) ==
          (param ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt));
    CHECK(LowPrecisionRead(*ir32, static_cast<int>(li)) == std::nullopt);
  }
  CHECK(params > 0);
  CHECK(LowPrecisionRead(*ir, -1) == std::nullopt);
  CHECK(LowPrecisionRead(*ir, static_cast<int>(tensors.size())) == std::nullopt);
  for (const IrNode& node : ir->nodes) {
    for (int v : node.outputs) {
      const IrValue& value = ir->values[v];
      INFO(value.name);
      if (value.is_tensor && value.dtype != at::kLong && value.dtype != at::kBool) {
        CHECK(value.dtype == at::kBFloat16);  // everything between nodes is bf16
      }
    }
  }
}

TEST_CASE("CastForwardTo refuses a non-floating dtype or the wrong number of inputs", "[graph]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  ImportedModel model = Import(f);
  CHECK(CastForwardTo(&model, at::kInt, Dtypes(f.inputs)).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(CastForwardTo(&model, at::kBFloat16, {at::kFloat}).code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rannc
