// Test helpers for groups whose ranks are separate processes: a gRPC store served by the test
// process on a loopback port, and spawning and reaping the rank processes. Header-only; uses
// Catch2's REQUIRE, so include it from tests only.
#ifndef RANNC_DAEMON_COMM_PROCESS_TESTING_H_
#define RANNC_DAEMON_COMM_PROCESS_TESTING_H_

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <catch2/catch.hpp>

#include "daemon/comm/grpc_store.h"

extern char** environ;

namespace rannc::testing {

// A StoreService over an in-memory store, on a free loopback port of this process.
struct StoreServer {
  StoreServer() : service(comm::MakeInMemoryStore()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
  }
  ~StoreServer() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }

  comm::StoreServiceImpl service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// A runfile of the running test, e.g. "daemon/comm/ucx/ucx_group_member".
inline std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  REQUIRE(srcdir != nullptr);
  return std::string(srcdir) + "/" + (workspace ? workspace : "rannc") + "/" + path;
}

// Starts args[0] with args, this process's environment included (runfiles variables too).
inline pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0);
  return pid;
}

// The exit status of `pid`, or -1 if it did not exit normally within `timeout` (it is then
// killed).
inline int Reap(pid_t pid, std::chrono::seconds timeout) {
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

}  // namespace rannc::testing

#endif  // RANNC_DAEMON_COMM_PROCESS_TESTING_H_
