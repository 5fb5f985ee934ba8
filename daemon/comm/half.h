// Conversions between float and the 16-bit float formats the data plane carries (IEEE
// binary16 "float16" and bfloat16), for backends that reduce on the CPU and for tests that fill
// or read such buffers. Reductions go through float: convert, combine, convert back.
//
//   uint16_t h = FloatToFloat16(1.5f);      // 0x3E00
//   float f = Float16ToFloat(h);            // 1.5f
//   uint16_t b = FloatToBFloat16(f);        // rounds to nearest, ties to even
//
// Pure functions; thread-safe.
#ifndef RANNC_DAEMON_COMM_HALF_H_
#define RANNC_DAEMON_COMM_HALF_H_

#include <cstdint>

namespace rannc {
namespace comm {

float Float16ToFloat(uint16_t h);
// Rounds to nearest even; overflows to infinity; keeps NaN a (quiet) NaN.
uint16_t FloatToFloat16(float f);
float BFloat16ToFloat(uint16_t b);
// Rounds to nearest even; keeps NaN a (quiet) NaN.
uint16_t FloatToBFloat16(float f);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_HALF_H_
