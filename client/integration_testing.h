// Test helpers for the end-to-end tests of the SDK and the `rannc` CLI (client_*integration_test):
// a real ranncd on a loopback port, shell commands and Python scripts run with their output, and
// the linear model the SDK and planning tests share, traced by /usr/bin/python3 (PyTorch), which
// also computes the expected results with plain PyTorch.
//
// The daemon binary is $RANNC_DAEMON_BIN if set, else daemon/ranncd in the runfiles. One daemon
// (--devices cpu:1) serves every test case of a test binary: Daemon() starts it on first use and
// it is stopped at exit; a test that needs a daemon of its own (other flags' environment) makes
// a DaemonProcess with another name. Files go to the test's own $TEST_TMPDIR.
//
//   Client& client = Daemon().client();
//   CommandResult r = Run(Cli() + " info --daemon " + Daemon().address());
//
// For a test's thread (Catch2 runs the cases of a binary on one thread); failures are Catch2
// REQUIREs of the calling test case.
#ifndef RANNC_CLIENT_INTEGRATION_TESTING_H_
#define RANNC_CLIENT_INTEGRATION_TESTING_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/rannc_client.h"

namespace rannc::testing {

// $name, or `fallback` when it is unset or empty.
std::string Env(const char* name, const std::string& fallback = "");
// The test's scratch directory ($TEST_TMPDIR, else /tmp).
std::string TmpDir();
// The path of `path` (relative to the workspace root) in the test's runfiles.
std::string Runfile(const std::string& path);
std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& text);
// A TCP port on 127.0.0.1 that was free a moment ago.
int FreeLoopbackPort();

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs `command` through /bin/sh, capturing stdout and stderr.
CommandResult Run(const std::string& command);

// Runs a Python script with /usr/bin/python3 (the interpreter that has torch).
void RunPython(const std::string& name, const std::string& script, const std::string& args);

// A ranncd child process and a Client of it. Its output goes to TmpDir()/NAME.log; `env` is set
// in its environment (e.g. the fault hook RANNC_TEST_DROP_RESPONSES).
class DaemonProcess {
 public:
  // `flags` go after --listen, --devices cpu:1 and --device-memory; `port` 0: a free one.
  explicit DaemonProcess(std::string name = "ranncd",
                         std::map<std::string, std::string> env = {},
                         ClientOptions client_options = {}, std::vector<std::string> flags = {},
                         int port = 0)
      : name_(std::move(name)),
        env_(std::move(env)),
        client_options_(std::move(client_options)),
        flags_(std::move(flags)),
        port_(port) {}
  // Starts ranncd and waits until it answers; on failure, stops it and returns the reason.
  absl::Status Start();
  void Stop();
  void Kill();  // SIGKILL, and reaped
  ~DaemonProcess() { Stop(); }

  const std::string& address() const { return address_; }
  Client& client() { return *client_; }
  std::string Log() const { return ReadFile(log_path_); }

 private:
  const std::string name_;
  const std::map<std::string, std::string> env_;
  const ClientOptions client_options_;
  const std::vector<std::string> flags_;
  const int port_;
  std::string binary_;
  std::string address_;
  std::string log_path_;
  pid_t pid_ = -1;
  std::unique_ptr<Client> client_;
};

// One daemon for all test cases, started by the first that needs it and stopped at exit. A
// failed start is remembered, so that later cases fail at once instead of waiting again.
DaemonProcess& Daemon();

// The `rannc` CLI in the runfiles.
std::string Cli();

// A linear model (Linear(4, 3) and an MSE loss of (x, y)) with PyTorch's results, and a bigger
// one whose weight spans several state_dict chunks.
struct LinearCase {
  std::string model;
  std::string big_model;         // Linear(1200, 1000)
  std::string big_weight_bytes;  // its weight, float32 [1000, 1200]
  HostTensor x, y;
  // "kind name" -> values, e.g. "sgd_param fc.weight", "sgd_loss 0".
  std::map<std::string, std::vector<double>> expected;
};

// Traced on first use.
const LinearCase& Linear();

}  // namespace rannc::testing

#endif  // RANNC_CLIENT_INTEGRATION_TESTING_H_
