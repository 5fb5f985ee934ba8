// The checkpoint files' CRC-32 (daemon/checkpoint/crc32.h), folded with carry-less
// multiplication against the slicing-by-8 tables, on one core (docs/benchmarks.md):
//   bazel run //benchmarks:crc32_bench [-- MIB]      (default 256 MiB, best of 5)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "daemon/checkpoint/crc32.h"

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  std::vector<char> bytes(mib << 20);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    const uint64_t r = rng();
    std::copy_n(reinterpret_cast<const char*>(&r), 8, bytes.data() + i);
  }
  using rannc::checkpoint::Crc32;
  using rannc::checkpoint::Crc32Tables;
  uint32_t crcs[2] = {0, 0};
  double best[2] = {1e30, 1e30};
  for (int rep = 0; rep < 5; ++rep) {
    for (int folded = 0; folded < 2; ++folded) {
      const auto start = std::chrono::steady_clock::now();
      crcs[folded] = folded ? Crc32(bytes.data(), bytes.size())
                            : Crc32Tables(bytes.data(), bytes.size());
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      best[folded] = std::min(best[folded], took.count());
    }
  }
  std::printf("%zu MiB, one core, best of 5: tables %.2f GB/s, %s %.2f GB/s (%.1fx); CRCs %s\n",
              mib, bytes.size() / best[0] / 1e9,
              rannc::checkpoint::Crc32Folds() ? "folded" : "folded (unavailable: tables)",
              bytes.size() / best[1] / 1e9, best[0] / best[1],
              crcs[0] == crcs[1] ? "agree" : "DIFFER");
  return crcs[0] == crcs[1] ? 0 : 1;
}
