// ranncd: flags -> DaemonOptions -> Daemon::Start(); then waits for SIGTERM/SIGINT.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "daemon/common/crash_report.h"
#include "daemon/common/json_log.h"
#include "daemon/config/options.h"
#include "daemon/daemon.h"

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
  spdlog::info("signal {}: stopping; in-flight calls get 10 s to finish", signal_number);
  (*daemon)->Shutdown(std::chrono::seconds(10));
  (*daemon)->Wait();
  spdlog::info("stopped");
  return 0;
}
