#include "daemon/planner/profiler.h"

#include <algorithm>
#include <cstdlib>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"

namespace rannc {
namespace planner {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

std::vector<int> EveryNode(const IrGraph& ir) {
  std::vector<int> starts;
  for (size_t i = 0; i < ir.nodes.size(); ++i) starts.push_back(static_cast<int>(i));
  return starts;
}

TEST_CASE("Profiler measures time and memory of each block", "[planner]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  Profiler profiler(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
  absl::StatusOr<std::vector<ProfileRecord>> blocks = profiler.ProfileBlocks(EveryNode(*f.ir), 64);
  REQUIRE(blocks.ok());
  REQUIRE(blocks->size() == f.ir->nodes.size());
  const ProfileRecord& fc1 = (*blocks)[0];
  CHECK(fc1.fwd_ms > 0);
  CHECK(fc1.bwd_ms > 0);
  CHECK(fc1.param_bytes == (6 * 8 + 8) * 4);  // fc1.weight and fc1.bias
  CHECK(fc1.output_bytes == 64 * 8 * 4);
  // What forward leaves for backward includes at least its output.
  CHECK(fc1.act_bytes >= fc1.output_bytes);
  CHECK(profiler.measured() == static_cast<int>(f.ir->nodes.size()));
}

TEST_CASE("Profiled activation memory grows with the micro-batch", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  Profiler profiler(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
  const std::vector<int> two_blocks = {0, static_cast<int>(f.ir->nodes.size()) / 2};
  absl::StatusOr<std::vector<ProfileRecord>> small = profiler.ProfileBlocks(two_blocks, 2);
  absl::StatusOr<std::vector<ProfileRecord>> large = profiler.ProfileBlocks(two_blocks, 32);
  REQUIRE(small.ok());
  REQUIRE(large.ok());
  for (size_t b = 0; b < 2; ++b) {
    CHECK((*large)[b].act_bytes > 8 * (*small)[b].act_bytes);
    CHECK((*large)[b].param_bytes == (*small)[b].param_bytes);
  }
  // Atomic forward times exist for every node.
  absl::StatusOr<std::vector<double>> node_ms = profiler.AtomicForwardMs();
  REQUIRE(node_ms.ok());
  CHECK(node_ms->size() == f.ir->nodes.size());
  for (double ms : *node_ms) CHECK(ms >= 0);
}

TEST_CASE("Profiles come from the cache, also after a restart", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/profiles.tsv";
  const std::vector<int> starts = {0, 5, 11};
  std::vector<ProfileRecord> first;
  {
    ProfileCache cache(path);
    Profiler profiler(*f.ir, f.tensors, f.fixture.inputs, &cache, {});
    absl::StatusOr<std::vector<ProfileRecord>> r = profiler.ProfileBlocks(starts, 4);
    REQUIRE(r.ok());
    first = *r;
    CHECK(profiler.measured() == 3);
    REQUIRE(cache.Flush().ok());
  }
  ProfileCache reloaded(path);
  REQUIRE(reloaded.Load().ok());
  Profiler again(*f.ir, f.tensors, f.fixture.inputs, &reloaded, {});
  absl::StatusOr<std::vector<ProfileRecord>> second = again.ProfileBlocks(starts, 4);
  REQUIRE(second.ok());
  CHECK(again.measured() == 0);
  CHECK(again.cache_hits() == 3);
  CHECK((*second == first));
  // Another micro-batch size is measured, not looked up.
  REQUIRE(again.ProfileBlocks(starts, 8).ok());
  CHECK(again.measured() == 3);
}

TEST_CASE("Blocks of one structure are measured once and share the record", "[planner]") {
  FixtureIr f = BuildFixtureIr("deep_gpt");
  REQUIRE(f.ir.ok());
  Profiler profiler(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
  absl::StatusOr<std::vector<double>> node_ms = profiler.AtomicForwardMs();
  REQUIRE(node_ms.ok());
  const std::vector<int>& classes = profiler.node_classes();
  REQUIRE(classes.size() == f.ir->nodes.size());
  const int distinct = *std::max_element(classes.begin(), classes.end()) + 1;
  INFO(distinct << " structures among " << classes.size() << " nodes");
  CHECK(distinct < static_cast<int>(classes.size()) / 3);  // six layers, one structure
  CHECK(profiler.measured() == distinct);
  CHECK(profiler.shared() == static_cast<int>(classes.size()) - distinct);
  for (size_t i = 0; i < classes.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (classes[i] == classes[j]) CHECK((*node_ms)[i] == (*node_ms)[j]);
    }
  }

  Profiler blocks(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
  absl::StatusOr<std::vector<ProfileRecord>> r = blocks.ProfileBlocks(EveryNode(*f.ir), 3);
  REQUIRE(r.ok());
  CHECK(blocks.measured() == distinct);
  CHECK(blocks.shared() == static_cast<int>(classes.size()) - distinct);
  for (size_t i = 0; i < classes.size(); ++i) {
    const ProfileRecord& rec = (*r)[i];
    CHECK(rec.fwd_ms > 0);
    for (size_t j = 0; j < i; ++j) {
      if (classes[i] == classes[j]) CHECK((rec == (*r)[j]));
    }
  }
}

TEST_CASE("A model made of another's layers reuses their profiles; AMP does not", "[planner]") {
  FixtureIr tiny = BuildFixtureIr("tiny_gpt");
  FixtureIr deep = BuildFixtureIr("deep_gpt");
  REQUIRE(tiny.ir.ok());
  REQUIRE(deep.ir.ok());
  ProfileCache cache("");
  Profiler first(*tiny.ir, tiny.tensors, tiny.fixture.inputs, &cache, {});
  REQUIRE(first.ProfileBlocks(EveryNode(*tiny.ir), 2).ok());
  CHECK(first.measured() > 0);
  // The same layers (and embedding and head), four more of them: nothing new to measure.
  Profiler second(*deep.ir, deep.tensors, deep.fixture.inputs, &cache, {});
  REQUIRE(second.ProfileBlocks(EveryNode(*deep.ir), 2).ok());
  CHECK(second.measured() == 0);
  // Under autocast the same graph computes in bfloat16: a different measurement.
  {
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    Profiler amp(*tiny.ir, tiny.tensors, tiny.fixture.inputs, &cache, {});
    absl::StatusOr<std::vector<ProfileRecord>> r = amp.ProfileBlocks(EveryNode(*tiny.ir), 2);
    at::autocast::set_cpu_enabled(false);
    at::autocast::clear_cache();
    REQUIRE(r.ok());
    CHECK(amp.measured() == first.measured());
  }
  // Another micro-batch size is another measurement.
  Profiler larger(*deep.ir, deep.tensors, deep.fixture.inputs, &cache, {});
  REQUIRE(larger.ProfileBlocks(EveryNode(*deep.ir), 4).ok());
  CHECK(larger.measured() == first.measured());
}

TEST_CASE("Profiling leaves the job's tensors untouched", "[planner]") {
  FixtureIr f = BuildFixtureIr("bn_net");
  REQUIRE(f.ir.ok());
  std::vector<at::Tensor> before;
  for (const at::Tensor& t : f.tensors) before.push_back(t.clone());
  Profiler profiler(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
  REQUIRE(profiler.ProfileBlocks({0}, 16).ok());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    CHECK(at::equal(before[i], f.tensors[i]));
    CHECK_FALSE(f.tensors[i].grad().defined());
  }
}

}  // namespace
}  // namespace planner
}  // namespace rannc
