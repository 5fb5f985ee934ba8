// A child process that calls through a null function pointer dies of SIGSEGV, after a report
// on stderr naming the signal and the caller.
#include "daemon/common/crash_report.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include <catch2/catch.hpp>

namespace {

using Callback = void (*)();
Callback volatile null_callback = nullptr;

__attribute__((noinline)) void CallTheNullCallback() { null_callback(); }

}  // namespace

TEST_CASE("a fatal signal is reported, then kills the process as it would have") {
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    dup2(pipe_fds[1], STDERR_FILENO);
    rannc::InstallCrashReport();
    CallTheNullCallback();
    _exit(0);  // not reached
  }
  close(pipe_fds[1]);
  std::string report;
  char buffer[4096];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;) report.append(buffer, n);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  INFO(report);
  CHECK(report.find("fatal signal 11 (SIGSEGV) at address (nil)") != std::string::npos);
  CHECK(report.find("faulting instruction:") != std::string::npos);
  CHECK(report.find("called from:") != std::string::npos);
  CHECK(report.find("stack:") != std::string::npos);
  CHECK(report.find("*** end of the report ***") != std::string::npos);
}
