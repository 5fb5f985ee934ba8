// The helpers of the SDK's and the CLI's end-to-end tests (integration_testing.h).
#include "client/integration_testing.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace rannc::testing {

std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

std::string TmpDir() { return Env("TEST_TMPDIR", "/tmp"); }

std::string Runfile(const std::string& path) {
  return Env("TEST_SRCDIR", ".") + "/" + Env("TEST_WORKSPACE", "rannc") + "/" + path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Runs `command` through /bin/sh, capturing stdout and stderr.
CommandResult Run(const std::string& command) {
  static int counter = 0;
  const std::string err_path = TmpDir() + "/cmd_stderr_" + std::to_string(++counter);
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>" + err_path).c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.out.append(buffer, n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.err = ReadFile(err_path);
  return result;
}

// Runs a Python script with /usr/bin/python3 (the interpreter that has torch).
void RunPython(const std::string& name, const std::string& script, const std::string& args) {
  const std::string path = TmpDir() + "/" + name + ".py";
  WriteFile(path, script);
  CommandResult r = Run("/usr/bin/python3 " + path + " " + args);
  INFO("python " << name << " stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

absl::Status DaemonProcess::Start() {
  binary_ = Env("RANNC_DAEMON_BIN", Runfile("daemon/ranncd"));
  address_ = "127.0.0.1:" + std::to_string(port_ != 0 ? port_ : FreeLoopbackPort());
  log_path_ = TmpDir() + "/" + name_ + ".log";
  pid_ = ::fork();
  if (pid_ < 0) return absl::InternalError("fork failed");
  if (pid_ == 0) {
    const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    // Keeps a developer's ~/.rannc/rannc.toml out of the test.
    ::setenv("RANNC_CONF_DIR", TmpDir().c_str(), 1);
    for (const auto& [name, value] : env_) ::setenv(name.c_str(), value.c_str(), 1);
    std::vector<std::string> args = {binary_, "--listen", address_, "--devices", "cpu:1",
                                     "--device-memory", "2GiB"};
    args.insert(args.end(), flags_.begin(), flags_.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(binary_.c_str(), argv.data());
    std::perror("exec ranncd");
    ::_exit(127);
  }
  client_ = std::make_unique<Client>(address_, client_options_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (std::chrono::steady_clock::now() < deadline) {
    if (client_->WaitUntilReady(absl::Seconds(1)).ok()) return absl::OkStatus();
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::UnavailableError("ranncd (" + binary_ + ") exited during startup; log:\n" +
                                    Log());
    }
  }
  Stop();
  return absl::DeadlineExceededError("ranncd (" + binary_ + ") did not answer on " + address_ +
                                     " within 90 s; log:\n" + Log());
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void DaemonProcess::Stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

// One daemon for all test cases, started by the first that needs it and stopped at exit. A
// failed start is remembered, so that later cases fail at once instead of waiting again.
DaemonProcess& Daemon() {
  static DaemonProcess* daemon = nullptr;
  static absl::Status started = [] {
    daemon = new DaemonProcess();
    absl::Status s = daemon->Start();
    std::atexit([] { delete daemon; });
    return s;
  }();
  INFO(started.ToString());
  REQUIRE(started.ok());
  return *daemon;
}

std::string Cli() { return Runfile("client/rannc"); }

namespace {

constexpr const char* kLinearScript = R"PY(
import copy, struct, sys
import torch

out = sys.argv[1]
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)

net = Net()
x = torch.randn(8, 4)
y = torch.randn(8, 3)
initial = copy.deepcopy(net)
torch.jit.trace(copy.deepcopy(net), (x, y)).save(out + "/linear.pt")

def raw(t):
    v = t.detach().flatten().tolist()
    return struct.pack("<%df" % len(v), *v)

open(out + "/x.bin", "wb").write(raw(x))
open(out + "/y.bin", "wb").write(raw(y))

lines = []
def record(kind, name, t):
    lines.append(" ".join([kind, name] + [repr(float(v)) for v in t.detach().flatten().tolist()]))

for name, p in initial.named_parameters():
    record("init", name, p)

def train(model, opt, tag):
    for step in range(3):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        lines.append("%s_loss %d %r" % (tag, step, loss.item()))
        if step == 0:
            for name, p in model.named_parameters():
                record(tag + "_grad0", name, p.grad)
        opt.step()
    lines.append("%s_loss 3 %r" % (tag, model(x, y).item()))
    for name, p in model.named_parameters():
        record(tag + "_param", name, p)

sgd_net = copy.deepcopy(initial)
train(sgd_net, torch.optim.SGD(sgd_net.parameters(), lr=0.1), "sgd")
sgdm_net = copy.deepcopy(initial)
train(sgdm_net, torch.optim.SGD(sgdm_net.parameters(), lr=0.1, momentum=0.9), "sgdm")
adamw_net = copy.deepcopy(initial)
train(adamw_net, torch.optim.AdamW(adamw_net.parameters(), lr=0.01, betas=(0.9, 0.999),
                                   eps=1e-8, weight_decay=0.01), "adamw")
open(out + "/expected.txt", "w").write("\n".join(lines) + "\n")

# A model whose weight (4.8 MB) spans several state_dict chunks.
big = torch.nn.Linear(1200, 1000)
torch.jit.trace(big, torch.randn(2, 1200)).save(out + "/big.pt")
open(out + "/big_weight.bin", "wb").write(raw(big.weight))
)PY";

}  // namespace

const LinearCase& Linear() {
  static const LinearCase* c = [] {
    const std::string dir = TmpDir() + "/linear";
    REQUIRE(Run("mkdir -p " + dir).exit_code == 0);
    RunPython("linear", kLinearScript, dir);
    auto* lc = new LinearCase;
    lc->model = ReadFile(dir + "/linear.pt");
    lc->big_model = ReadFile(dir + "/big.pt");
    lc->big_weight_bytes = ReadFile(dir + "/big_weight.bin");
    lc->x = HostTensor{v1::FLOAT32, {8, 4}, ReadFile(dir + "/x.bin")};
    lc->y = HostTensor{v1::FLOAT32, {8, 3}, ReadFile(dir + "/y.bin")};
    REQUIRE(lc->x.Validate().ok());
    REQUIRE(lc->y.Validate().ok());
    std::istringstream lines(ReadFile(dir + "/expected.txt"));
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::string kind, name;
      fields >> kind >> name;
      std::vector<double>& values = lc->expected[kind + " " + name];
      double v;
      while (fields >> v) values.push_back(v);
    }
    return lc;
  }();
  return *c;
}

}  // namespace rannc::testing
