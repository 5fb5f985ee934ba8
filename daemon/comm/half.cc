#include "daemon/comm/half.h"

#include <cstring>

namespace rannc {
namespace comm {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return FromBits(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return FromBits(sign);
  // Subnormal float16 values are normal floats: shift the leading 1 into the implicit bit.
  int e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return FromBits(sign | (static_cast<uint32_t>(e) << 23) | ((mantissa & 0x3FFu) << 13));
}

uint16_t FloatToFloat16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // inf or NaN
    return sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504: infinity
  if (abs < 0x38800000u) {
    // Below float16's smallest normal: the result is subnormal (or zero). Add the implicit bit,
    // shift into place, round to nearest even on the dropped bits.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even. A carry
  // out of the mantissa correctly bumps the exponent.
  uint32_t result = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

float BFloat16ToFloat(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

}  // namespace comm
}  // namespace rannc
