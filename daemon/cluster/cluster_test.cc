#include "daemon/cluster/cluster.h"

#include <catch2/catch.hpp>
#include <map>
#include <set>

namespace rannc {
namespace cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Strings = std::vector<std::string>;

// In-process network: heartbeats are direct HandleHeartbeat calls; a cut address answers
// UNAVAILABLE both ways, as a killed daemon would.
struct FakeNetwork {
  std::map<std::string, Cluster*> nodes;
  std::set<std::string> cut;
};

class FakeTransport final : public PeerTransport {
 public:
  explicit FakeTransport(FakeNetwork* net) : net_(net) {}
  std::vector<absl::StatusOr<PeerReport>> HeartbeatAll(const Strings& addresses,
                                                       const PeerReport& self,
                                                       milliseconds) override {
    std::vector<absl::StatusOr<PeerReport>> answers;
    for (const std::string& address : addresses) {
      auto it = net_->nodes.find(address);
      if (net_->cut.count(address) || net_->cut.count(self.address) || it == net_->nodes.end()) {
        answers.push_back(absl::UnavailableError("connection refused"));
      } else {
        answers.push_back(it->second->HandleHeartbeat(self));
      }
    }
    return answers;
  }
  // As etcd's member keys: every daemon on the network.
  Strings Discovered() override {
    Strings out;
    for (const auto& [address, node] : net_->nodes) out.push_back(address);
    return out;
  }

 private:
  FakeNetwork* net_;
};

// A manual clock shared by every node of a test.
struct FakeClock {
  Clock::time_point t = Clock::time_point() + seconds(1000);
  std::function<Clock::time_point()> fn() {
    return [this] { return t; };
  }
};

ClusterOptions Options(const std::string& self, const Strings& peers, FakeClock& clock,
                       uint64_t incarnation) {
  ClusterOptions o;
  o.peers = peers;
  o.advertise = self;
  o.heartbeat_interval = milliseconds(100);
  o.peer_timeout = seconds(3);
  o.devices = {{"cpu:0", "cpu", 1 << 30}, {"cpu:1", "cpu", 1 << 30}};
  o.hostname = "host-" + self;
  o.version = "test";
  o.incarnation = incarnation;
  o.now = clock.fn();
  return o;
}

std::unique_ptr<Cluster> Make(FakeNetwork& net, ClusterOptions o) {
  absl::StatusOr<std::unique_ptr<Cluster>> c =
      Cluster::Create(std::move(o), std::make_unique<FakeTransport>(&net));
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  net.nodes[(*c)->address()] = c->get();
  return std::move(*c);
}

MemberState StateOf(const Cluster& c, const std::string& address) {
  for (const MemberInfo& m : c.Members()) {
    if (m.address == address) return m.state;
  }
  FAIL("no member " << address);
  return MemberState::kUnknown;
}

TEST_CASE("Cluster: without peers it is this daemon alone, rank 0", "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  std::unique_ptr<Cluster> c = Make(net, Options("127.0.0.1:5000", {}, clock, 1));
  c->Start();  // no thread: nothing to heartbeat
  std::vector<MemberInfo> members = c->Members();
  REQUIRE(members.size() == 1);
  CHECK(members[0].rank == 0);
  CHECK(members[0].self);
  CHECK(members[0].state == MemberState::kUp);
  CHECK(members[0].devices.size() == 2);
}

TEST_CASE("Cluster: a discovering daemon starts alone and adds each member found, ranked by "
          "address", "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  ClusterOptions options = Options("h:2", {}, clock, 2);
  options.discover = true;
  std::unique_ptr<Cluster> a = Make(net, options);
  a->Tick();
  REQUIRE(a->Members().size() == 1);
  CHECK(a->Members()[0].rank == 0);

  options = Options("h:1", {}, clock, 1);
  options.discover = true;
  std::unique_ptr<Cluster> b = Make(net, options);
  for (int round = 0; round < 2; ++round) {
    a->Tick();
    b->Tick();
  }
  std::vector<MemberInfo> members = a->Members();
  REQUIRE(members.size() == 2);
  CHECK(members[0].address == "h:1");  // ranks follow the addresses, not the order found
  CHECK(members[0].rank == 0);
  CHECK(members[1].self);
  CHECK(members[1].rank == 1);
  CHECK(StateOf(*a, "h:1") == MemberState::kUp);
  CHECK(StateOf(*b, "h:2") == MemberState::kUp);

  // A third: while a and b list different members, their heartbeats are still taken.
  options = Options("h:0", {}, clock, 3);
  options.discover = true;
  std::unique_ptr<Cluster> c = Make(net, options);
  for (int round = 0; round < 2; ++round) {
    a->Tick();
    b->Tick();
    c->Tick();
  }
  for (Cluster* node : {a.get(), b.get(), c.get()}) {
    members = node->Members();
    REQUIRE(members.size() == 3);
    for (size_t rank = 0; rank < 3; ++rank) {
      CHECK(members[rank].address == "h:" + std::to_string(rank));
      CHECK(members[rank].rank == static_cast<int>(rank));
      CHECK(members[rank].state == MemberState::kUp);
    }
  }

  // One gone stays a member, DOWN.
  std::vector<std::string> lost;
  a->OnMemberDown([&](const MemberInfo& m, const std::string&) { lost.push_back(m.address); });
  net.cut.insert("h:1");
  clock.t += seconds(4);
  a->Tick();
  CHECK(lost == Strings{"h:1"});
  CHECK(a->Members().size() == 3);
  CHECK(StateOf(*a, "h:1") == MemberState::kDown);

  ClusterOptions both = Options("h:1", {"h:1", "h:2"}, clock, 1);
  both.discover = true;
  CHECK(Cluster::Create(both, nullptr).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Cluster: refuses a peer list without itself, and bad timings", "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<Cluster>> c =
      Cluster::Create(Options("h:3", {"h:1", "h:2"}, clock, 1), nullptr);
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(c.status().message()),
             Catch::Contains("h:3 is not in its peer list (h:1,h:2)") &&
                 Catch::Contains("--advertise"));

  ClusterOptions o = Options("h:1", {"h:1", "h:2"}, clock, 1);
  o.peer_timeout = milliseconds(100);
  c = Cluster::Create(o, nullptr);
  CHECK_THAT(std::string(c.status().message()), Catch::Contains("longer than the heartbeat"));
}

TEST_CASE("Cluster: three daemons agree on ranks, see each other, detect a loss and a rejoin",
          "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  const Strings peers = {"n3:1", "n1:1", "n2:1"};
  std::unique_ptr<Cluster> n1 = Make(net, Options("n1:1", peers, clock, 11));
  std::unique_ptr<Cluster> n2 = Make(net, Options("n2:1", peers, clock, 22));
  std::unique_ptr<Cluster> n3 = Make(net, Options("n3:1", peers, clock, 33));
  std::vector<std::pair<std::string, std::string>> downs;  // (seen by, lost member + reason)
  for (Cluster* c : {n1.get(), n2.get(), n3.get()}) {
    c->OnMemberDown([c, &downs](const MemberInfo& m, const std::string& reason) {
      downs.push_back({c->address(), m.address + " " + std::to_string(m.incarnation) + " " +
                                         reason});
    });
  }
  CHECK(StateOf(*n1, "n2:1") == MemberState::kUnknown);

  // One round from n1 is enough for all to hear of each other: each call proves both ends.
  n1->Tick();
  n2->Tick();
  for (Cluster* c : {n1.get(), n2.get(), n3.get()}) {
    std::vector<MemberInfo> members = c->Members();
    REQUIRE(members.size() == 3);
    for (int rank = 0; rank < 3; ++rank) {
      CHECK(members[rank].address == "n" + std::to_string(rank + 1) + ":1");
      CHECK(members[rank].rank == rank);
      CHECK(members[rank].state == MemberState::kUp);
      CHECK(members[rank].devices.size() == 2);
      CHECK(members[rank].hostname == "host-" + members[rank].address);
    }
  }
  CHECK(n3->Members()[0].incarnation == 11);

  // n2 dies. 3 s later (the timeout, not past it) nobody has given up on it.
  net.cut.insert("n2:1");
  clock.t += seconds(3);
  n1->Tick();
  n3->Tick();
  CHECK(StateOf(*n1, "n2:1") == MemberState::kUp);
  CHECK(downs.empty());
  clock.t += milliseconds(100);
  n1->Tick();
  n3->Tick();
  CHECK(StateOf(*n1, "n2:1") == MemberState::kDown);
  CHECK(StateOf(*n3, "n2:1") == MemberState::kDown);
  CHECK(StateOf(*n1, "n3:1") == MemberState::kUp);
  REQUIRE(downs.size() == 2);
  CHECK(downs[0].first == "n1:1");
  CHECK_THAT(downs[0].second, Catch::StartsWith("n2:1 22 not heard from for 3.1 s"));
  CHECK(downs[1].first == "n3:1");
  n1->Tick();  // reported once, not every round
  CHECK(downs.size() == 2);

  // It restarts (new incarnation) on the same address and rejoins.
  net.nodes.erase("n2:1");
  n2.reset();
  net.cut.clear();
  n2 = Make(net, Options("n2:1", peers, clock, 23));
  n2->Tick();
  for (Cluster* c : {n1.get(), n3.get()}) {
    CHECK(StateOf(*c, "n2:1") == MemberState::kUp);
    CHECK(c->Members()[1].incarnation == 23);
  }
  CHECK(StateOf(*n2, "n1:1") == MemberState::kUp);
  CHECK(downs.size() == 2);
}

TEST_CASE("Cluster: a restart faster than the timeout still reports the old one lost",
          "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  const Strings peers = {"a:1", "b:1"};
  std::unique_ptr<Cluster> a = Make(net, Options("a:1", peers, clock, 1));
  std::unique_ptr<Cluster> b = Make(net, Options("b:1", peers, clock, 2));
  Strings lost;
  a->OnMemberDown([&](const MemberInfo& m, const std::string& reason) {
    lost.push_back(m.address + " " + reason);
  });
  a->Tick();
  REQUIRE(StateOf(*a, "b:1") == MemberState::kUp);
  net.nodes.erase("b:1");
  b = Make(net, Options("b:1", peers, clock, 3));
  // b's heartbeat reaches a on b's thread; a's callbacks run on a's next Tick.
  b->Tick();
  CHECK(lost.empty());
  a->Tick();
  REQUIRE(lost.size() == 1);
  CHECK_THAT(lost[0], Catch::Contains("b:1 restarted"));
  CHECK(StateOf(*a, "b:1") == MemberState::kUp);
}

TEST_CASE("Cluster: a DNS name is resolved again until every member is there", "[cluster]") {
  FakeNetwork net;
  FakeClock clock;
  Strings answer;  // what the name resolves to now
  auto options = [&](const std::string& self, uint64_t incarnation) {
    ClusterOptions o = Options(self, {"svc:7411"}, clock, incarnation);
    o.cluster_size = 2;
    o.resolve = [&answer](const std::string& host) -> absl::StatusOr<Strings> {
      if (host != "svc" || answer.empty()) return absl::NotFoundError("not yet");
      return answer;
    };
    return o;
  };
  std::unique_ptr<Cluster> a = Make(net, options("10.0.0.2:7411", 1));
  std::unique_ptr<Cluster> b = Make(net, options("10.0.0.1:7411", 2));
  a->Tick();
  std::vector<MemberInfo> pending = a->Members();
  REQUIRE(pending.size() == 1);
  CHECK(pending[0].rank == -1);
  CHECK(b->HandleHeartbeat(PeerReport{}).status().code() ==
        absl::StatusCode::kFailedPrecondition);

  answer = {"10.0.0.2"};  // one of two pods is ready
  a->Tick();
  CHECK(a->Members()[0].rank == -1);

  answer = {"10.0.0.2", "10.0.0.1"};
  b->Tick();  // b resolves; a does not yet, so b's heartbeat to a is refused
  CHECK(StateOf(*b, "10.0.0.2:7411") == MemberState::kUnknown);
  a->Tick();  // a resolves and heartbeats b
  for (Cluster* c : {a.get(), b.get()}) {
    std::vector<MemberInfo> members = c->Members();
    REQUIRE(members.size() == 2);
    CHECK(members[0].address == "10.0.0.1:7411");
    CHECK(members[0].rank == 0);
    CHECK(members[1].address == "10.0.0.2:7411");
    CHECK(members[0].state == MemberState::kUp);
    CHECK(members[1].state == MemberState::kUp);
  }
}

TEST_CASE("Cluster: the heartbeat thread runs on its own and stops promptly", "[cluster]") {
  FakeNetwork net;
  FakeClock clock;  // frozen: nothing expires, only the rounds are counted
  const Strings peers = {"a:1", "b:1"};
  std::unique_ptr<Cluster> a = Make(net, Options("a:1", peers, clock, 1));
  std::unique_ptr<Cluster> b = Make(net, Options("b:1", peers, clock, 2));
  a->Start();
  const auto deadline = Clock::now() + seconds(10);
  while (StateOf(*b, "a:1") != MemberState::kUp && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  CHECK(StateOf(*b, "a:1") == MemberState::kUp);
  const auto before = Clock::now();
  a->Stop();
  CHECK(Clock::now() - before < milliseconds(500));
  a->Stop();  // idempotent
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
