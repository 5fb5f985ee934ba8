#include "daemon/graph/subgraph.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
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

}  // namespace
}  // namespace rannc
