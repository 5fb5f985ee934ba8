#include "daemon/server/client_ranks.h"

#include <chrono>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

std::function<absl::StatusOr<int>(std::vector<int>&)> Sum() {
  return [](std::vector<int>& all) -> absl::StatusOr<int> {
    int sum = 0;
    for (int v : all) sum += v;
    return sum;
  };
}

TEST_CASE("Client ranks meet, and every rank gets the one result", "[server]") {
  ClientRendezvous ranks(3, std::chrono::seconds(10));
  std::vector<absl::StatusOr<int>> got(3, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { got[r] = ranks.Meet<int, int>("op", r, r + 1, Sum()); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::StatusOr<int>& g : got) {
    REQUIRE(g.ok());
    CHECK(*g == 6);
  }
  CHECK(ranks.rounds_held() == 0);
}

TEST_CASE("A round that times out keeps nothing once its ranks have their answer",
          "[server]") {
  // Noticed fixing what //fuzz:rpc found: a ClientBarrier whose other ranks never came kept its
  // round (a slot per rank) for the daemon's life.
  ClientRendezvous ranks(4, std::chrono::milliseconds(50));
  absl::StatusOr<int> alone = ranks.Meet<int, int>("op", 1, 7, Sum());
  CHECK(alone.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(ranks.rounds_held() == 0);
  // A late rank starts a round of its own and times out there too.
  absl::StatusOr<int> late = ranks.Meet<int, int>("op", 0, 7, Sum());
  CHECK(late.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(ranks.rounds_held() == 0);
}

}  // namespace
}  // namespace rannc
