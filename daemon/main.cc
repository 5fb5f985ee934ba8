// ranncd: flags -> DaemonOptions -> Daemon::Start(); then waits for SIGTERM/SIGINT, and stops
// within --stop-timeout, or at once on a second signal.
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "daemon/common/crash_report.h"
#include "daemon/common/json_log.h"
#include "daemon/config/options.h"
#include "daemon/daemon.h"

namespace {

// Started once a stop signal came: the stop's bound. A second stop signal, or `timeout` passing
// first, ends the process at once (status 1), saying which, whatever the stop is still waiting
// for: a step of a large model, a detached job's checkpoint, a handler that does not return. A
// clean stop returns from main before, which ends this thread with the rest. The stop signals
// are blocked in every thread, so sigtimedwait here takes the next one.
void ExitWhenStopTakesTooLong(sigset_t stop_signals, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int again = -1;
  while (again < 0) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds(0)) break;
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(left);
    timespec wait{};
    wait.tv_sec = static_cast<time_t>(seconds.count());
    wait.tv_nsec = static_cast<long>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(left - seconds).count());
    again = sigtimedwait(&stop_signals, nullptr, &wait);
    if (again < 0 && errno != EINTR && errno != EAGAIN) {
      std::this_thread::sleep_until(deadline);  // no signal can be waited for: the time alone
      break;
    }
  }
  if (again > 0) {
    spdlog::warn("signal {} again: exiting now, without waiting for what is still running",
                 again);
  } else {
    spdlog::error("still stopping {} s after the signal (--stop-timeout): exiting now, without "
                  "waiting for what is still running",
                  std::chrono::duration<double>(timeout).count());
  }
  spdlog::default_logger()->flush();
  std::_Exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  // A crash is reported on stderr (daemon/common/crash_report.h), by ranncd rather than by UCX
  // (whose own handler cannot unwind a call through a null pointer), unless the environment
  // says otherwise.
  setenv("UCX_HANDLE_ERRORS", "none", /*overwrite=*/0);
  rannc::InstallCrashReport();
  // Block the stop signals in every thread (gRPC's and LibTorch's inherit the mask) so that
  // sigwait below is the one place they arrive.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  spdlog::set_default_logger(spdlog::stderr_color_mt("ranncd"));
  absl::StatusOr<rannc::DaemonOptions> options =
      rannc::LoadDaemonOptions(argc, argv, rannc::ProcessEnvironment(), rannc::kRanncVersion);
  if (rannc::IsHelpOrVersion(options.status())) {
    std::cout << options.status().message() << std::endl;
    return 0;
  }
  if (!options.ok()) {
    std::cerr << "ranncd: " << options.status().message() << std::endl;
    return 2;
  }
  spdlog::set_level(spdlog::level::from_str(options->log_level));
  if (options->log_format == "json") rannc::UseJsonLogs(*spdlog::default_logger());
  if (!options->config_file.empty()) spdlog::info("config: {}", options->config_file);

  absl::StatusOr<std::unique_ptr<rannc::Daemon>> daemon = rannc::Daemon::Start(*options);
  if (!daemon.ok()) {
    spdlog::critical("cannot start: {}", std::string(daemon.status().message()));
    return 1;
  }
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  const double stop_timeout_s = std::chrono::duration<double>(options->stop_timeout).count();
  spdlog::info("signal {}: stopping; in-flight calls get 10 s to finish, and ranncd exits within "
               "{} s whatever is still running (--stop-timeout; a second signal: at once)",
               signal_number, stop_timeout_s);
  std::thread(ExitWhenStopTakesTooLong, stop_signals, options->stop_timeout).detach();
  (*daemon)->Shutdown(std::chrono::seconds(10));
  (*daemon)->Wait();
  spdlog::info("stopped");
  return 0;
}
