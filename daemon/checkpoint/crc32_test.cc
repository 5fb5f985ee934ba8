#include "daemon/checkpoint/crc32.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace rannc {
namespace checkpoint {
namespace {

TEST_CASE("Crc32 is zlib's") {
  const std::string text = "123456789";
  CHECK(Crc32(text.data(), text.size()) == 0xCBF43926u);
  CHECK(Crc32Tables(text.data(), text.size()) == 0xCBF43926u);
  CHECK(Crc32(nullptr, 0) == 0u);
  // zlib's crc32 of 1 MiB of zeros.
  const std::vector<char> zeros(1 << 20, 0);
  CHECK(Crc32(zeros.data(), zeros.size()) == 0xA738EA1Cu);
}

TEST_CASE("folding agrees with the tables at every length, alignment and starting CRC") {
  INFO("this CPU folds: " << Crc32Folds());
  std::mt19937_64 rng(7);
  std::vector<char> bytes(1 << 16);
  for (char& c : bytes) c = static_cast<char>(rng());
  int differ = 0;
  for (size_t size = 0; size < 1100; ++size) {  // every tail and lane count around 64 and 256
    const size_t offset = size % 61;
    const uint32_t start = size % 3 == 0 ? 0u : static_cast<uint32_t>(rng());
    if (Crc32(bytes.data() + offset, size, start) !=
        Crc32Tables(bytes.data() + offset, size, start)) {
      ++differ;
    }
  }
  for (int i = 0; i < 200; ++i) {
    const size_t offset = rng() % 64;
    const size_t size = rng() % (bytes.size() - offset);
    if (Crc32(bytes.data() + offset, size) != Crc32Tables(bytes.data() + offset, size)) ++differ;
  }
  CHECK(differ == 0);
}

TEST_CASE("a CRC continues across pieces") {
  std::mt19937_64 rng(11);
  std::vector<char> bytes(100000);
  for (char& c : bytes) c = static_cast<char>(rng());
  const uint32_t whole = Crc32(bytes.data(), bytes.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{63}, size_t{300}, size_t{65536}}) {
    CHECK(Crc32(bytes.data() + cut, bytes.size() - cut, Crc32(bytes.data(), cut)) == whole);
  }
}

}  // namespace
}  // namespace checkpoint
}  // namespace rannc
