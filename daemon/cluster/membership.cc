#include "daemon/cluster/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace rannc {
namespace cluster {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

const char* MemberStateName(MemberState state) {
  switch (state) {
    case MemberState::kUnknown: return "UNKNOWN";
    case MemberState::kUp: return "UP";
    case MemberState::kDown: return "DOWN";
  }
  return "?";
}

Membership::Membership(std::vector<std::string> members, PeerReport self,
                       Clock::duration peer_timeout, bool discovered)
    : self_(std::move(self)), peer_timeout_(peer_timeout), discovered_(discovered) {
  for (const std::string& address : members) {
    MemberInfo info;
    info.address = address;
    if (info.address == self_.address) {
      info.state = MemberState::kUp;
      info.incarnation = self_.incarnation;
      info.devices = self_.devices;
      info.hostname = self_.hostname;
      info.version = self_.version;
      info.self = true;
    }
    members_.push_back(std::move(info));
  }
  Rank();
}

void Membership::Rank() {
  std::stable_sort(members_.begin(), members_.end(),
                   [](const MemberInfo& a, const MemberInfo& b) { return a.address < b.address; });
  self_.members.clear();
  for (size_t rank = 0; rank < members_.size(); ++rank) {
    members_[rank].rank = static_cast<int>(rank);
    if (members_[rank].self) self_.rank = members_[rank].rank;
    self_.members.push_back(members_[rank].address);
  }
}

bool Membership::Add(const std::string& address) {
  if (!discovered_) return false;
  for (const MemberInfo& m : members_) {
    if (m.address == address) return false;
  }
  MemberInfo info;
  info.address = address;
  members_.push_back(std::move(info));
  Rank();
  return true;
}

absl::Status Membership::Heard(const PeerReport& report, Clock::time_point now,
                               std::vector<MemberEvent>* events) {
  auto it = std::find_if(members_.begin(), members_.end(),
                         [&](const MemberInfo& m) { return m.address == report.address; });
  if (it == members_.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "'", report.address, "' is not a member of the cluster of ", self_.address, " (",
        absl::StrJoin(self_.members, ","), "); add it to every daemon's --peers"));
  }
  if (!discovered_ && (report.members != self_.members || report.rank != it->rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "member lists differ: ", report.address, " has ", absl::StrJoin(report.members, ","),
        " (rank ", report.rank, "), ", self_.address, " has ", absl::StrJoin(self_.members, ","),
        " (rank ", it->rank, " for it); give every daemon the same --peers"));
  }
  if (it->self) {
    if (report.incarnation == self_.incarnation) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "another daemon (", report.hostname, ") advertises ", self_.address,
        ", this daemon's own address; give each daemon its own --advertise"));
  }
  if (it->state == MemberState::kUp && it->incarnation != report.incarnation) {
    events->push_back({MemberEvent::Kind::kDown, *it,
                       absl::StrFormat("restarted (incarnation %016x -> %016x)", it->incarnation,
                                       report.incarnation)});
    events->back().member.state = MemberState::kDown;
    it->state = MemberState::kDown;
  }
  const bool came_up = it->state != MemberState::kUp;
  it->state = MemberState::kUp;
  it->incarnation = report.incarnation;
  it->devices = report.devices;
  it->hostname = report.hostname;
  it->version = report.version;
  it->last_seen = now;
  if (came_up) events->push_back({MemberEvent::Kind::kUp, *it, ""});
  return absl::OkStatus();
}

void Membership::Expire(Clock::time_point now, std::vector<MemberEvent>* events) {
  for (MemberInfo& m : members_) {
    if (m.self || m.state != MemberState::kUp || now - *m.last_seen <= peer_timeout_) continue;
    m.state = MemberState::kDown;
    events->push_back({MemberEvent::Kind::kDown, m,
                       absl::StrFormat("not heard from for %.1f s (peer timeout %.1f s)",
                                       Seconds(now - *m.last_seen), Seconds(peer_timeout_))});
  }
}

void Membership::Lost(const std::string& address, const std::string& reason,
                      std::vector<MemberEvent>* events) {
  for (MemberInfo& m : members_) {
    if (m.address != address || m.self || m.state != MemberState::kUp) continue;
    m.state = MemberState::kDown;
    events->push_back({MemberEvent::Kind::kDown, m, reason});
  }
}

std::vector<std::string> Membership::Peers() const {
  std::vector<std::string> peers;
  for (const MemberInfo& m : members_) {
    if (!m.self) peers.push_back(m.address);
  }
  return peers;
}

}  // namespace cluster
}  // namespace rannc
