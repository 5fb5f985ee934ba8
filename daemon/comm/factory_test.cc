#include "daemon/comm/factory.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace comm {
namespace {

using Catch::Contains;

TEST_CASE("MakeCommunicator: invalid group options", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  auto code = [](const GroupOptions& options) {
    return MakeCommunicator(Backend::kFake, options).status().code();
  };
  auto message = [](const GroupOptions& options) {
    return std::string(MakeCommunicator(Backend::kFake, options).status().message());
  };
  CHECK(code({nullptr, "g", 0, 1}) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(message({nullptr, "g", 0, 1}), Contains("store is null"));
  CHECK(code({store.get(), "", 0, 1}) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(message({store.get(), "", 0, 1}), Contains("group is empty"));
  CHECK(code({store.get(), "g", -1, 2}) == absl::StatusCode::kInvalidArgument);
  CHECK(code({store.get(), "g", 2, 2}) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(message({store.get(), "g", 2, 2}), Contains("rank 2 is outside group g of size 2"));
  CHECK(code({store.get(), "g", 0, 0}) == absl::StatusCode::kInvalidArgument);
  // Validation comes before the backend: UCX gets the same errors.
  CHECK(MakeCommunicator(Backend::kUcx, {store.get(), "g", 3, 2}).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("MakeCommunicator: UCX is built in; NCCL needs a CUDA build", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  absl::StatusOr<std::unique_ptr<Communicator>> ucx =
      MakeCommunicator(Backend::kUcx, {store.get(), "factory/ucx", 0, 1});
  REQUIRE(ucx.ok());
  CHECK(std::string((*ucx)->backend()) == "ucx");
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      MakeCommunicator(Backend::kNccl, {store.get(), "g", 0, 1});
  CHECK(BackendBuiltIn(Backend::kUcx));
  CHECK(BackendBuiltIn(Backend::kFake));
  if (BackendBuiltIn(Backend::kNccl)) {
    // A CUDA build tries NCCL: a group of one on the current GPU (an error only without one).
    CHECK(nccl.status().code() != absl::StatusCode::kUnimplemented);
    if (nccl.ok()) CHECK(std::string((*nccl)->backend()) == "nccl");
  } else {
    CHECK(nccl.status().code() == absl::StatusCode::kUnimplemented);
    CHECK_THAT(std::string(nccl.status().message()), Contains("CUDA"));
  }
}

TEST_CASE("MakeCommunicator: the fake backend for a group of one", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeCommunicator(Backend::kFake, {store.get(), "factory/one", 0, 1});
  REQUIRE(c.ok());
  CHECK(std::string((*c)->backend()) == "fake");
  CHECK((*c)->rank() == 0);
  CHECK((*c)->size() == 1);
  float x = 3;
  CHECK((*c)->AllReduce(Buffer::Of(&x, 1))->Wait(std::chrono::seconds(10)).ok());
  CHECK(x == 3);
}

}  // namespace
}  // namespace comm
}  // namespace rannc
