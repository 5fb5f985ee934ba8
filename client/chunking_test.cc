#include "client/chunking.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) % 251);
  return s;
}

TEST_CASE("SplitBytes covers the input with bounded pieces", "[chunking]") {
  CHECK(SplitBytes("", 4).empty());
  for (size_t n : {1u, 3u, 4u, 5u, 12u, 13u}) {
    const std::string bytes = Pattern(n);
    std::vector<std::string_view> pieces = SplitBytes(bytes, 4);
    CHECK(pieces.size() == (n + 3) / 4);
    std::string joined;
    for (std::string_view p : pieces) {
      CHECK(p.size() <= 4);
      CHECK(!p.empty());
      joined.append(p);
    }
    CHECK(joined == bytes);
  }
}

TEST_CASE("ToStateDictChunks splits a tensor by offset", "[chunking]") {
  HostTensor t{v1::FLOAT32, {5, 2}, Pattern(40)};
  std::vector<v1::StateDictChunk> chunks = ToStateDictChunks("w", t, true, 16);
  REQUIRE(chunks.size() == 3);
  uint64_t offset = 0;
  for (const v1::StateDictChunk& c : chunks) {
    CHECK(c.name() == "w");
    CHECK(c.dtype() == v1::FLOAT32);
    CHECK(c.shape_size() == 2);
    CHECK(c.total_bytes() == 40);
    CHECK(c.is_buffer());
    CHECK(c.offset() == offset);
    CHECK(c.data().size() <= 16);
    CHECK(c.data() == t.data.substr(offset, c.data().size()));
    offset += c.data().size();
  }
  CHECK(offset == 40);

  HostTensor empty{v1::INT64, {0, 3}, ""};
  std::vector<v1::StateDictChunk> none = ToStateDictChunks("e", empty, false, 16);
  REQUIRE(none.size() == 1);
  CHECK(none[0].total_bytes() == 0);
  CHECK(none[0].shape_size() == 2);
}

TEST_CASE("HostStateDictAssembler rebuilds interleaved tensors", "[chunking]") {
  HostTensor a{v1::FLOAT32, {7}, Pattern(28)};
  HostTensor b{v1::INT64, {2, 3}, Pattern(48).substr(0, 48)};
  HostTensor c{v1::FLOAT32, {0}, ""};
  std::vector<v1::StateDictChunk> ca = ToStateDictChunks("a", a, false, 8);
  std::vector<v1::StateDictChunk> cb = ToStateDictChunks("b", b, true, 10);
  std::vector<v1::StateDictChunk> cc = ToStateDictChunks("c", c, false, 10);
  HostStateDictAssembler assembler;
  for (size_t i = 0; i < std::max(ca.size(), cb.size()); ++i) {
    if (i < ca.size()) REQUIRE(assembler.Add(ca[i]).ok());
    if (i < cb.size()) REQUIRE(assembler.Add(cb[i]).ok());
  }
  REQUIRE(assembler.Add(cc[0]).ok());
  CHECK(assembler.buffers() == std::set<std::string>{"b"});
  absl::StatusOr<NamedTensors> out = std::move(assembler).Finish();
  REQUIRE(out.ok());
  REQUIRE(out->size() == 3);
  CHECK(out->at("a").data == a.data);
  CHECK(out->at("a").shape == a.shape);
  CHECK(out->at("b").data == b.data);
  CHECK(out->at("b").dtype == v1::INT64);
  CHECK(out->at("c").data.empty());
}

TEST_CASE("HostStateDictAssembler rejects broken streams", "[chunking]") {
  HostTensor a{v1::FLOAT32, {4}, Pattern(16)};
  std::vector<v1::StateDictChunk> chunks = ToStateDictChunks("a", a, false, 4);
  REQUIRE(chunks.size() == 4);

  SECTION("a gap") {
    HostStateDictAssembler s;
    REQUIRE(s.Add(chunks[0]).ok());
    CHECK(s.Add(chunks[2]).code() == absl::StatusCode::kDataLoss);
  }
  SECTION("a truncated stream") {
    HostStateDictAssembler s;
    REQUIRE(s.Add(chunks[0]).ok());
    REQUIRE(s.Add(chunks[1]).ok());
    CHECK(std::move(s).Finish().status().code() == absl::StatusCode::kDataLoss);
  }
  SECTION("chunks that disagree on the shape") {
    HostStateDictAssembler s;
    REQUIRE(s.Add(chunks[0]).ok());
    v1::StateDictChunk other = chunks[1];
    other.set_shape(0, 2);
    other.add_shape(2);
    CHECK(!s.Add(other).ok());
  }
  SECTION("a size that does not match dtype and shape") {
    HostStateDictAssembler s;
    v1::StateDictChunk wrong = chunks[0];
    wrong.set_total_bytes(12);
    CHECK(!s.Add(wrong).ok());
  }
  SECTION("more bytes than announced") {
    HostStateDictAssembler s;
    v1::StateDictChunk big = chunks[0];
    big.set_data(Pattern(20));
    CHECK(!s.Add(big).ok());
  }
}

}  // namespace
}  // namespace rannc
