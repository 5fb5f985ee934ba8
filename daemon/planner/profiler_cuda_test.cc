// The profiler on a CUDA device (ProfilerOptions::device): needs a CUDA LibTorch and a GPU (tag
// gpu; fails, not skips, without them).
#include "daemon/planner/profiler.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"
#include "daemon/runtime/autocast.h"

namespace rannc {
namespace planner {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

TEST_CASE("Blocks profiled on a GPU: its times, its memory, the CPU's parameter bytes",
          "[gpu]") {
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(at::hasCUDA());
  for (bool amp : {false, true}) {
    INFO((amp ? "bf16 autocast" : "fp32"));
    // The job plans under the CPU's autocast; the profiler runs the GPU's alike.
    AutocastGuard autocast(amp ? AmpDtype(at::kBFloat16) : AmpDtype());
    FixtureIr f = BuildFixtureIr("tiny_gpt");
    REQUIRE(f.ir.ok());
    const std::vector<int> blocks = {0, static_cast<int>(f.ir->nodes.size()) / 2};
    ProfilerOptions on_gpu;
    on_gpu.device_type = "cuda";
    on_gpu.device = c10::Device(c10::kCUDA, 0);
    Profiler gpu(*f.ir, f.tensors, f.fixture.inputs, nullptr, on_gpu);
    Profiler cpu(*f.ir, f.tensors, f.fixture.inputs, nullptr, {});
    absl::StatusOr<std::vector<ProfileRecord>> small = gpu.ProfileBlocks(blocks, 2);
    absl::StatusOr<std::vector<ProfileRecord>> large = gpu.ProfileBlocks(blocks, 32);
    absl::StatusOr<std::vector<ProfileRecord>> host = cpu.ProfileBlocks(blocks, 32);
    INFO(small.status().ToString() << " / " << large.status().ToString());
    REQUIRE(small.ok());
    REQUIRE(large.ok());
    REQUIRE(host.ok());
    for (size_t b = 0; b < blocks.size(); ++b) {
      INFO("block " << b);
      CHECK((*large)[b].fwd_ms > 0);
      CHECK((*large)[b].bwd_ms > 0);
      CHECK((*large)[b].param_bytes == (*host)[b].param_bytes);
      CHECK((*large)[b].output_bytes == (*host)[b].output_bytes);
      // The caching allocator's blocks are what the tracker sees: activations grow with the
      // micro-batch there too.
      CHECK((*large)[b].act_bytes > 4 * (*small)[b].act_bytes);
    }
    absl::StatusOr<std::vector<double>> node_ms = gpu.AtomicForwardMs();
    REQUIRE(node_ms.ok());
    CHECK(node_ms->size() == f.ir->nodes.size());
  }
}

}  // namespace
}  // namespace planner
}  // namespace rannc
