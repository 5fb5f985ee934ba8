// The CRC-32 that checkpoint manifests keep for each tensor file: IEEE 802.3's, as zlib and zip
// compute it (reflected polynomial 0xEDB88320; "123456789" -> 0xCBF43926).
//
// Where the CPU multiplies without carries (x86-64's PCLMULQDQ), 64 bytes a round are folded
// into four 128-bit lanes (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
// Instruction", 2009), some 10x the speed of tables: a checkpoint's bytes are checksummed on
// write and on every resume, and the tables took longer than the disk. Elsewhere, and for the
// last bytes, slicing-by-8 tables.
//
//   uint32_t crc = Crc32(bytes.data(), bytes.size());
//   crc = Crc32(more.data(), more.size(), crc);  // continues: the CRC of both, back to back
//
// Pure functions; thread-safe.
#ifndef RANNC_DAEMON_CHECKPOINT_CRC32_H_
#define RANNC_DAEMON_CHECKPOINT_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace rannc {
namespace checkpoint {

// The CRC-32 of `size` bytes, continuing from `crc` (0 to start).
uint32_t Crc32(const char* data, size_t size, uint32_t crc = 0);

// The same through the tables alone: what tests hold the folding to.
uint32_t Crc32Tables(const char* data, size_t size, uint32_t crc = 0);

// Whether Crc32 folds with carry-less multiplication on this CPU.
bool Crc32Folds();

}  // namespace checkpoint
}  // namespace rannc

#endif  // RANNC_DAEMON_CHECKPOINT_CRC32_H_
