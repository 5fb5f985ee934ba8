#include "daemon/common/chunk_assembler.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) % 251);
  return s;
}

v1::StateDictChunk Chunk(const std::string& name, v1::DType dtype, std::vector<int64_t> shape,
                         uint64_t total, uint64_t offset, std::string data) {
  v1::StateDictChunk c;
  c.set_name(name);
  c.set_dtype(dtype);
  c.mutable_shape()->Add(shape.begin(), shape.end());
  c.set_total_bytes(total);
  c.set_offset(offset);
  c.set_data(std::move(data));
  return c;
}

// The chunks of `bytes` as one float32 entry, `piece` bytes each (one chunk when empty).
std::vector<v1::StateDictChunk> Split(const std::string& name, const std::string& bytes,
                                      size_t piece) {
  const std::vector<int64_t> shape = {static_cast<int64_t>(bytes.size() / 4)};
  std::vector<v1::StateDictChunk> chunks;
  size_t offset = 0;
  do {
    const std::string data = bytes.substr(offset, piece);
    chunks.push_back(Chunk(name, v1::FLOAT32, shape, bytes.size(), offset, data));
    offset += data.size();
  } while (offset < bytes.size());
  return chunks;
}

// Buffers as a caller keeps them, and how often each was allocated.
struct Buffers {
  std::map<std::string, std::string> bytes;
  std::map<std::string, int> allocations;
  ChunkAssembler::Allocate fn() {
    return [this](const ChunkAssembler::Entry& e) -> absl::StatusOr<char*> {
      ++allocations[e.name];
      std::string& b = bytes[e.name];
      b.resize(e.total_bytes);
      return b.data();
    };
  }
};

TEST_CASE("ChunkAssembler copies interleaved chunks into the caller's buffers", "[chunks]") {
  Buffers buffers;
  ChunkAssembler assembler(absl::StatusCode::kInvalidArgument, buffers.fn());
  const std::string a = Pattern(28), b = Pattern(48);
  std::vector<v1::StateDictChunk> ca = Split("a", a, 8), cb = Split("b", b, 10);
  for (v1::StateDictChunk& c : cb) c.set_is_buffer(true);
  for (size_t i = 0; i < std::max(ca.size(), cb.size()); ++i) {
    if (i < ca.size()) REQUIRE(assembler.Add(ca[i]).ok());
    if (i < cb.size()) REQUIRE(assembler.Add(cb[i]).ok());
  }
  REQUIRE(assembler.Add(Chunk("empty", v1::INT64, {0, 3}, 0, 0, "")).ok());
  REQUIRE(assembler.Finish().ok());
  CHECK(buffers.bytes.at("a") == a);
  CHECK(buffers.bytes.at("b") == b);
  CHECK(buffers.bytes.at("empty").empty());
  CHECK(buffers.allocations == std::map<std::string, int>{{"a", 1}, {"b", 1}, {"empty", 1}});
  CHECK(assembler.buffers() == std::set<std::string>{"b"});
}

TEST_CASE("ChunkAssembler refuses a first chunk it cannot trust, before allocating", "[chunks]") {
  Buffers buffers;
  ChunkAssembler assembler(absl::StatusCode::kDataLoss, buffers.fn());
  auto refused = [&](const v1::StateDictChunk& c) {
    absl::Status s = assembler.Add(c);
    CHECK(s.code() == absl::StatusCode::kDataLoss);
    return std::string(s.message());
  };
  CHECK(refused(Chunk("w", v1::FLOAT32, {2}, 8, 4, "abcd")) ==
        "state_dict entry 'w': chunk at offset 4, expected 0");
  CHECK(refused(Chunk("w", v1::DTYPE_UNSPECIFIED, {2}, 8, 0, "")) ==
        "state_dict entry 'w': unknown tensor dtype 0");
  CHECK(refused(Chunk("w", v1::FLOAT32, {-2, 3}, 0, 0, "")) ==
        "state_dict entry 'w': negative dimension in shape [-2, 3]");
  CHECK(refused(Chunk("w", v1::FLOAT32, {int64_t{1} << 40, int64_t{1} << 40}, 0, 0, "")) ==
        "state_dict entry 'w': shape [1099511627776, 1099511627776] has too many elements");
  CHECK(refused(Chunk("w", v1::FLOAT32, {2, 3}, 12, 0, "")) ==
        "state_dict entry 'w': 12 bytes for float32[2, 3], which needs 24");
  CHECK(refused(Chunk("w", v1::FLOAT32, {2}, 8, 0, Pattern(12))) ==
        "state_dict entry 'w': 12 bytes received, more than its 8");
  CHECK(buffers.allocations.empty());
}

TEST_CASE("ChunkAssembler checks later chunks against their entry's first", "[chunks]") {
  Buffers buffers;
  ChunkAssembler assembler(absl::StatusCode::kInvalidArgument, buffers.fn());
  std::vector<v1::StateDictChunk> chunks = Split("a", Pattern(16), 4);
  REQUIRE(chunks.size() == 4);
  REQUIRE(assembler.Add(chunks[0]).ok());
  auto refused = [&](const v1::StateDictChunk& c) {
    absl::Status s = assembler.Add(c);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };

  SECTION("a gap") {
    CHECK(refused(chunks[2]) == "state_dict entry 'a': chunk at offset 8, expected 4");
  }
  SECTION("the entry again") {
    CHECK(refused(chunks[0]) == "state_dict entry 'a' sent twice");
  }
  SECTION("another shape") {
    v1::StateDictChunk other = chunks[1];
    other.set_shape(0, 2);
    other.add_shape(2);
    CHECK(refused(other) == "state_dict entry 'a': chunks disagree on dtype, shape or size "
                            "(float32[2, 2] in 16 bytes, first float32[4] in 16 bytes)");
  }
  SECTION("past the end") {
    v1::StateDictChunk big = chunks[1];
    big.set_data(Pattern(16));
    CHECK(refused(big) == "state_dict entry 'a': 20 bytes received, more than its 16");
  }
  SECTION("a truncated stream") {
    REQUIRE(assembler.Add(chunks[1]).ok());
    REQUIRE(assembler.Add(Chunk("b", v1::INT8, {3}, 3, 0, "x")).ok());
    absl::Status s = assembler.Finish();
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(s.message() == "state_dict stream ended with incomplete entries: 'a' (8 of 16 bytes), "
                         "'b' (1 of 3 bytes)");
  }
  SECTION("a complete entry, even an empty one, comes once") {
    for (size_t i = 1; i < chunks.size(); ++i) REQUIRE(assembler.Add(chunks[i]).ok());
    CHECK(refused(chunks[0]) == "state_dict entry 'a' sent twice");
    const v1::StateDictChunk empty = Chunk("e", v1::FLOAT32, {0}, 0, 0, "");
    REQUIRE(assembler.Add(empty).ok());
    CHECK(refused(empty) == "state_dict entry 'e' sent twice");
    CHECK(assembler.Finish().ok());
  }
}

TEST_CASE("ChunkAssembler returns the allocator's error as it is", "[chunks]") {
  ChunkAssembler assembler(absl::StatusCode::kInvalidArgument,
                           [](const ChunkAssembler::Entry& e) -> absl::StatusOr<char*> {
                             CHECK(e.name == "w");
                             CHECK(e.dtype == v1::FLOAT32);
                             CHECK(e.shape == std::vector<int64_t>{2});
                             CHECK(e.total_bytes == 8);
                             return absl::ResourceExhaustedError("no room");
                           });
  absl::Status s = assembler.Add(Chunk("w", v1::FLOAT32, {2}, 8, 0, "abcd"));
  CHECK(s == absl::ResourceExhaustedError("no room"));
  CHECK(assembler.Finish().ok());  // the refused entry was never started
}

}  // namespace
}  // namespace rannc
