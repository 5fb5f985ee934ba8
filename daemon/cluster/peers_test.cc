#include "daemon/cluster/peers.h"

#include <catch2/catch.hpp>
#include <map>

namespace rannc {
namespace cluster {
namespace {

using Strings = std::vector<std::string>;

std::string ErrorOf(const absl::Status& status) {
  return status.ok() ? "<unexpectedly ok>" : std::string(status.message());
}

// A resolver over a fixed table that counts its calls; NOT_FOUND for unknown names, as
// getaddrinfo answers for a service with no ready pods yet.
struct FakeDns {
  std::map<std::string, Strings> table;
  int calls = 0;
  ResolveFn fn() {
    return [this](const std::string& host) -> absl::StatusOr<Strings> {
      ++calls;
      auto it = table.find(host);
      if (it == table.end()) return absl::NotFoundError("no such name " + host);
      return it->second;
    };
  }
};

TEST_CASE("ParsePeerList: entries, spaces, IPv6, and errors naming the entry", "[cluster]") {
  absl::StatusOr<Strings> peers = ParsePeerList(" b:7411, a:7412 ,[::1]:7413");
  REQUIRE(peers.ok());
  CHECK(*peers == Strings{"b:7411", "a:7412", "[::1]:7413"});

  CHECK_THAT(ErrorOf(ParsePeerList("").status()), Catch::Contains("empty entry"));
  CHECK_THAT(ErrorOf(ParsePeerList("a:1,,b:2").status()), Catch::Contains("empty entry"));
  CHECK_THAT(ErrorOf(ParsePeerList("a:1,b").status()),
             Catch::Contains("'b'") && Catch::Contains("host:port"));
  CHECK_THAT(ErrorOf(ParsePeerList("a:0").status()), Catch::Contains("1 to 65535"));
  CHECK_THAT(ErrorOf(ParsePeerList("a:70000").status()), Catch::Contains("1 to 65535"));
  CHECK_THAT(ErrorOf(ParsePeerList("::1:7411").status()), Catch::Contains("brackets"));
  CHECK_THAT(ErrorOf(ParsePeerList("a:1,b:2,a:1").status()),
             Catch::Contains("'a:1' is given twice"));
}

TEST_CASE("SplitHostPort and JoinHostPort round-trip IPv4, IPv6 and names", "[cluster]") {
  for (const std::string address : {"10.0.0.1:7411", "[fe80::1]:80", "node-1.svc:65535"}) {
    absl::StatusOr<HostPort> hp = SplitHostPort(address);
    REQUIRE(hp.ok());
    CHECK(JoinHostPort(hp->host, hp->port) == address);
  }
  CHECK(SplitHostPort("[fe80::1]:80")->host == "fe80::1");
  CHECK(IsIpLiteral("10.0.0.1"));
  CHECK(IsIpLiteral("::1"));
  CHECK_FALSE(IsIpLiteral("localhost"));
  CHECK_FALSE(IsIpLiteral("10.0.0"));
}

TEST_CASE("RankOrder: every daemon sorts the same list to the same ranks", "[cluster]") {
  const Strings a = RankOrder({"h2:1", "h10:1", "h1:1"});
  const Strings b = RankOrder({"h1:1", "h2:1", "h10:1"});
  CHECK(a == b);
  CHECK(a == Strings{"h10:1", "h1:1", "h2:1"});  // byte order, the same on every host
}

TEST_CASE("ResolvePeers: a static list is the members, never resolved", "[cluster]") {
  FakeDns dns;
  absl::StatusOr<PeerResolution> r = ResolvePeers({"b:1", "a:1", "c:1"}, 0, dns.fn());
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK_FALSE(r->from_dns);
  CHECK(r->members == Strings{"a:1", "b:1", "c:1"});
  CHECK(dns.calls == 0);
  // One IP literal is a cluster of one, not a name.
  r = ResolvePeers({"10.0.0.1:7411"}, 0, dns.fn());
  REQUIRE(r.ok());
  CHECK(r->members == Strings{"10.0.0.1:7411"});
  CHECK(ResolvePeers({"a:1", "b:1"}, 2, dns.fn()).ok());
  CHECK_THAT(ErrorOf(ResolvePeers({"a:1", "b:1"}, 3, dns.fn()).status()),
             Catch::Contains("--cluster-size is 3") && Catch::Contains("lists 2"));
  CHECK(dns.calls == 0);
}

TEST_CASE("ResolvePeers: one name stands for every member once it resolves to all", "[cluster]") {
  FakeDns dns;
  SECTION("a name needs the expected size") {
    CHECK_THAT(ErrorOf(ResolvePeers({"rannc-headless:7411"}, 0, dns.fn()).status()),
               Catch::Contains("--cluster-size"));
  }
  SECTION("no addresses yet, then some, then all: complete only at the expected count") {
    absl::StatusOr<PeerResolution> r = ResolvePeers({"svc:7411"}, 3, dns.fn());
    REQUIRE(r.ok());
    CHECK_FALSE(r->complete);
    CHECK(r->members.empty());

    dns.table["svc"] = {"10.0.0.7", "10.0.0.3"};
    r = ResolvePeers({"svc:7411"}, 3, dns.fn());
    REQUIRE(r.ok());
    CHECK_FALSE(r->complete);
    CHECK(r->members == Strings{"10.0.0.3:7411", "10.0.0.7:7411"});

    // Duplicates (one address per socket type, say) count once; IPv6 gets brackets.
    dns.table["svc"] = {"10.0.0.7", "fd00::5", "10.0.0.3", "10.0.0.7"};
    r = ResolvePeers({"svc:7411"}, 3, dns.fn());
    REQUIRE(r.ok());
    CHECK(r->complete);
    CHECK(r->from_dns);
    CHECK(r->members == Strings{"10.0.0.3:7411", "10.0.0.7:7411", "[fd00::5]:7411"});
    CHECK(dns.calls == 3);
  }
  SECTION("more addresses than expected is an error naming them") {
    dns.table["svc"] = {"10.0.0.1", "10.0.0.2", "10.0.0.3"};
    absl::StatusOr<PeerResolution> r = ResolvePeers({"svc:7411"}, 2, dns.fn());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(ErrorOf(r.status()),
               Catch::Contains("resolves to 3") && Catch::Contains("10.0.0.3:7411"));
  }
  SECTION("a name with --cluster-size 1 is a static list of one") {
    absl::StatusOr<PeerResolution> r = ResolvePeers({"myhost:7411"}, 1, dns.fn());
    REQUIRE(r.ok());
    CHECK(r->members == Strings{"myhost:7411"});
    CHECK(dns.calls == 0);
  }
}

TEST_CASE("SystemResolver resolves localhost and reports unknown names as NOT_FOUND",
          "[cluster]") {
  absl::StatusOr<Strings> local = SystemResolver()("127.0.0.1");
  REQUIRE(local.ok());
  CHECK(std::find(local->begin(), local->end(), "127.0.0.1") != local->end());
  absl::StatusOr<Strings> missing = SystemResolver()("no-such-host.invalid");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("ParseEtcdUrl takes etcd://HOST:PORT lists and names what is wrong", "[peers]") {
  CHECK(ParseEtcdUrl("etcd://a:1,b:2").value() == std::vector<std::string>{"a:1", "b:2"});
  CHECK(ParseEtcdUrl("127.0.0.1:2379").value() == std::vector<std::string>{"127.0.0.1:2379"});
  CHECK_THAT(std::string(ParseEtcdUrl("etcd://a").status().message()),
             Catch::Contains("'a'") && Catch::Contains("HOST:PORT"));
  CHECK_FALSE(ParseEtcdUrl("etcd://").ok());
  CHECK_FALSE(ParseEtcdUrl("http://a:1/x").ok());
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
