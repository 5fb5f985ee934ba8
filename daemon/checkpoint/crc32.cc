#include "daemon/checkpoint/crc32.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RANNC_CRC32_CLMUL 1
#include <immintrin.h>
#endif

namespace rannc {
namespace checkpoint {
namespace {

// Runs the register over `size` bytes: the CRC's state between its initial and final
// complement.
uint32_t TableRegister(const uint8_t* p, size_t size, uint32_t reg) {
  // Slicing-by-8: eight bytes a round through eight tables (table[0] is the byte-wise one).
  static const auto* tables = [] {
    auto* t = new std::array<std::array<uint32_t, 256>, 8>();
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      (*t)[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int k = 1; k < 8; ++k) {
        (*t)[k][i] = ((*t)[k - 1][i] >> 8) ^ (*t)[0][(*t)[k - 1][i] & 0xFF];
      }
    }
    return t;
  }();
  const auto& t = *tables;
  while (size >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= reg;  // little-endian hosts
    reg = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) reg = t[0][(reg ^ *p++) & 0xFF] ^ (reg >> 8);
  return reg;
}

#ifdef RANNC_CRC32_CLMUL

// Folding constants for the reflected polynomial P = 0x1DB710641 (bit-reflected, shifted left
// by one, as the reflected domain needs): x^k mod P for the distances each fold spans.
constexpr uint64_t kFold512Lo = 0x154442bd4;  // x^(4*128+32) mod P: four lanes, 64 bytes on
constexpr uint64_t kFold512Hi = 0x1c6e41596;  // x^(4*128-32) mod P
constexpr uint64_t kFold128Lo = 0x1751997d0;  // x^(128+32) mod P: one lane, 16 bytes on
constexpr uint64_t kFold128Hi = 0x0ccaa009e;  // x^(128-32) mod P
constexpr uint64_t kFold64 = 0x163cd6124;     // x^64 mod P: 64 bits down to 32
constexpr uint64_t kPoly = 0x1db710641;       // P itself, and Barrett's quotient of x^64 by P
constexpr uint64_t kBarrettMu = 0x1f7011641;

__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i lane, __m128i k) {
  // lane.lo * k.lo + lane.hi * k.hi: the lane moved forward by the distance k is for.
  return _mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x00), _mm_clmulepi64_si128(lane, k, 0x11));
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i Load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// The register over `size` bytes, size >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) uint32_t FoldRegister(const uint8_t* p, size_t size,
                                                                uint32_t reg) {
  __m128i x0 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(static_cast<int>(reg)));
  __m128i x1 = Load(p + 16), x2 = Load(p + 32), x3 = Load(p + 48);
  p += 64;
  size -= 64;
  const __m128i k512 = _mm_set_epi64x(kFold512Hi, kFold512Lo);
  while (size >= 64) {
    x0 = _mm_xor_si128(Fold(x0, k512), Load(p));
    x1 = _mm_xor_si128(Fold(x1, k512), Load(p + 16));
    x2 = _mm_xor_si128(Fold(x2, k512), Load(p + 32));
    x3 = _mm_xor_si128(Fold(x3, k512), Load(p + 48));
    p += 64;
    size -= 64;
  }
  // The four lanes into one, then the 16-byte blocks left.
  const __m128i k128 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  x0 = _mm_xor_si128(Fold(x0, k128), x1);
  x0 = _mm_xor_si128(Fold(x0, k128), x2);
  x0 = _mm_xor_si128(Fold(x0, k128), x3);
  while (size >= 16) {
    x0 = _mm_xor_si128(Fold(x0, k128), Load(p));
    p += 16;
    size -= 16;
  }
  // 128 bits to 64: the low half moved past the high one.
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(x0, k128, 0x10));
  // 64 bits to 32.
  const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 4),
                     _mm_clmulepi64_si128(_mm_and_si128(x0, low32),
                                          _mm_set_epi64x(0, kFold64), 0x00));
  // Barrett's reduction modulo P.
  const __m128i poly = _mm_set_epi64x(kBarrettMu, kPoly);
  __m128i q = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), poly, 0x10);
  q = _mm_clmulepi64_si128(_mm_and_si128(q, low32), poly, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x0, q), 1));
}

bool CpuFolds() {
  static const bool folds = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return folds;
}

#endif  // RANNC_CRC32_CLMUL

}  // namespace

uint32_t Crc32Tables(const char* data, size_t size, uint32_t crc) {
  return ~TableRegister(reinterpret_cast<const uint8_t*>(data), size, ~crc);
}

bool Crc32Folds() {
#ifdef RANNC_CRC32_CLMUL
  return CpuFolds();
#else
  return false;
#endif
}

uint32_t Crc32(const char* data, size_t size, uint32_t crc) {
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  uint32_t reg = ~crc;
#ifdef RANNC_CRC32_CLMUL
  if (size >= 256 && CpuFolds()) {
    const size_t folded = size & ~size_t{15};
    reg = FoldRegister(p, folded, reg);
    p += folded;
    size -= folded;
  }
#endif
  return ~TableRegister(p, size, reg);
}

}  // namespace checkpoint
}  // namespace rannc
