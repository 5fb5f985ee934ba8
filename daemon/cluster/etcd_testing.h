// Test helper: a real etcd cluster of `members` processes on loopback ports, each with a data
// directory of its own under a temporary directory, started and waited for by the constructor,
// killed (SIGKILL) by the destructor or Kill(i). Needs Debian's etcd-server (/usr/bin/etcd or
// RANNC_ETCD_BIN); without it, `available()` is false and says why, and tests skip loudly.
// With `tls`, its clients must speak TLS and present a certificate of tls.ca (etcd's
// --client-cert-auth); credentials() is what they connect with.
// Header-only; uses Catch2, so include it from tests only.
#ifndef RANNC_DAEMON_CLUSTER_ETCD_TESTING_H_
#define RANNC_DAEMON_CLUSTER_ETCD_TESTING_H_

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_client.h"
#include "daemon/security/tls.h"

extern char** environ;

namespace rannc::testing {

// `n` distinct loopback ports nothing listens on now (each bound until all are chosen, then
// released: another process may take one before etcd does, which EtcdCluster then retries).
inline std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    fds.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

class EtcdCluster {
 public:
  explicit EtcdCluster(int members, security::TlsFiles tls = {}) : tls_(std::move(tls)) {
    const char* bin = std::getenv("RANNC_ETCD_BIN");
    binary_ = bin != nullptr ? bin : "/usr/bin/etcd";
    if (::access(binary_.c_str(), X_OK) != 0) {
      why_ = binary_ + " is missing: install Debian's etcd-server (deploy/setup.sh does)";
      return;
    }
    char dir[] = "/tmp/rannc-etcd-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    dir_ = dir;
    // A member that exits before it answers most often lost its port to another process
    // between FreePorts and its bind: start the whole cluster again on other ports.
    constexpr int kAttempts = 4;
    for (int attempt = 1; attempt <= kAttempts; ++attempt) {
      std::string exited;
      if (Start(members, attempt, &exited)) return;
      WARN("etcd start " << attempt << " of " << kAttempts << ": member " << exited
                         << " exited before it answered; starting the cluster again on other "
                            "ports. The end of its log:\n"
                         << LogTail(dir_ + "/" + exited + ".log"));
      for (size_t i = 0; i < members_.size(); ++i) Kill(static_cast<int>(i));
    }
    FAIL("etcd did not start in " << kAttempts << " attempts (logs under " << dir_ << ")");
  }

  ~EtcdCluster() {
    for (size_t i = 0; i < members_.size(); ++i) Kill(static_cast<int>(i));
    if (!dir_.empty()) std::system(("rm -rf '" + dir_ + "'").c_str());
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  bool available() const { return why_.empty(); }
  // What its clients connect with: null for plain text; with TLS, the server's own certificate
  // (of the CA) as the client's.
  std::shared_ptr<grpc::ChannelCredentials> credentials() const {
    if (!tls_.enabled()) return nullptr;
    return security::ChannelCredentials(tls_, std::chrono::seconds(60));
  }
  const std::string& why() const { return why_; }

  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (const Member& m : members_) out.push_back(m.client);
    return out;
  }
  std::string url() const {
    std::string out = "etcd://";
    for (size_t i = 0; i < members_.size(); ++i) out += (i ? "," : "") + members_[i].client;
    return out;
  }

  void Kill(int i) {
    Member& m = members_[i];
    if (m.pid <= 0) return;
    ::kill(m.pid, SIGKILL);
    ::waitpid(m.pid, nullptr, 0);
    m.pid = -1;
  }

 private:
  struct Member {
    std::string name, client, peer;
    pid_t pid = -1;
  };

  static std::string LogTail(const std::string& path) {
    std::ifstream in(path);
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return log.size() > 1000 ? log.substr(log.size() - 1000) : log;
  }

  // Spawns `members` members on fresh ports with fresh data directories and waits until a
  // client's call through each answers; false (naming the member in *exited) if one exits
  // first.
  bool Start(int members, int attempt, std::string* exited) {
    members_.clear();
    const std::vector<int> ports = FreePorts(2 * members);
    std::string initial;
    for (int i = 0; i < members; ++i) {
      Member m;
      m.name = "m" + std::to_string(i);
      m.client = "127.0.0.1:" + std::to_string(ports[2 * i]);
      m.peer = "http://127.0.0.1:" + std::to_string(ports[2 * i + 1]);
      initial += (i ? "," : "") + m.name + "=" + m.peer;
      members_.push_back(m);
    }
    const std::string data = dir_ + "/attempt" + std::to_string(attempt);
    for (Member& m : members_) {
      const std::string client_url = (tls_.enabled() ? "https://" : "http://") + m.client;
      std::vector<std::string> args = {
          binary_, "--name", m.name, "--data-dir", data + "/" + m.name,
          "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
          "--listen-peer-urls", m.peer, "--initial-advertise-peer-urls", m.peer,
          "--initial-cluster", initial, "--initial-cluster-state", "new",
          "--initial-cluster-token", data, "--heartbeat-interval", "50",
          "--election-timeout", "500", "--logger", "zap", "--log-level", "error",
          "--log-outputs", dir_ + "/" + m.name + ".log"};
      if (tls_.enabled()) {
        args.insert(args.end(), {"--cert-file", tls_.cert, "--key-file", tls_.key,
                                 "--trusted-ca-file", tls_.ca, "--client-cert-auth"});
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      REQUIRE(::posix_spawn(&m.pid, binary_.c_str(), nullptr, nullptr, argv.data(), environ) ==
              0);
    }
    // Up when a client's call through every member answers.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (Member& m : members_) {
      while (true) {
        auto client =
            cluster::EtcdClient::Connect({m.client}, std::chrono::seconds(1), credentials());
        if (client.ok() && (*client)->Put("/rannc-test/ready", m.name).ok()) break;
        INFO("etcd member " << m.name << " at " << m.client << " (log: " << dir_ << "/"
                            << m.name << ".log)");
        int status = 0;
        if (::waitpid(m.pid, &status, WNOHANG) != 0) {  // it exited
          m.pid = -1;
          *exited = m.name;
          return false;
        }
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    return true;
  }

  security::TlsFiles tls_;
  std::string binary_, dir_, why_;
  std::vector<Member> members_;
};

// Polls `done` every 20 ms until it holds or `limit` passes; whether it held.
template <typename Fn>
bool Eventually(Fn done, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// Skips the rest of a test case, loudly, where etcd is not installed.
#define RANNC_REQUIRE_ETCD(cluster)                                  \
  if (!(cluster).available()) {                                      \
    WARN("SKIPPED (etcd is not available): " << (cluster).why());    \
    return;                                                          \
  }

}  // namespace rannc::testing

#endif  // RANNC_DAEMON_CLUSTER_ETCD_TESTING_H_
