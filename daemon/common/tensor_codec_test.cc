#include "daemon/common/tensor_codec.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("DecodeTensor checks the bytes against dtype and shape", "[tensor_codec]") {
  const at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3});
  v1::Tensor proto;
  REQUIRE(EncodeTensor(x, &proto).ok());
  absl::StatusOr<at::Tensor> back = DecodeTensor(proto, "input 'x'");
  REQUIRE(back.ok());
  CHECK(at::equal(*back, x));

  proto.mutable_data()->resize(20);
  CHECK(DecodeTensor(proto, "input 'x'").status() ==
        absl::InvalidArgumentError(
            "input 'x': 20 bytes of data for float32[2, 3], which needs 24"));
  proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  CHECK(DecodeTensor(proto, "input 'x'").status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("StateDictAssembler rebuilds what EncodeStateChunks sends", "[tensor_codec]") {
  const std::map<std::string, at::Tensor> sent = {
      {"w", at::randn({33, 5}).to(at::kBFloat16)},
      {"b", at::arange(7, at::kLong)},
      {"empty", at::empty({0, 4})},
  };
  std::vector<v1::StateDictChunk> chunks;
  for (const auto& [name, t] : sent) {
    REQUIRE(EncodeStateChunks(name, t, name == "b", 16, [&](const v1::StateDictChunk& c) {
              chunks.push_back(c);
              return true;
            }).ok());
  }
  CHECK(chunks.size() > sent.size());

  StateDictAssembler assembler;
  for (const v1::StateDictChunk& c : chunks) REQUIRE(assembler.Add(c).ok());
  absl::StatusOr<std::map<std::string, at::Tensor>> got = assembler.Finish();
  REQUIRE(got.ok());
  REQUIRE(got->size() == sent.size());
  for (const auto& [name, t] : sent) {
    CHECK(got->at(name).scalar_type() == t.scalar_type());
    CHECK(got->at(name).sizes() == t.sizes());
    CHECK(at::equal(got->at(name), t));
  }
}

TEST_CASE("StateDictAssembler refuses a broken stream as INVALID_ARGUMENT", "[tensor_codec]") {
  std::vector<v1::StateDictChunk> chunks;
  REQUIRE(EncodeStateChunks("w", at::ones({8}), false, 8, [&](const v1::StateDictChunk& c) {
            chunks.push_back(c);
            return true;
          }).ok());
  REQUIRE(chunks.size() == 4);

  SECTION("incomplete") {
    StateDictAssembler assembler;
    REQUIRE(assembler.Add(chunks[0]).ok());
    CHECK(assembler.Finish().status() ==
          absl::InvalidArgumentError(
              "state_dict stream ended with incomplete entries: 'w' (8 of 32 bytes)"));
  }
  SECTION("out of order") {
    StateDictAssembler assembler;
    REQUIRE(assembler.Add(chunks[0]).ok());
    CHECK(assembler.Add(chunks[2]).code() == absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace rannc
