#include "daemon/comm/counting.h"

#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "daemon/comm/factory.h"

namespace rannc {
namespace comm {
namespace {

TEST_CASE("CountBytes: sends and collectives are counted once, receives not", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  auto bytes = std::make_shared<std::atomic<uint64_t>>(0);
  std::vector<std::unique_ptr<Communicator>> ranks(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Communicator>> c =
          MakeCommunicator(Backend::kFake, {store.get(), "counting", r, 2});
      if (c.ok()) ranks[r] = CountBytes(std::move(*c), bytes);
    });
  }
  for (std::thread& t : threads) t.join();
  REQUIRE(ranks[0]);
  REQUIRE(ranks[1]);
  CHECK(std::string(ranks[0]->backend()) == "fake");
  CHECK(ranks[1]->rank() == 1);

  std::vector<float> a(10, 1.0f), b(10, 0.0f);
  std::unique_ptr<Work> send = ranks[0]->Send(Buffer::Of(a.data(), a.size()), 1);
  std::unique_ptr<Work> recv = ranks[1]->Recv(Buffer::Of(b.data(), b.size()), 0);
  REQUIRE(send->Wait(std::chrono::seconds(10)).ok());
  REQUIRE(recv->Wait(std::chrono::seconds(10)).ok());
  CHECK(b[3] == 1.0f);
  CHECK(bytes->load() == 40);  // the send only

  std::vector<double> x(4, 1.0), y(4, 2.0);
  std::unique_ptr<Work> r0 = ranks[0]->AllReduce({x.data(), x.size(), DataType::kFloat64});
  std::unique_ptr<Work> r1 = ranks[1]->AllReduce({y.data(), y.size(), DataType::kFloat64});
  REQUIRE(r0->Wait(std::chrono::seconds(10)).ok());
  REQUIRE(r1->Wait(std::chrono::seconds(10)).ok());
  CHECK(x[0] == 3.0);
  CHECK(bytes->load() == 40 + 2 * 32);  // each rank's contribution
}

TEST_CASE("CountBytes: without a counter the communicator is returned as is", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeCommunicator(Backend::kFake, {store.get(), "uncounted", 0, 1});
  REQUIRE(c.ok());
  Communicator* raw = c->get();
  CHECK(CountBytes(std::move(*c), nullptr).get() == raw);
}

}  // namespace
}  // namespace comm
}  // namespace rannc
