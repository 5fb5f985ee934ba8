// EtcdClient against real etcd processes on loopback (etcd_testing.h).
#include "daemon/cluster/etcd_client.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_testing.h"
#include "daemon/security/tls_testing.h"

namespace rannc {
namespace cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::EtcdCluster;
using testing::Eventually;

TEST_CASE("PrefixEnd is the first key after a prefix", "[etcd]") {
  CHECK(PrefixEnd("/a/") == "/a0");
  CHECK(PrefixEnd(std::string("a\xff", 2)) == "b");
}

TEST_CASE("EtcdClient reads, writes and compares keys", "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;

  const int64_t rev = c.Put("/t/a", "1").value();
  CHECK(rev > 0);
  c.Put("/t/b", "2").value();
  c.Put("/u/c", "3").value();
  std::optional<KeyValue> a = c.Get("/t/a").value();
  REQUIRE(a.has_value());
  CHECK(a->value == "1");
  CHECK(a->mod_revision == rev);
  CHECK_FALSE(c.Get("/t/none").value().has_value());
  int64_t now = 0;
  std::vector<KeyValue> t = c.GetPrefix("/t/", &now).value();
  REQUIRE(t.size() == 2);
  CHECK(t[0].key == "/t/a");
  CHECK(t[1].key == "/t/b");
  CHECK(now > rev);

  // Create-if-absent and compare-and-swap on the modification revision.
  CHECK(c.PutIfAbsent("/t/once", "first").value());
  CHECK_FALSE(c.PutIfAbsent("/t/once", "second").value());
  const KeyValue once = c.Get("/t/once").value().value();
  CHECK(once.value == "first");
  CHECK(c.PutIfModRevision("/t/once", "third", once.mod_revision).value());
  CHECK_FALSE(c.PutIfModRevision("/t/once", "fourth", once.mod_revision).value());
  CHECK(c.Get("/t/once").value()->value == "third");

  CHECK(c.Delete("/t/a").value() == 1);
  CHECK(c.Delete("/t/a").value() == 0);
  CHECK(c.DeletePrefix("/t/").value() == 2);
  CHECK(c.GetPrefix("/t/").value().empty());
  CHECK(c.Get("/u/c").value()->value == "3");
}

TEST_CASE("etcd over TLS: a client of its CA with a certificate gets in; plain text, another "
          "CA, or no certificate does not", "[etcd]") {
  testing::TestCa ca, other;
  ca.Issue("etcd");
  ca.Issue("daemon");
  other.Issue("stranger");
  EtcdCluster etcd(1, {ca.cert("etcd"), ca.key("etcd"), ca.ca()});
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(
      etcd.endpoints(), seconds(2),
      security::ChannelCredentials({ca.cert("daemon"), ca.key("daemon"), ca.ca()}, seconds(10)));
  REQUIRE(client.ok());
  REQUIRE((*client)->Put("/test/tls", "yes").ok());
  CHECK((*client)->Get("/test/tls").value()->value == "yes");

  auto plain = EtcdClient::Connect(etcd.endpoints(), seconds(2));
  CHECK(plain.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(plain.status().message()), Catch::Contains("no etcd member of"));
  auto no_certificate = EtcdClient::Connect(
      etcd.endpoints(), seconds(2), security::ChannelCredentials({"", "", ca.ca()}, seconds(10)));
  CHECK_FALSE(no_certificate.ok());
  auto wrong_ca = EtcdClient::Connect(
      etcd.endpoints(), seconds(2),
      security::ChannelCredentials({other.cert("stranger"), other.key("stranger"), other.ca()},
                                   seconds(10)));
  CHECK_FALSE(wrong_ca.ok());
}

TEST_CASE("EtcdClient's connection to nothing fails at once, naming the endpoints", "[etcd]") {
  const std::string nowhere = "127.0.0.1:" + std::to_string(testing::FreePorts(1)[0]);
  auto client = EtcdClient::Connect({nowhere}, milliseconds(500));
  REQUIRE_FALSE(client.ok());
  CHECK(client.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(client.status().message()), Catch::Contains(nowhere));
}

TEST_CASE("A lease's keys go when it expires, and stay while it is kept alive", "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;

  const int64_t kept = c.GrantLease(seconds(2)).value();
  const int64_t dropped = c.GrantLease(seconds(2)).value();
  c.Put("/m/kept", "up", kept).value();
  c.Put("/m/dropped", "up", dropped).value();
  CHECK(c.Get("/m/kept").value()->lease == kept);

  std::atomic<bool> lost{false};
  LeaseKeeper keeper(&c, kept, seconds(2), [&](const absl::Status&) { lost = true; });
  // Watch the prefix: the expiry shows as a deletion.
  std::mutex mu;
  std::vector<WatchEvent> events;
  auto watch = c.WatchPrefix("/m/", 0, [&](const WatchEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(e);
  });
  CHECK(Eventually([&] { return !c.Get("/m/dropped").value().has_value(); }));
  std::this_thread::sleep_for(seconds(3));  // past the TTL: kept alive
  CHECK(c.Get("/m/kept").value().has_value());
  CHECK_FALSE(lost);
  CHECK(c.KeepAlive(dropped).status().code() == absl::StatusCode::kNotFound);
  {
    std::lock_guard<std::mutex> lock(mu);
    REQUIRE(events.size() == 1);
    CHECK(events[0].type == WatchEvent::Type::kDelete);
    CHECK(events[0].kv.key == "/m/dropped");
  }
  // Revoked: its keys go at once, and the keeper says it is lost.
  REQUIRE(c.RevokeLease(kept).ok());
  CHECK_FALSE(c.Get("/m/kept").value().has_value());
  CHECK(Eventually([&] { return lost.load(); }));
}

TEST_CASE("A watch delivers every change in order, from a past revision too", "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t first = c.Put("/w/0", "a").value();
  std::mutex mu;
  std::vector<std::string> seen;
  auto watch = c.WatchPrefix("/w/", first, [&](const WatchEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back((e.type == WatchEvent::Type::kPut ? "put " : "delete ") + e.kv.key +
                   (e.type == WatchEvent::Type::kPut ? "=" + e.kv.value : ""));
  });
  c.Put("/w/1", "b").value();
  c.Put("/x/ignored", "c").value();
  c.Delete("/w/0").value();
  c.Put("/w/1", "d").value();
  const std::vector<std::string> want = {"put /w/0=a", "put /w/1=b", "delete /w/0",
                                         "put /w/1=d"};
  CHECK(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size() >= want.size();
  }));
  std::lock_guard<std::mutex> lock(mu);
  CHECK(seen == want);
}

TEST_CASE("An election has one leader at a time; the next leads when it resigns", "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  CHECK(c.Leader("/e/job").status().code() == absl::StatusCode::kNotFound);

  const int64_t la = c.GrantLease(seconds(10)).value();
  const int64_t lb = c.GrantLease(seconds(10)).value();
  const Leadership a = c.Campaign("/e/job", la, "daemon-a", seconds(5)).value();
  CHECK(c.Leader("/e/job").value().value == "daemon-a");
  CHECK(a.revision > 0);
  // b waits while a leads. (Under a lease of its own: etcd withdraws a campaign that timed out
  // by deleting its key, which is the lease's, and may do so after the next one began.)
  const int64_t timed_out = c.GrantLease(seconds(10)).value();
  CHECK(c.Campaign("/e/job", timed_out, "daemon-b", milliseconds(300)).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<Leadership> b = absl::UnknownError("not yet");
  std::thread campaign([&] { b = c.Campaign("/e/job", lb, "daemon-b", seconds(10)); });
  std::this_thread::sleep_for(milliseconds(300));
  CHECK(c.Leader("/e/job").value().value == "daemon-a");
  REQUIRE(c.Resign(a).ok());
  campaign.join();
  REQUIRE(b.ok());
  CHECK(b->revision > a.revision);
  CHECK(c.Leader("/e/job").value().value == "daemon-b");
  // A leader whose lease ends leads no more.
  REQUIRE(c.RevokeLease(lb).ok());
  CHECK(c.Leader("/e/job").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("TryLead: one of several candidates leads; only the leader's fenced writes land",
          "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t la = c.GrantLease(seconds(10)).value();
  const int64_t lb = c.GrantLease(seconds(10)).value();

  std::optional<Leadership> a = c.TryLead("/t/job", la, "daemon-a").value();
  REQUIRE(a.has_value());
  CHECK(c.Leader("/t/job").value().value == "daemon-a");
  // b does not wait: it is told at once, and leaves no key behind.
  CHECK_FALSE(c.TryLead("/t/job", lb, "daemon-b").value().has_value());
  CHECK(c.GetPrefix("/t/job/").value().size() == 1);
  // Asking again while leading keeps the same leadership.
  std::optional<Leadership> again = c.TryLead("/t/job", la, "daemon-a").value();
  REQUIRE(again.has_value());
  CHECK(again->revision == a->revision);

  CHECK(c.PutIfFenced("/t/entry", "1", a->key, a->revision).value());
  CHECK(c.Get("/t/entry").value()->value == "1");
  CHECK_FALSE(c.PutIfFenced("/t/entry", "stale", a->key, a->revision - 1).value());
  // a's lease ends: b takes over, and a's fenced writes no longer land.
  REQUIRE(c.RevokeLease(la).ok());
  std::optional<Leadership> b = c.TryLead("/t/job", lb, "daemon-b").value();
  REQUIRE(b.has_value());
  CHECK(b->revision > a->revision);
  CHECK_FALSE(c.PutIfFenced("/t/entry", "from a", a->key, a->revision).value());
  CHECK_FALSE(c.DeleteIfFenced("/t/entry", a->key, a->revision).value());
  CHECK(c.PutIfFenced("/t/entry", "2", b->key, b->revision).value());
  CHECK(c.Get("/t/entry").value()->value == "2");
  CHECK(c.DeleteIfFenced("/t/entry", b->key, b->revision).value());
  CHECK_FALSE(c.Get("/t/entry").value().has_value());
}

TEST_CASE("A kept lease is valid; cut off from etcd, it stops being valid before etcd would "
          "expire it, and the keeper says it is lost", "[etcd]") {
  EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const auto granted = std::chrono::steady_clock::now();
  const int64_t lease = c.GrantLease(seconds(3)).value();
  std::atomic<bool> lost{false};
  std::atomic<int64_t> lost_ns{0};  // steady_clock's, since its epoch
  LeaseKeeper keeper(&c, lease, seconds(3), [&](const absl::Status&) {
    lost_ns = std::chrono::steady_clock::now().time_since_epoch().count();
    lost = true;
  }, granted);
  std::this_thread::sleep_for(milliseconds(3500));  // past the TTL: renewed
  CHECK(keeper.valid());
  const auto renewed_until = keeper.valid_until();
  CHECK(renewed_until > std::chrono::steady_clock::now() + milliseconds(1500));
  const auto cut = std::chrono::steady_clock::now();
  etcd.Kill(0);
  CHECK(Eventually([&] { return lost.load(); }, seconds(10)));
  CHECK_FALSE(keeper.valid());
  // Lost no later than 0.9 of the TTL after the last renewal was sent (plus the keeper's wake-up),
  // so before etcd could have expired it.
  const std::chrono::steady_clock::time_point lost_at{
      std::chrono::steady_clock::duration(lost_ns.load())};
  CHECK(lost_at >= renewed_until);
  CHECK(lost_at < renewed_until + milliseconds(300));
  CHECK(lost_at - cut < seconds(3));
}

TEST_CASE("EtcdClient goes on through the other members when one dies", "[etcd]") {
  EtcdCluster etcd(3);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(2));
  REQUIRE(client.ok());
  EtcdClient& c = **client;
  const int64_t before = c.Put("/k/before", "1").value();
  std::mutex mu;
  std::vector<std::string> seen;
  auto watch = c.WatchPrefix("/k/", before + 1, [&](const WatchEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(e.kv.key);
  });
  c.Put("/k/a", "1").value();
  CHECK(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size() == 1;
  }));
  etcd.Kill(0);  // the member every call and the watch went to
  // The first calls after may meet the dead member and move on; the data is all there.
  CHECK(Eventually([&] { return c.Put("/k/b", "2").ok(); }));
  CHECK(c.Get("/k/before").value()->value == "1");
  CHECK(c.GetPrefix("/k/").value().size() == 3);
  CHECK(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size() == 2;
  }));
  std::lock_guard<std::mutex> lock(mu);
  CHECK(seen == std::vector<std::string>{"/k/a", "/k/b"});
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
