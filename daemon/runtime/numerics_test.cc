#include "daemon/runtime/numerics.h"

#include <ATen/Context.h>

#include <string>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("a job's numeric settings become LibTorch's, and a job of others waits its turn") {
  NumericSettings tf32;
  tf32.float32_matmul_precision = "high";
  tf32.cudnn_allow_tf32 = false;
  tf32.deterministic_algorithms = true;
  tf32.deterministic_warn_only = true;
  {
    auto first = NumericsLease::Acquire(tf32, "a");
    REQUIRE(first.ok());
    at::Context& ctx = at::globalContext();
    CHECK(ctx.allowTF32CuBLAS());
    CHECK_FALSE(ctx.allowTF32CuDNN());
    CHECK(ctx.deterministicAlgorithms());
    CHECK(ctx.deterministicAlgorithmsWarnOnly());

    auto same = NumericsLease::Acquire(tf32, "b");
    REQUIRE(same.ok());
    const NumericSettings defaults;
    auto other = NumericsLease::Acquire(defaults, "c");
    REQUIRE(other.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string message(other.status().message());
    CHECK(message.find("job c computes with float32_matmul_precision=highest") !=
          std::string::npos);
    CHECK(message.find("float32_matmul_precision=high cudnn.allow_tf32=False") !=
          std::string::npos);
    first->reset();  // "b" still holds them
    CHECK(NumericsLease::Acquire(defaults, "c").status().code() ==
          absl::StatusCode::kFailedPrecondition);
  }
  // Every lease released: the next job sets its own.
  auto defaults = NumericsLease::Acquire(NumericSettings(), "d");
  REQUIRE(defaults.ok());
  at::Context& ctx = at::globalContext();
  CHECK_FALSE(ctx.allowTF32CuBLAS());
  CHECK(ctx.allowTF32CuDNN());
  CHECK_FALSE(ctx.deterministicAlgorithms());
}

TEST_CASE("an unknown matmul precision is refused") {
  NumericSettings s;
  s.float32_matmul_precision = "low";
  CHECK(NumericsLease::Acquire(s, "x").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rannc
