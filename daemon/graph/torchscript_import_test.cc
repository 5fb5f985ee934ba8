#include "daemon/graph/torchscript_import.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <catch2/catch.hpp>

#include "daemon/common/torch_archive.h"
#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST_CASE("ImportTorchScript lifts every parameter to a graph input", "[graph]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes);
  REQUIRE(model.ok());
  CHECK(model->input_names.size() == 2);
  CHECK(model->graph->inputs().size() == 2 + model->graph_tensor_names.size());
  for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
    CHECK(Contains(model->graph_tensor_names, name));
  }
  for (torch::jit::Node* node : model->graph->nodes()) {
    CHECK(node->kind() != c10::prim::GetAttr);
  }
  // state_dict order: each module's parameters, then its children.
  std::vector<std::string> names;
  for (const ModuleTensor& t : model->tensors) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});
}

TEST_CASE("ImportTorchScript keeps both names of a tied weight", "[graph]") {
  testing::Fixture f = testing::LoadFixture("tied_lm");
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes);
  REQUIRE(model.ok());
  std::vector<std::string> names;
  for (const ModuleTensor& t : model->tensors) names.push_back(t.name);
  CHECK(Contains(names, "emb.weight"));
  CHECK(Contains(names, "head.weight"));
}

TEST_CASE("ImportTorchScript lists buffers after parameters of the same module", "[graph]") {
  testing::Fixture f = testing::LoadFixture("bn_net");
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes);
  REQUIRE(model.ok());
  std::vector<std::string> names;
  for (const ModuleTensor& t : model->tensors) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"conv.weight", "conv.bias", "bn.weight", "bn.bias",
                                          "bn.running_mean", "bn.running_var",
                                          "bn.num_batches_tracked"});
}

const ModuleTensor* FindTensor(const ImportedModel& model, const std::string& name) {
  for (const ModuleTensor& t : model.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST_CASE("ImportTorchScript puts sent tensors in place, under every name of a tied weight",
          "[graph]") {
  testing::Fixture f = testing::LoadFixture("tied_lm");
  absl::StatusOr<ImportedModel> plain = ImportTorchScript(f.model_bytes);
  REQUIRE(plain.ok());
  const at::Tensor archived = FindTensor(*plain, "emb.weight")->tensor;
  const at::Tensor value = at::arange(archived.numel(), archived.options())
                               .reshape(archived.sizes())
                               .set_requires_grad(false);
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes, {{"head.weight", value}});
  REQUIRE(model.ok());
  for (const char* name : {"emb.weight", "head.weight"}) {
    const ModuleTensor* t = FindTensor(*model, name);
    REQUIRE(t != nullptr);
    CHECK(t->tensor.equal(value));
    // The archive's requires_grad, not the sent tensor's; tied names still share one tensor.
    CHECK(t->tensor.requires_grad() == archived.requires_grad());
    CHECK(t->tensor.data_ptr() == value.data_ptr());
  }

  // A cluster job's parts get the bound values inside one archive again.
  absl::StatusOr<std::string> whole = SerializeModule(*model);
  REQUIRE(whole.ok());
  absl::StatusOr<ImportedModel> reloaded = ImportTorchScript(*whole);
  REQUIRE(reloaded.ok());
  CHECK(FindTensor(*reloaded, "emb.weight")->tensor.equal(value));
  CHECK(FindTensor(*reloaded, "head.weight")->tensor.equal(value));
}

TEST_CASE("ImportTorchScript rejects a sent tensor the model lacks or that does not match",
          "[graph]") {
  testing::Fixture f = testing::LoadFixture("tied_lm");
  absl::StatusOr<ImportedModel> plain = ImportTorchScript(f.model_bytes);
  REQUIRE(plain.ok());
  const at::Tensor archived = FindTensor(*plain, "emb.weight")->tensor;

  absl::StatusOr<ImportedModel> unknown =
      ImportTorchScript(f.model_bytes, {{"nope.weight", archived.clone()}});
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(unknown.status().message()).find("'nope.weight'") != std::string::npos);

  absl::StatusOr<ImportedModel> reshaped =
      ImportTorchScript(f.model_bytes, {{"emb.weight", archived.reshape({-1}).clone()}});
  REQUIRE_FALSE(reshaped.ok());
  CHECK(reshaped.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(reshaped.status().message()).find("'emb.weight'") != std::string::npos);

  absl::StatusOr<ImportedModel> retyped =
      ImportTorchScript(f.model_bytes, {{"emb.weight", archived.to(at::kDouble)}});
  REQUIRE_FALSE(retyped.ok());
  CHECK(retyped.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("CheckNoStandIns rejects a stand-in that no sent tensor replaced", "[graph]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  absl::StatusOr<ImportedModel> plain = ImportTorchScript(f.model_bytes);
  REQUIRE(plain.ok());
  CHECK(CheckNoStandIns(*plain).ok());

  // What a client writes for a tensor it sends apart: one stored element, stride 0.
  const at::Tensor weight = FindTensor(*plain, "fc1.weight")->tensor.detach().clone();
  torch::jit::Module fc1 = plain->module->attr("fc1").toModule();
  fc1.setattr("weight", at::zeros({}, weight.options()).expand(weight.sizes()));
  absl::StatusOr<std::string> stood_in = SerializeModule(*plain);
  REQUIRE(stood_in.ok());

  absl::StatusOr<ImportedModel> unbound = ImportTorchScript(*stood_in);
  REQUIRE(unbound.ok());  // AddMode reads such archives for their graph only
  absl::Status status = CheckNoStandIns(*unbound);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()).find("parameter 'fc1.weight'") != std::string::npos);
  CHECK(std::string(status.message()).find("stand-in") != std::string::npos);

  absl::StatusOr<ImportedModel> bound = ImportTorchScript(*stood_in, {{"fc1.weight", weight}});
  REQUIRE(bound.ok());
  CHECK(CheckNoStandIns(*bound).ok());
  CHECK(FindTensor(*bound, "fc1.weight")->tensor.equal(weight));
}

TEST_CASE("ImportTorchScript keeps a traced model's numbers scalars, as PyTorch runs them",
          "[graph]") {
  // loss * 0.5 + penalty * 1e-3 + 2: traced, each number is a 0-dim double tensor constant,
  // which the interpreter would let promote the float loss to double.
  testing::Fixture f = testing::LoadFixture("scaled_loss");
  absl::StatusOr<ImportedModel> model = ImportTorchScript(f.model_bytes);
  REQUIRE(model.ok());
  for (torch::jit::Node* node : model->graph->nodes()) {
    if (node->kind() != c10::prim::Constant || !node->hasAttribute(c10::attr::value) ||
        node->kindOf(c10::attr::value) != torch::jit::AttributeKind::t) {
      continue;
    }
    CHECK(node->t(c10::attr::value).dim() != 0);
  }
  torch::jit::Stack stack(f.inputs.begin(), f.inputs.end());
  for (const std::string& name : model->graph_tensor_names) {
    for (const ModuleTensor& t : model->tensors) {
      if (t.name == name) stack.push_back(t.tensor);
    }
  }
  torch::jit::Code code(model->graph, "test");
  torch::jit::InterpreterState(code).run(stack);
  const at::Tensor loss = stack.at(0).toTensor();
  CHECK(loss.scalar_type() == at::kFloat);
  CHECK(at::equal(loss, f.ref.at("out_0")));
}

TEST_CASE("ImportTorchScript rejects bytes that are not TorchScript", "[graph]") {
  absl::StatusOr<ImportedModel> garbage = ImportTorchScript("definitely not a zip archive");
  REQUIRE_FALSE(garbage.ok());
  CHECK(garbage.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(garbage.status().message()).find("not a loadable TorchScript") !=
        std::string::npos);
  // No backtrace leaks into a user's error.
  CHECK(std::string(garbage.status().message()).find("Exception raised from") ==
        std::string::npos);

  absl::StatusOr<ImportedModel> empty = ImportTorchScript("");
  CHECK(empty.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("ImportTorchScript refuses an archive whose pickle states a huge length, at once",
          "[graph]") {
  // Found by fuzz/torchscript_import_fuzzer.cc: a 4.7 KB archive whose debug_pkl states a
  // BINBYTES length of gigabytes made LibTorch allocate 2.6 GB and spend ~10 s (its input is in
  // fuzz/corpus/torchscript_import). The same hole in data.pkl, made here from a real archive.
  std::string bytes = testing::LoadFixture("mlp").model_bytes;
  absl::StatusOr<std::vector<ZipRecord>> records = ReadZipDirectory(bytes, "mlp.pt");
  REQUIRE(records.ok());
  auto data = std::find_if(records->begin(), records->end(), [](const ZipRecord& r) {
    return r.name.size() > 9 && r.name.substr(r.name.size() - 9) == "/data.pkl";
  });
  REQUIRE(data != records->end());
  auto u16 = [&](size_t at) {
    return static_cast<size_t>(static_cast<uint8_t>(bytes[at])) |
           static_cast<size_t>(static_cast<uint8_t>(bytes[at + 1])) << 8;
  };
  const size_t at = data->offset + 30 + u16(data->offset + 26) + u16(data->offset + 28);
  REQUIRE(bytes.compare(at, 2, "\x80\x02") == 0);  // PROTO 2
  bytes.replace(at + 2, 5, "X\xff\xff\xff\x7f", 5);  // BINUNICODE of 2^31-1 bytes

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ImportedModel> model = ImportTorchScript(bytes);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(model.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string message(model.status().message());
  CHECK(message.find("the model archive's pickle '") != std::string::npos);
  CHECK(message.find("data.pkl") != std::string::npos);
  CHECK(message.find("a length of 2147483647 bytes") != std::string::npos);
  CHECK(seconds < 1.0);
}

}  // namespace
}  // namespace rannc
