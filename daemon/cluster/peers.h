// The cluster's member list: parsing --peers, resolving a DNS name that stands for every member
// (a Kubernetes headless service), and the order that gives each member its rank.
//
//   absl::StatusOr<std::vector<std::string>> peers = ParsePeerList("b:7411,a:7411");
//   absl::StatusOr<PeerResolution> r = ResolvePeers(*peers, /*cluster_size=*/0, SystemResolver());
//   // r->members == {"a:7411", "b:7411"}: a is rank 0 (the coordinator), b rank 1.
//
// Two forms of --peers:
// - A static list, "h1:p1,h2:p2,...": the full list, self included. Members are the entries
//   as spelled, so every daemon must be given the same spelling (and advertise itself by it).
// - One entry "NAME:PORT" whose NAME is not an IP literal, with cluster_size > 1: NAME resolves
//   to every member's IP. Pods of a StatefulSet appear in DNS one by one, so the resolution is
//   complete only once it yields cluster_size addresses; callers resolve again until then.
//
// Thread-safety: pure functions, except that SystemResolver's function calls getaddrinfo
// (which may block on DNS); all are safe from any thread.
#ifndef RANNC_DAEMON_CLUSTER_PEERS_H_
#define RANNC_DAEMON_CLUSTER_PEERS_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rannc {
namespace cluster {

struct HostPort {
  std::string host;  // without brackets for IPv6
  int port = 0;
};

// "h:7411" or "[::1]:7411" -> host and port (1..65535). INVALID_ARGUMENT otherwise.
absl::StatusOr<HostPort> SplitHostPort(const std::string& address);

// "h:7411" for names and IPv4, "[::1]:7411" for IPv6.
std::string JoinHostPort(const std::string& host, int port);

// True for "10.0.0.1" and "::1", false for names.
bool IsIpLiteral(const std::string& host);

// Splits "h1:p1, h2:p2" into its entries, stripped of spaces. INVALID_ARGUMENT for an empty
// list or entry, an entry that is not host:port, or one given twice.
absl::StatusOr<std::vector<std::string>> ParsePeerList(const std::string& spec);

// The endpoints of "etcd://h1:2379,h2:2379" (or of the list alone), as ParsePeerList takes
// them (ranncd --cluster-store, cluster/etcd_client.h). INVALID_ARGUMENT naming the URL.
absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(const std::string& url);

// Resolves a host name to its IP addresses (text form, any order). NOT_FOUND when it resolves
// to nothing (yet).
using ResolveFn = std::function<absl::StatusOr<std::vector<std::string>>(const std::string&)>;

// getaddrinfo over TCP, IPv4 and IPv6.
ResolveFn SystemResolver();

// The member addresses in rank order: sorted, byte-wise.
std::vector<std::string> RankOrder(std::vector<std::string> members);

struct PeerResolution {
  std::vector<std::string> members;  // in rank order
  bool complete = false;             // false: a DNS name has not yet reached cluster_size
  bool from_dns = false;             // members are what one name resolved to
};

// Turns parsed --peers entries into the members (see the two forms above). `cluster_size` 0
// means "the length of the static list"; a DNS name needs it. INVALID_ARGUMENT for
// inconsistent settings; FAILED_PRECONDITION when a name resolves to more than cluster_size
// addresses; a resolver's NOT_FOUND comes back as an incomplete resolution.
absl::StatusOr<PeerResolution> ResolvePeers(const std::vector<std::string>& peers,
                                            int cluster_size, const ResolveFn& resolve);

}  // namespace cluster
}  // namespace rannc

#endif  // RANNC_DAEMON_CLUSTER_PEERS_H_
