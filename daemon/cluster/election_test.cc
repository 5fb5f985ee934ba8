// Elections over a real etcd: one leader at a time, and another one once it is gone.
#include "daemon/cluster/election.h"

#include <chrono>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_testing.h"

namespace rannc {
namespace cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::Eventually;

TEST_CASE("One candidate leads; another leads once its lease ends, or once it resigns",
          "[etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t lease_a = c.GrantLease(seconds(10)).value();
  const int64_t lease_b = c.GrantLease(seconds(10)).value();
  const int64_t lease_c = c.GrantLease(seconds(10)).value();

  auto a = Election::Start(&c, lease_a, "/test/coordinator", "a:1", milliseconds(200));
  REQUIRE(a.ok());
  CHECK((*a)->leads());
  CHECK((*a)->leader() == "a:1");
  auto b = Election::Start(&c, lease_b, "/test/coordinator", "b:1", milliseconds(200));
  auto d = Election::Start(&c, lease_c, "/test/coordinator", "c:1", milliseconds(200));
  REQUIRE(b.ok());
  REQUIRE(d.ok());
  CHECK_FALSE((*b)->leads());
  CHECK((*b)->leader() == "a:1");
  CHECK((*d)->leader() == "a:1");
  // The losers withdrew: only the leader's key stands.
  CHECK(c.GetPrefix("/test/coordinator/").value().size() == 1);

  // a's lease ends (as when its daemon is killed and the TTL passes): exactly one of b and c
  // leads, and every candidate, a too, names it.
  REQUIRE(c.RevokeLease(lease_a).ok());
  REQUIRE(Eventually([&] { return (*b)->leads() || (*d)->leads(); }, seconds(5)));
  CHECK((*b)->leads() != (*d)->leads());
  const std::string next = (*b)->leads() ? "b:1" : "c:1";
  CHECK(Eventually([&] {
    return (*a)->leader() == next && (*b)->leader() == next && (*d)->leader() == next;
  }, seconds(5)));
  CHECK_FALSE((*a)->leads());
  CHECK(c.GetPrefix("/test/coordinator/").value().size() == 1);

  // The leader stops (its daemon shuts down): it resigns, and the last one leads at once, its
  // lease still alive.
  std::unique_ptr<Election>& leading = (*b)->leads() ? *b : *d;
  std::unique_ptr<Election>& other = (*b)->leads() ? *d : *b;
  const std::string last = (*b)->leads() ? "c:1" : "b:1";
  const auto resigned = std::chrono::steady_clock::now();
  leading.reset();
  REQUIRE(Eventually([&] { return other->leads(); }, seconds(5)));
  CHECK(std::chrono::steady_clock::now() - resigned < seconds(2));
  CHECK(other->leader() == last);
  CHECK(Eventually([&] { return (*a)->leader() == last; }, seconds(5)));
}

TEST_CASE("An election whose etcd is gone says so and names no leader", "[etcd]") {
  auto etcd = std::make_unique<testing::EtcdCluster>(1);
  RANNC_REQUIRE_ETCD(*etcd);
  auto client = EtcdClient::Connect(etcd->endpoints(), seconds(1));
  REQUIRE(client.ok());
  const int64_t lease = (*client)->GrantLease(seconds(10)).value();
  auto e = Election::Start(client->get(), lease, "/test/coordinator", "a:1", milliseconds(100));
  REQUIRE(e.ok());
  CHECK((*e)->leads());
  etcd.reset();  // SIGKILLed
  absl::Status round = (*e)->Round();
  CHECK_FALSE(round.ok());
  CHECK((*e)->leader().empty());
  CHECK_FALSE((*e)->leads());
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
