#include "daemon/comm/store.h"

#include <thread>

#include <catch2/catch.hpp>

namespace rannc {
namespace comm {
namespace {

using std::chrono::milliseconds;

TEST_CASE("InMemoryStore: set, get, add, and waiting for another thread", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  REQUIRE(store->Set("a", "1").ok());
  absl::StatusOr<std::string> a = store->Get("a", milliseconds(10));
  REQUIRE(a.ok());
  CHECK(*a == "1");
  CHECK(*store->Add("n", 2) == 2);
  CHECK(*store->Add("n", 3) == 5);

  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(20));
    (void)store->Set("b", "late");
  });
  absl::StatusOr<std::string> b = store->Get("b", std::chrono::seconds(10));
  later.join();
  REQUIRE(b.ok());
  CHECK(*b == "late");
  CHECK(store->Wait({"a", "b"}, milliseconds(10)).ok());
}

TEST_CASE("InMemoryStore: a missing key times out naming it", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  absl::StatusOr<std::string> missing = store->Get("nobody", milliseconds(20));
  CHECK(missing.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("nobody"));
}

}  // namespace
}  // namespace comm
}  // namespace rannc
