#include "daemon/comm/grpc_store.h"

#include <chrono>
#include <thread>

#include "daemon/comm/process_testing.h"

namespace rannc {
namespace comm {
namespace {

using std::chrono::milliseconds;

using testing::StoreServer;

TEST_CASE("The gRPC store sets, gets, adds and waits like the in-memory one", "[comm]") {
  StoreServer server;
  std::unique_ptr<Store> a = MakeGrpcStore(server.address());
  std::unique_ptr<Store> b = MakeGrpcStore(server.address());
  REQUIRE(a->Set("k", std::string("v\0w", 3)).ok());
  absl::StatusOr<std::string> got = b->Get("k", milliseconds(1000));
  REQUIRE(got.ok());
  CHECK(*got == std::string("v\0w", 3));
  CHECK(*a->Add("n", 2) == 2);
  CHECK(*b->Add("n", 3) == 5);

  // A Get waits for a key set later by another client, across the server's one-second cap.
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(1500));
    (void)a->Set("late", "x");
  });
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> waited = b->Get("late", milliseconds(10000));
  late.join();
  REQUIRE(waited.ok());
  CHECK(*waited == "x");
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));
  CHECK(b->Wait({"k", "late"}, milliseconds(100)).ok());

  absl::StatusOr<std::string> missing = b->Get("never", milliseconds(300));
  CHECK(missing.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::string(missing.status().message()).find("'never'") != std::string::npos);
  absl::Status some = b->Wait({"k", "never"}, milliseconds(300));
  CHECK(some.code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("A gRPC store without its server fails with UNAVAILABLE naming the address", "[comm]") {
  std::string address;
  {
    StoreServer gone;
    address = gone.address();
  }
  std::unique_ptr<Store> store = MakeGrpcStore(address, milliseconds(500));
  const auto start = std::chrono::steady_clock::now();
  absl::Status set = store->Set("k", "v");
  CHECK(set.code() == absl::StatusCode::kUnavailable);
  CHECK(std::string(set.message()).find(address) != std::string::npos);
  CHECK(store->Add("n", 1).status().code() == absl::StatusCode::kUnavailable);
  CHECK(store->Get("k", milliseconds(2000)).status().code() == absl::StatusCode::kUnavailable);
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));
}

}  // namespace
}  // namespace comm
}  // namespace rannc
