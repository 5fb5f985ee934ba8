#include "daemon/comm/half.h"

#include <cmath>
#include <limits>

#include <catch2/catch.hpp>

namespace rannc {
namespace comm {
namespace {

TEST_CASE("float16: exact values, rounding, subnormals, specials", "[comm]") {
  CHECK(FloatToFloat16(0.0f) == 0x0000);
  CHECK(FloatToFloat16(-0.0f) == 0x8000);
  CHECK(FloatToFloat16(1.0f) == 0x3C00);
  CHECK(FloatToFloat16(1.5f) == 0x3E00);
  CHECK(FloatToFloat16(-2.0f) == 0xC000);
  CHECK(FloatToFloat16(65504.0f) == 0x7BFF);
  CHECK(FloatToFloat16(65520.0f) == 0x7C00);  // halfway past the largest: ties to infinity
  CHECK(FloatToFloat16(1e6f) == 0x7C00);
  CHECK(FloatToFloat16(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(std::isnan(Float16ToFloat(FloatToFloat16(std::nanf("")))));
  // 1 + 2^-11 is halfway between 1 and the next float16: ties to even (1).
  CHECK(FloatToFloat16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);
  CHECK(FloatToFloat16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);
  // Smallest subnormal 2^-24 and smallest normal 2^-14.
  CHECK(FloatToFloat16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(FloatToFloat16(std::ldexp(1.0f, -26)) == 0x0000);
  CHECK(FloatToFloat16(std::ldexp(1.0f, -14)) == 0x0400);
  CHECK(Float16ToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(Float16ToFloat(0x0400) == std::ldexp(1.0f, -14));
  CHECK(Float16ToFloat(0x7C00) == std::numeric_limits<float>::infinity());
  // Every finite float16 survives a round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00u) == 0x7C00u) continue;
    const uint16_t back = FloatToFloat16(Float16ToFloat(static_cast<uint16_t>(h)));
    if (back != h) FAIL("float16 0x" << std::hex << h << " came back as 0x" << back);
  }
}

TEST_CASE("bfloat16: exact values, rounding, specials", "[comm]") {
  CHECK(FloatToBFloat16(1.0f) == 0x3F80);
  CHECK(BFloat16ToFloat(0x3F80) == 1.0f);
  CHECK(FloatToBFloat16(-3.0f) == 0xC040);
  // 1 + 2^-8 is halfway between 1 and the next bfloat16: ties to even.
  CHECK(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);
  CHECK(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
  CHECK(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  CHECK(FloatToBFloat16(std::numeric_limits<float>::infinity()) == 0x7F80);
  for (int i = -256; i <= 256; ++i) {
    CHECK(BFloat16ToFloat(FloatToBFloat16(static_cast<float>(i))) == static_cast<float>(i));
  }
}

}  // namespace
}  // namespace comm
}  // namespace rannc
