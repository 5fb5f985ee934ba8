#include "client/token_data.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <set>

namespace rannc {
namespace {

std::string TempPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/" + name + "_" + std::to_string(::getpid());
}

template <typename T>
std::string WriteTokens(const std::string& name, const std::vector<T>& tokens) {
  const std::string path = TempPath(name);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
  return path;
}

TEST_CASE("TokenFile reads each token width", "[token_data]") {
  const std::string u8 = WriteTokens<uint8_t>("u8", {0, 7, 255});
  const std::string u16 = WriteTokens<uint16_t>("u16", {1, 50000, 3});
  const std::string i32 = WriteTokens<int32_t>("i32", {-5, 100000});
  absl::StatusOr<TokenFile> a = TokenFile::Open(u8, "uint8");
  absl::StatusOr<TokenFile> b = TokenFile::Open(u16, "uint16");
  absl::StatusOr<TokenFile> c = TokenFile::Open(i32, "int32");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(c.ok());
  CHECK(a->size() == 3);
  CHECK(a->at(2) == 255);
  CHECK(b->size() == 3);
  CHECK(b->at(1) == 50000);
  CHECK(c->size() == 2);
  CHECK(c->at(0) == -5);
  CHECK(c->at(1) == 100000);
  CHECK(c->MaxToken() == 100000);
  absl::StatusOr<TokenFile> d = TokenFile::Open(i32, "uint32");
  REQUIRE(d.ok());
  CHECK(d->at(0) == 4294967291);  // -5's bits, unsigned

  TokenFile moved = *std::move(b);
  CHECK(moved.at(1) == 50000);
}

TEST_CASE("TokenFile::Open rejects bad input", "[token_data]") {
  const std::string odd = WriteTokens<uint8_t>("odd", {1, 2, 3});
  CHECK(TokenFile::Open(odd, "uint16").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(TokenFile::Open(odd, "float").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(TokenFile::Open(odd + ".missing", "uint8").status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("SampleTokenBatch draws next-token windows from the whole file", "[token_data]") {
  // Token i is i, so each window must be consecutive and its target shifted by one.
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  absl::StatusOr<TokenFile> file = TokenFile::Open(WriteTokens("seq", tokens), "uint16");
  REQUIRE(file.ok());
  std::mt19937_64 rng(1);
  std::set<int64_t> starts;
  for (int round = 0; round < 50; ++round) {
    TokenBatch batch = SampleTokenBatch(*file, rng, 4, 16);
    CHECK(batch.input_ids.shape == std::vector<int64_t>{4, 16});
    CHECK(batch.targets.shape == std::vector<int64_t>{4, 16});
    std::vector<int64_t> in = *batch.input_ids.ToVector<int64_t>();
    std::vector<int64_t> tg = *batch.targets.ToVector<int64_t>();
    for (int b = 0; b < 4; ++b) {
      starts.insert(in[b * 16]);
      CHECK(in[b * 16] >= 0);
      CHECK(tg[b * 16 + 15] <= 999);
      for (int t = 0; t < 16; ++t) {
        CHECK(tg[b * 16 + t] == in[b * 16 + t] + 1);
        if (t > 0) CHECK(in[b * 16 + t] == in[b * 16 + t - 1] + 1);
      }
    }
  }
  CHECK(starts.size() > 150);  // 200 draws over 984 positions: nearly all distinct

  // A file of exactly seq + 1 tokens has one window.
  absl::StatusOr<TokenFile> tight =
      TokenFile::Open(WriteTokens<uint8_t>("tight", {9, 8, 7}), "uint8");
  REQUIRE(tight.ok());
  TokenBatch one = SampleTokenBatch(*tight, rng, 2, 2);
  CHECK(*one.input_ids.ToVector<int64_t>() == std::vector<int64_t>{9, 8, 9, 8});
  CHECK(*one.targets.ToVector<int64_t>() == std::vector<int64_t>{8, 7, 8, 7});
}

}  // namespace
}  // namespace rannc
