// UCX groups whose ranks are separate processes, meeting through the gRPC store (as ranks on
// different daemons do): the ranks run //daemon/comm/ucx:ucx_group_member.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <catch2/catch.hpp>

#include "daemon/comm/grpc_store.h"

extern char** environ;

namespace rannc {
namespace comm {
namespace {

std::string MemberBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  REQUIRE(srcdir != nullptr);
  return std::string(srcdir) + "/" + (workspace ? workspace : "rannc") +
         "/daemon/comm/ucx/ucx_group_member";
}

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0);
  return pid;
}

// The exit status of `pid`, or -1 if it has not exited within `timeout` (then it is killed).
int Reap(pid_t pid, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

struct StoreServer {
  StoreServer() : service(MakeInMemoryStore()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
  }
  ~StoreServer() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  StoreServiceImpl service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

TEST_CASE("Ranks in separate processes form a UCX group through the gRPC store", "[comm]") {
  StoreServer store;
  for (int size : {2, 3}) {
    INFO(size << " processes");
    const std::string group = "cross" + std::to_string(size);
    std::vector<pid_t> pids;
    for (int r = 0; r < size; ++r) {
      pids.push_back(Spawn({MemberBinary(), store.address(), group, std::to_string(r),
                            std::to_string(size), "30000"}));
    }
    for (int r = 0; r < size; ++r) {
      INFO("rank " << r);
      CHECK(Reap(pids[r], std::chrono::seconds(60)) == 0);
    }
  }
}

TEST_CASE("A rank whose peer never comes fails its setup within the timeout", "[comm]") {
  StoreServer store;
  const auto start = std::chrono::steady_clock::now();
  pid_t alone = Spawn({MemberBinary(), store.address(), "alone", "0", "2", "1500"});
  CHECK(Reap(alone, std::chrono::seconds(30)) == 2);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
}

}  // namespace
}  // namespace comm
}  // namespace rannc
