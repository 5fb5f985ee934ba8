#include "daemon/graph/torchscript_import.h"

#include <algorithm>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <torch/csrc/jit/ir/ir.h>
#include <catch2/catch.hpp>

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

}  // namespace
}  // namespace rannc
