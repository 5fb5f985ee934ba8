#include "daemon/runtime/loss_scale.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("Loss scaling is on for fp16 by default and configurable", "[runtime]") {
  CHECK(ParseLossScale({}, c10::ScalarType::Half)->enabled);
  CHECK_FALSE(ParseLossScale({}, c10::ScalarType::BFloat16)->enabled);
  CHECK_FALSE(ParseLossScale({}, std::nullopt)->enabled);
  CHECK_FALSE(ParseLossScale({{"loss_scale", "none"}}, c10::ScalarType::Half)->enabled);
  absl::StatusOr<LossScaleOptions> o = ParseLossScale(
      {{"loss_scale", "dynamic"}, {"loss_scale_init", "1024"}, {"loss_scale_window", "3"}},
      std::nullopt);
  REQUIRE(o.ok());
  CHECK(o->enabled);
  CHECK(o->dynamic);
  CHECK(o->init == 1024);
  CHECK(o->growth_interval == 3);
  o = ParseLossScale({{"loss_scale", "128"}}, std::nullopt);
  REQUIRE(o.ok());
  CHECK(o->enabled);
  CHECK_FALSE(o->dynamic);
  CHECK(o->init == 128);
  for (const char* bad : {"huge", "0", "-2", "inf"}) {
    absl::StatusOr<LossScaleOptions> r = ParseLossScale({{"loss_scale", bad}}, std::nullopt);
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("loss_scale") != std::string::npos);
  }
  CHECK_FALSE(ParseLossScale({{"loss_scale_window", "0"}}, std::nullopt).ok());
}

TEST_CASE("The dynamic scale backs off on overflow and grows after a window, as GradScaler's",
          "[runtime]") {
  LossScaleOptions o;
  o.enabled = true;
  o.init = 1024;
  o.growth_interval = 2;
  LossScaler s(o);
  CHECK(s.scale() == 1024);
  s.Update(true);  // overflow: halve
  CHECK(s.scale() == 512);
  s.Update(false);
  CHECK(s.scale() == 512);
  s.Update(false);  // two good steps in a row: double
  CHECK(s.scale() == 1024);
  s.Update(false);
  s.Update(true);  // the run restarts after an overflow
  s.Update(false);
  CHECK(s.scale() == 512);
  s.Update(false);
  CHECK(s.scale() == 1024);
  CHECK(s.skipped_steps() == 2);

  o.dynamic = false;
  LossScaler fixed(o);
  fixed.Update(true);
  fixed.Update(false);
  fixed.Update(false);
  CHECK(fixed.scale() == 1024);
  CHECK(fixed.skipped_steps() == 1);
  CHECK(LossScaler().scale() == 1);
}

}  // namespace
}  // namespace rannc
