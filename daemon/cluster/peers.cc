#include "daemon/cluster/peers.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rannc {
namespace cluster {

absl::StatusOr<HostPort> SplitHostPort(const std::string& address) {
  auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid peer address '", address, "': ", why,
                                                   "; expected host:port or [v6addr]:port"));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return invalid("no port");
  std::string host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return invalid("unbalanced brackets");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return invalid("an IPv6 address needs brackets");
  }
  const std::string port_text = address.substr(colon + 1);
  int port = 0;
  if (port_text.empty() || !std::all_of(port_text.begin(), port_text.end(), ::isdigit) ||
      !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return invalid(absl::StrCat("port '", port_text, "' is not a number from 1 to 65535"));
  }
  return HostPort{host, port};
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

bool IsIpLiteral(const std::string& host) {
  unsigned char buffer[sizeof(struct in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buffer) == 1 ||
         inet_pton(AF_INET6, host.c_str(), buffer) == 1;
}

absl::StatusOr<std::vector<std::string>> ParsePeerList(const std::string& spec) {
  std::vector<std::string> peers;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    const std::string entry(absl::StripAsciiWhitespace(item));
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty entry in peer list '", spec, "'; expected h1:p1,h2:p2,..."));
    }
    if (absl::StatusOr<HostPort> parsed = SplitHostPort(entry); !parsed.ok()) {
      return parsed.status();
    }
    if (!seen.insert(entry).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer '", entry, "' is given twice in '", spec, "'"));
    }
    peers.push_back(entry);
  }
  return peers;
}

absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(const std::string& url) {
  absl::string_view rest = url;
  absl::ConsumePrefix(&rest, "etcd://");
  absl::StatusOr<std::vector<std::string>> endpoints = ParsePeerList(std::string(rest));
  if (!endpoints.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("etcd endpoints '", url, "': ",
                                                   endpoints.status().message(),
                                                   " (want etcd://HOST:PORT[,HOST:PORT...])"));
  }
  return endpoints;
}

ResolveFn SystemResolver() {
  return [](const std::string& host) -> absl::StatusOr<std::vector<std::string>> {
    struct addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo* found = nullptr;
    const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc != 0) {
      return absl::NotFoundError(
          absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
    }
    std::vector<std::string> ips;
    for (struct addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* raw =
          a->ai_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
      if (inet_ntop(a->ai_family, raw, text, sizeof(text)) != nullptr) ips.push_back(text);
    }
    freeaddrinfo(found);
    return ips;
  };
}

std::vector<std::string> RankOrder(std::vector<std::string> members) {
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  return members;
}

absl::StatusOr<PeerResolution> ResolvePeers(const std::vector<std::string>& peers,
                                            int cluster_size, const ResolveFn& resolve) {
  if (peers.empty()) return absl::InvalidArgumentError("the peer list is empty");
  if (cluster_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster size must be >= 0 (0: the length of --peers), got ", cluster_size));
  }
  absl::StatusOr<HostPort> first = SplitHostPort(peers[0]);
  if (!first.ok()) return first.status();
  const bool dns_form = peers.size() == 1 && !IsIpLiteral(first->host) && cluster_size != 1;
  if (!dns_form) {
    if (cluster_size != 0 && cluster_size != static_cast<int>(peers.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cluster-size is ", cluster_size, " but --peers lists ", peers.size(), " daemons (",
          absl::StrJoin(peers, ","), ")"));
    }
    return PeerResolution{RankOrder(peers), true, false};
  }
  if (cluster_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peers ", peers[0], " is one name, which stands for every daemon of the cluster; give "
        "--cluster-size N (how many addresses it should resolve to), or list every daemon as "
        "h1:p1,h2:p2,..."));
  }
  absl::StatusOr<std::vector<std::string>> ips = resolve(first->host);
  if (!ips.ok()) {
    if (ips.status().code() == absl::StatusCode::kNotFound) return PeerResolution{{}, false, true};
    return ips.status();
  }
  std::vector<std::string> members;
  for (const std::string& ip : *ips) members.push_back(JoinHostPort(ip, first->port));
  members = RankOrder(std::move(members));
  if (static_cast<int>(members.size()) > cluster_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", first->host, "' resolves to ", members.size(), " addresses (",
        absl::StrJoin(members, ","), "), more than --cluster-size ", cluster_size));
  }
  const bool complete = static_cast<int>(members.size()) == cluster_size;
  return PeerResolution{std::move(members), complete, true};
}

}  // namespace cluster
}  // namespace rannc
