#include "daemon/optim/lr_schedule.h"

#include <cmath>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("lr schedules give Hugging Face's warmup, linear and cosine values") {
  LrSchedule s{LrSchedule::Kind::kCosine, 1.0, 4, 0.1, 14};
  REQUIRE(s.Validate().ok());
  // Warmup: index i = step - 1 over 4 steps, from 0.
  CHECK(s.At(1) == 0.0);
  CHECK(s.At(3) == Approx(0.5));
  // Then cosine from 1 to 0.1 over the 10 steps left.
  CHECK(s.At(5) == Approx(1.0));
  CHECK(s.At(10) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.5))));
  CHECK(s.At(15) == Approx(0.1));
  CHECK(s.At(40) == Approx(0.1));  // past the end: the floor

  s.kind = LrSchedule::Kind::kLinear;
  CHECK(s.At(5) == Approx(1.0));
  CHECK(s.At(10) == Approx(1.0 - 0.9 * 0.5));
  CHECK(s.At(15) == Approx(0.1));

  s.kind = LrSchedule::Kind::kConstant;
  CHECK(s.At(2) == Approx(0.25));
  CHECK(s.At(12) == 1.0);

  LrSchedule no_warmup{LrSchedule::Kind::kCosine, 2.0, 0, 0.0, 4};
  CHECK(no_warmup.At(1) == 2.0);
  CHECK(no_warmup.At(3) == Approx(1.0));
}

TEST_CASE("bad lr schedules are INVALID_ARGUMENT naming the field") {
  CHECK(LrSchedule{LrSchedule::Kind::kCosine, 0.0, 0, 0.0, 10}.Validate().message().find("lr") !=
        std::string::npos);
  CHECK(LrSchedule{LrSchedule::Kind::kCosine, 1.0, 0, 2.0, 10}.Validate().message().find(
            "min_lr") != std::string::npos);
  CHECK(LrSchedule{LrSchedule::Kind::kCosine, 1.0, 11, 0.0, 10}.Validate().message().find(
            "warmup") != std::string::npos);
  CHECK(ParseLrScheduleKind("cosine").value() == LrSchedule::Kind::kCosine);
  CHECK(ParseLrScheduleKind("step").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rannc
