#include "daemon/cluster/membership.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Strings = std::vector<std::string>;

const Strings kMembers = {"a:1", "b:1", "c:1"};

PeerReport Report(const std::string& address, uint64_t incarnation) {
  PeerReport r;
  r.address = address;
  r.rank = static_cast<int>(std::find(kMembers.begin(), kMembers.end(), address) -
                            kMembers.begin());
  r.incarnation = incarnation;
  r.devices = {{"cpu:0", "cpu", 1 << 20}, {"cpu:1", "cpu", 1 << 20}};
  r.hostname = "host-" + address;
  r.version = "0.1.0";
  r.members = kMembers;
  return r;
}

MemberInfo Find(const Membership& m, const std::string& address) {
  for (const MemberInfo& info : m.Snapshot()) {
    if (info.address == address) return info;
  }
  FAIL("no member " << address);
  return {};
}

TEST_CASE("Membership: ranks, self UP, others UNKNOWN until heard", "[cluster]") {
  Membership m(kMembers, Report("b:1", 42), seconds(3));
  std::vector<MemberInfo> all = m.Snapshot();
  REQUIRE(all.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(all[i].rank == i);
  CHECK(m.self().rank == 1);
  CHECK(all[1].self);
  CHECK(all[1].state == MemberState::kUp);
  CHECK(all[0].state == MemberState::kUnknown);
  CHECK_FALSE(all[0].last_seen.has_value());
  CHECK(m.Peers() == Strings{"a:1", "c:1"});
}

TEST_CASE("Membership: a member known gone is DOWN at once, and UP when heard again",
          "[cluster]") {
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  Membership m(kMembers, Report("a:1", 1), seconds(3));
  std::vector<MemberEvent> events;
  // Not UP yet, or self: nothing happens.
  m.Lost("b:1", "its key was deleted", &events);
  m.Lost("a:1", "its key was deleted", &events);
  CHECK(events.empty());
  REQUIRE(m.Heard(Report("b:1", 7), t0, &events).ok());
  events.clear();
  m.Lost("b:1", "its key was deleted", &events);
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == MemberEvent::Kind::kDown);
  CHECK(events[0].member.address == "b:1");
  CHECK(events[0].reason == "its key was deleted");
  CHECK(Find(m, "b:1").state == MemberState::kDown);
  events.clear();
  REQUIRE(m.Heard(Report("b:1", 8), t0 + seconds(1), &events).ok());
  CHECK(Find(m, "b:1").state == MemberState::kUp);
}

TEST_CASE("Membership: the timeout state machine, transition by transition", "[cluster]") {
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  Membership m(kMembers, Report("a:1", 1), seconds(3));
  std::vector<MemberEvent> events;

  // Never heard: no timeout applies, however long.
  m.Expire(t0 + seconds(60), &events);
  CHECK(events.empty());
  CHECK(Find(m, "b:1").state == MemberState::kUnknown);

  // UNKNOWN -> UP, with what the peer said about itself.
  REQUIRE(m.Heard(Report("b:1", 7), t0, &events).ok());
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == MemberEvent::Kind::kUp);
  MemberInfo b = Find(m, "b:1");
  CHECK(b.state == MemberState::kUp);
  CHECK(b.incarnation == 7);
  CHECK(b.devices.size() == 2);
  CHECK(b.hostname == "host-b:1");
  CHECK(*b.last_seen == t0);
  events.clear();

  // Heard again: still UP, no event; the timeout counts from the last time.
  REQUIRE(m.Heard(Report("b:1", 7), t0 + seconds(2), &events).ok());
  CHECK(events.empty());
  m.Expire(t0 + seconds(5), &events);  // exactly the timeout since last heard: not yet
  CHECK(events.empty());
  CHECK(Find(m, "b:1").state == MemberState::kUp);

  // UP -> DOWN past the timeout, once.
  m.Expire(t0 + seconds(5) + milliseconds(1), &events);
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == MemberEvent::Kind::kDown);
  CHECK(events[0].member.address == "b:1");
  CHECK(events[0].member.incarnation == 7);
  CHECK_THAT(events[0].reason, Catch::Contains("not heard from for 3.0 s"));
  m.Expire(t0 + seconds(30), &events);
  CHECK(events.size() == 1);
  CHECK(Find(m, "b:1").state == MemberState::kDown);
  events.clear();

  // DOWN -> UP when a restarted daemon (new incarnation) is heard: rejoined.
  REQUIRE(m.Heard(Report("b:1", 8), t0 + seconds(40), &events).ok());
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == MemberEvent::Kind::kUp);
  CHECK(Find(m, "b:1").incarnation == 8);
  events.clear();

  // UP with a new incarnation: restarted within the timeout, so DOWN (old) then UP (new).
  REQUIRE(m.Heard(Report("b:1", 9), t0 + seconds(41), &events).ok());
  REQUIRE(events.size() == 2);
  CHECK(events[0].kind == MemberEvent::Kind::kDown);
  CHECK(events[0].member.incarnation == 8);
  CHECK_THAT(events[0].reason, Catch::Contains("restarted"));
  CHECK(events[1].kind == MemberEvent::Kind::kUp);
  CHECK(events[1].member.incarnation == 9);

  // Self never expires.
  events.clear();
  m.Expire(t0 + seconds(3600), &events);
  CHECK(Find(m, "a:1").state == MemberState::kUp);
  REQUIRE(events.size() == 1);  // only b
  CHECK(events[0].member.address == "b:1");
}

TEST_CASE("Membership: a discovered one grows by Add, re-ranks, and takes other lists",
          "[cluster]") {
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  PeerReport self = Report("b:1", 2);
  Membership m({"b:1"}, self, seconds(3), /*discovered=*/true);
  CHECK(m.self().rank == 0);
  CHECK(m.Add("c:1"));
  CHECK(m.Add("a:1"));
  CHECK_FALSE(m.Add("a:1"));
  CHECK(m.self().rank == 1);
  CHECK(m.self().members == kMembers);
  CHECK(m.Peers() == Strings{"a:1", "c:1"});
  CHECK(Find(m, "c:1").rank == 2);
  CHECK(Find(m, "a:1").state == MemberState::kUnknown);

  // a:1 has not found c:1 yet: its list differs, and its report is still taken.
  PeerReport a = Report("a:1", 1);
  a.members = {"a:1", "b:1"};
  std::vector<MemberEvent> events;
  CHECK(m.Heard(a, t0, &events).ok());
  CHECK(Find(m, "a:1").state == MemberState::kUp);
  // A stranger is still one.
  PeerReport z = Report("z:1", 9);
  CHECK(m.Heard(z, t0, &events).code() == absl::StatusCode::kPermissionDenied);

  Membership fixed(kMembers, Report("a:1", 1), seconds(3));
  CHECK_FALSE(fixed.Add("d:1"));
  CHECK(fixed.Snapshot().size() == 3);
}

TEST_CASE("Membership: refuses strangers, other member lists and a second self", "[cluster]") {
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  Membership m(kMembers, Report("a:1", 1), seconds(3));
  std::vector<MemberEvent> events;

  PeerReport stranger = Report("a:1", 5);
  stranger.address = "z:1";
  absl::Status s = m.Heard(stranger, t0, &events);
  CHECK(s.code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(s.message()), Catch::Contains("'z:1' is not a member"));

  PeerReport other_list = Report("b:1", 5);
  other_list.members = {"b:1", "c:1"};
  other_list.rank = 0;
  s = m.Heard(other_list, t0, &events);
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("member lists differ") && Catch::Contains("same --peers"));

  PeerReport twin = Report("a:1", 99);
  s = m.Heard(twin, t0, &events);
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(s.message()), Catch::Contains("own address"));

  CHECK(events.empty());
  CHECK(Find(m, "b:1").state == MemberState::kUnknown);
}

}  // namespace
}  // namespace cluster
}  // namespace rannc
