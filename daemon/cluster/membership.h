// Membership: what one daemon knows about every member of its cluster, and the failure
// detector over it. A pure state machine: no threads, no clock of its own, no gRPC; Cluster
// feeds it heartbeats and the time.
//
//   Membership m({"a:1", "b:1"}, self_report, /*peer_timeout=*/std::chrono::seconds(10));
//   std::vector<MemberEvent> events;
//   absl::Status s = m.Heard(report_from_b, now, &events);  // b: UNKNOWN -> UP
//   m.Expire(now + std::chrono::seconds(11), &events);      // b: UP -> DOWN
//
// Member states (per member other than self, which is always UP):
//   UNKNOWN --heard--> UP --silent > peer_timeout--> DOWN --heard--> UP (rejoined)
//   UP --heard with a new incarnation--> DOWN (restarted) then UP, in one call: the old
//   process and whatever it held are gone even if the new one answered within the timeout.
//   UP --Lost (known gone: its etcd member key deleted)--> DOWN, at once.
// A member that was never heard from stays UNKNOWN (a cluster starts one daemon at a time).
// A discovered membership (etcd without --peers) starts as self alone and grows as members are
// found (Add); members once found stay, DOWN while gone; ranks follow the address order.
//
// Thread-safety: none; the owner serialises calls.
#ifndef RANNC_DAEMON_CLUSTER_MEMBERSHIP_H_
#define RANNC_DAEMON_CLUSTER_MEMBERSHIP_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace rannc {
namespace cluster {

using Clock = std::chrono::steady_clock;

struct DeviceSummary {
  std::string name;  // "cpu:0", "cuda:1"
  std::string type;  // "cpu" or "cuda"
  uint64_t memory_bytes = 0;
  bool operator==(const DeviceSummary& o) const {
    return name == o.name && type == o.type && memory_bytes == o.memory_bytes;
  }
};

// What a daemon says about itself in a heartbeat (proto: MemberReport).
struct PeerReport {
  std::string address;
  int rank = -1;
  uint64_t incarnation = 0;
  std::vector<DeviceSummary> devices;
  std::string hostname;
  std::string version;
  std::vector<std::string> members;  // the sender's member list, in rank order
};

enum class MemberState { kUnknown, kUp, kDown };
const char* MemberStateName(MemberState state);  // "UNKNOWN", "UP", "DOWN"

struct MemberInfo {
  std::string address;
  int rank = -1;  // 0 is the coordinator
  MemberState state = MemberState::kUnknown;
  uint64_t incarnation = 0;  // 0 until heard from
  std::vector<DeviceSummary> devices;
  std::string hostname;
  std::string version;
  std::optional<Clock::time_point> last_seen;  // empty until heard from
  bool self = false;
};

struct MemberEvent {
  enum class Kind { kUp, kDown } kind;
  MemberInfo member;   // as it is after the event (for kDown: the incarnation that was lost)
  std::string reason;  // for kDown: "not heard from for 3.2 s ..." or "restarted ..."
};

class Membership {
 public:
  // `members` in rank order (RankOrder); `self` is this daemon's report, whose address must be
  // one of them (Cluster checks that first, with a message for the user).
  // `discovered`: members join by Add, and member lists in reports are not compared (they
  // differ while a new member is being found).
  Membership(std::vector<std::string> members, PeerReport self, Clock::duration peer_timeout,
             bool discovered = false);

  // A discovered membership only: `address` joins, UNKNOWN until heard from, and every member's
  // rank is its place in the new address order. False when it is a member already.
  bool Add(const std::string& address);

  // Records `report`, heard at `now`, appending state changes to `events`. Nothing is recorded
  // and the error says why when the sender is not a member (PERMISSION_DENIED), has another
  // member list or rank (FAILED_PRECONDITION: ranks would disagree), or claims this daemon's
  // own address (FAILED_PRECONDITION: two daemons advertise one address).
  absl::Status Heard(const PeerReport& report, Clock::time_point now,
                     std::vector<MemberEvent>* events);

  // Marks UP members not heard from for longer than the peer timeout DOWN.
  void Expire(Clock::time_point now, std::vector<MemberEvent>* events);
  // `address` is known gone (its etcd lease ended, cluster/etcd_transport.h): an UP member
  // goes DOWN now, saying `reason`. Self and members not UP are left as they are.
  void Lost(const std::string& address, const std::string& reason,
            std::vector<MemberEvent>* events);

  // Every member in rank order.
  std::vector<MemberInfo> Snapshot() const { return members_; }
  // The members other than self, in rank order.
  std::vector<std::string> Peers() const;
  const PeerReport& self() const { return self_; }

 private:
  // Numbers members_ (sorted by address) and fills self_'s rank and member list.
  void Rank();

  std::vector<MemberInfo> members_;
  PeerReport self_;
  Clock::duration peer_timeout_;
  bool discovered_ = false;
};

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_MEMBERSHIP_H_
