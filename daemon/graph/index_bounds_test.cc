#include "daemon/graph/index_bounds.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

TEST_CASE("Token ids and class targets get the ranges of what they index", "[graph]") {
  // tiny_gpt: ids index the 13-row embedding; targets, through view(-1), cross_entropy's 13
  // classes (ignore_index -100).
  FixtureIr gpt = BuildFixtureIr("tiny_gpt");
  REQUIRE(gpt.ir.ok());
  std::vector<IndexBound> bounds = FindIndexBounds(*gpt.ir);
  REQUIRE(bounds.size() == 2);
  CHECK(bounds[0].input == 0);
  CHECK(bounds[0].limit == 13);
  CHECK(!bounds[0].ignore);
  CHECK(bounds[0].what == "the rows of embedding emb.weight (13 rows)");
  CHECK(bounds[1].input == 1);
  CHECK(bounds[1].limit == 13);
  REQUIRE(bounds[1].ignore);
  CHECK(*bounds[1].ignore == -100);
  CHECK_THAT(bounds[1].what, Catch::Contains("13 classes"));

  // mlp: float features (no range) and 3 classes of targets.
  FixtureIr mlp = BuildFixtureIr("mlp");
  REQUIRE(mlp.ir.ok());
  bounds = FindIndexBounds(*mlp.ir);
  REQUIRE(bounds.size() == 1);
  CHECK(bounds[0].input == 1);
  CHECK(bounds[0].limit == 3);

  // A model with no integer input has none.
  FixtureIr multi = BuildFixtureIr("multi_io");
  REQUIRE(multi.ir.ok());
  CHECK(FindIndexBounds(*multi.ir).empty());
}

}  // namespace
}  // namespace rannc
