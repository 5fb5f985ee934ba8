// comm::Store on a real etcd process (cluster/etcd_testing.h).
#include "daemon/comm/etcd_store.h"

#include <chrono>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_testing.h"
#include "daemon/common/catch_threads.h"

namespace rannc {
namespace comm {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST_CASE("The etcd store sets, waits for, adds and scopes keys", "[etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = cluster::EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  std::unique_ptr<Store> store = MakeEtcdStore(client->get(), "/rannc/store/job-1/");
  std::unique_ptr<Store> other = MakeEtcdStore(client->get(), "/rannc/store/job-2/");

  REQUIRE(store->Set("a", std::string("\0bytes\xff", 7)).ok());
  CHECK(store->Get("a", milliseconds(100)).value() == std::string("\0bytes\xff", 7));
  // Another job's keys are apart.
  absl::StatusOr<std::string> missing = other->Get("a", milliseconds(200));
  CHECK(missing.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("'a'"));

  // A Get waits for a later Set, from another thread (another rank). While threads run, every
  // assertion goes through catch_threads.h (Catch2's are not thread-safe).
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    THREAD_REQUIRE_OK(store->Set("late", "here"));
  });
  THREAD_CHECK(store->Get("late", seconds(10)).value() == "here");
  setter.join();
  std::thread setter2([&] {
    std::this_thread::sleep_for(milliseconds(200));
    THREAD_REQUIRE_OK(store->Set("w1", "x"));
  });
  THREAD_CHECK(store->Wait({"a", "late", "w1"}, seconds(10)).ok());
  setter2.join();
  CHECK(store->Wait({"a", "never"}, milliseconds(200)).code() ==
        absl::StatusCode::kDeadlineExceeded);

  // Adds from several ranks at once: none is lost.
  std::vector<std::thread> adders;
  for (int t = 0; t < 4; ++t) {
    adders.emplace_back([&] {
      for (int i = 0; i < 25; ++i) THREAD_REQUIRE_OK(store->Add("count", 1).status());
    });
  }
  for (std::thread& t : adders) t.join();
  CHECK(store->Add("count", 0).value() == 100);
  CHECK(store->Add("count", -10).value() == 90);
  CHECK(store->Add("a", 1).status().code() == absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace comm
}  // namespace rannc
