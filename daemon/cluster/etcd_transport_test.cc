// Membership through etcd: two daemons' transports (and a Cluster on one) over a real etcd.
#include "daemon/cluster/etcd_transport.h"

#include <chrono>
#include <thread>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_testing.h"

namespace rannc {
namespace cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::Eventually;

PeerReport Report(const std::string& address, uint64_t incarnation) {
  PeerReport r;
  r.address = address;
  r.incarnation = incarnation;
  r.hostname = "host-" + address;
  r.members = {"a:1", "b:1"};
  return r;
}

TEST_CASE("A member is heard through etcd while its key lives, and not after", "[etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t lease_a = c.GrantLease(seconds(10)).value();
  const int64_t lease_b = c.GrantLease(seconds(10)).value();
  auto a = MakeEtcdTransport(&c, lease_a);
  auto b = MakeEtcdTransport(&c, lease_b);
  REQUIRE(a.ok());
  REQUIRE(b.ok());

  // b has not written its report yet.
  auto before = (*a)->HeartbeatAll({"b:1"}, Report("a:1", 7), milliseconds(100));
  REQUIRE(before.size() == 1);
  CHECK(before[0].status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(before[0].status().message()), Catch::Contains("/rannc/members/b:1"));

  (*b)->HeartbeatAll({"a:1"}, Report("b:1", 9), milliseconds(100));
  absl::StatusOr<PeerReport> heard = absl::UnknownError("not yet");
  CHECK(Eventually([&] {
    heard = (*a)->HeartbeatAll({"b:1"}, Report("a:1", 7), milliseconds(100))[0];
    return heard.ok();
  }));
  REQUIRE(heard.ok());
  CHECK(heard->address == "b:1");
  CHECK(heard->incarnation == 9);
  CHECK(heard->hostname == "host-b:1");
  // And b hears a, which wrote its report with its first heartbeat.
  CHECK(Eventually([&] {
    return (*b)->HeartbeatAll({"a:1"}, Report("b:1", 9), milliseconds(100))[0].ok();
  }));

  // b's lease ends (b stopped): a no longer hears it, and still knows it as a member found.
  REQUIRE(c.RevokeLease(lease_b).ok());
  CHECK(Eventually([&] {
    return !(*a)->HeartbeatAll({"b:1"}, Report("a:1", 7), milliseconds(100))[0].ok();
  }));
  CHECK((*a)->Discovered() == std::vector<std::string>{"a:1", "b:1"});
}

TEST_CASE("A cluster on the etcd transport sees its members UP, then DOWN", "[etcd]") {
  // With --peers, or finding its members in etcd.
  const bool discover = GENERATE(false, true);
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t lease_a = c.GrantLease(seconds(10)).value();
  const int64_t lease_b = c.GrantLease(seconds(10)).value();
  auto make = [&](const std::string& self, int64_t lease) {
    ClusterOptions o;
    if (!discover) o.peers = {"a:1", "b:1"};
    o.discover = discover;
    o.advertise = self;
    // Long: a DOWN within the test's 10 s comes from the deleted key, not from silence.
    o.peer_timeout = seconds(60);
    o.heartbeat_interval = milliseconds(100);
    auto transport = MakeEtcdTransport(&c, lease);
    REQUIRE(transport.ok());
    auto cluster = Cluster::Create(o, std::move(*transport));
    REQUIRE(cluster.ok());
    return std::move(*cluster);
  };
  std::unique_ptr<Cluster> a = make("a:1", lease_a);
  std::unique_ptr<Cluster> b = make("b:1", lease_b);
  std::vector<std::string> downs, reasons;
  a->OnMemberDown([&](const MemberInfo& m, const std::string& why) {
    downs.push_back(m.address);
    reasons.push_back(why);
  });
  auto state_of_b = [&] {
    for (const MemberInfo& m : a->Members()) {
      if (m.address == "b:1") return m.state;
    }
    return MemberState::kUnknown;
  };
  CHECK(Eventually([&] {
    a->Tick();
    b->Tick();
    return state_of_b() == MemberState::kUp;
  }));
  // b stops: its lease is revoked, its key deleted, and a marks it DOWN at its next round.
  b.reset();
  REQUIRE(c.RevokeLease(lease_b).ok());
  CHECK(Eventually([&] {
    a->Tick();
    return state_of_b() == MemberState::kDown;
  }));
  CHECK(downs == std::vector<std::string>{"b:1"});
  REQUIRE(reasons.size() == 1);
  CHECK_THAT(reasons[0], Catch::Contains("/rannc/members/b:1") && Catch::Contains("deleted"));
  // b back (a new incarnation under a new lease): UP again.
  const int64_t lease_b2 = c.GrantLease(seconds(10)).value();
  b = make("b:1", lease_b2);
  CHECK(Eventually([&] {
    a->Tick();
    b->Tick();
    return state_of_b() == MemberState::kUp;
  }));
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
