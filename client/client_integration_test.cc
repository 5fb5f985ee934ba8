// End-to-end tests of the SDK and the `rannc` CLI against a real ranncd on a loopback port.
// The models are traced at test time by /usr/bin/python3 (PyTorch), which also computes the
// expected results with plain PyTorch; the daemon must match them within fp32 round-off.
//
// The daemon binary is $RANNC_DAEMON_BIN if set, else daemon/ranncd in the runfiles. One daemon
// (--devices cpu:1) serves every test case of this binary and is stopped at exit.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "client/rannc_client.h"

namespace rannc {
namespace {

std::string Env(const char* name, const std::string& fallback = "") {
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

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

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

class DaemonProcess {
 public:
  // Starts ranncd and waits until it answers; on failure, stops it and returns the reason.
  absl::Status Start() {
    binary_ = Env("RANNC_DAEMON_BIN", Runfile("daemon/ranncd"));
    address_ = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
    log_path_ = TmpDir() + "/ranncd.log";
    pid_ = ::fork();
    if (pid_ < 0) return absl::InternalError("fork failed");
    if (pid_ == 0) {
      const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(log, STDOUT_FILENO);
      ::dup2(log, STDERR_FILENO);
      // Keeps a developer's ~/.rannc/rannc.toml out of the test.
      ::setenv("RANNC_CONF_DIR", TmpDir().c_str(), 1);
      ::execl(binary_.c_str(), binary_.c_str(), "--listen", address_.c_str(), "--devices",
              "cpu:1", "--device-memory", "2GiB", static_cast<char*>(nullptr));
      std::perror("exec ranncd");
      ::_exit(127);
    }
    client_ = std::make_unique<Client>(address_);
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

  void Stop() {
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

  ~DaemonProcess() { Stop(); }

  const std::string& address() const { return address_; }
  Client& client() { return *client_; }
  std::string Log() const { return ReadFile(log_path_); }

 private:
  std::string binary_;
  std::string address_;
  std::string log_path_;
  pid_t pid_ = -1;
  std::unique_ptr<Client> client_;
};

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

// ---------------------------------------------------------------------------------------------
// The linear model and its PyTorch reference.

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
adamw_net = copy.deepcopy(initial)
train(adamw_net, torch.optim.AdamW(adamw_net.parameters(), lr=0.01, betas=(0.9, 0.999),
                                   eps=1e-8, weight_decay=0.01), "adamw")
open(out + "/expected.txt", "w").write("\n".join(lines) + "\n")

# A model whose weight (4.8 MB) spans several state_dict chunks.
big = torch.nn.Linear(1200, 1000)
torch.jit.trace(big, torch.randn(2, 1200)).save(out + "/big.pt")
open(out + "/big_weight.bin", "wb").write(raw(big.weight))
)PY";

struct LinearCase {
  std::string model;
  std::string big_model;         // Linear(1200, 1000)
  std::string big_weight_bytes;  // its weight, float32 [1000, 1200]
  HostTensor x, y;
  // "kind name" -> values, e.g. "sgd_param fc.weight", "sgd_loss 0".
  std::map<std::string, std::vector<double>> expected;
};

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

const std::vector<double>& Expected(const std::string& key) {
  const auto& expected = Linear().expected;
  auto it = expected.find(key);
  INFO("expected.txt has no '" << key << "'");
  REQUIRE(it != expected.end());
  return it->second;
}

void CheckClose(const std::vector<double>& actual, const std::vector<double>& expected,
                const std::string& what) {
  INFO(what);
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    INFO("element " << i);
    CHECK(actual[i] == Approx(expected[i]).epsilon(1e-5).margin(1e-7));
  }
}

std::vector<double> Values(const absl::StatusOr<HostTensor>& t) {
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  absl::StatusOr<std::vector<double>> v = t->ToDoubles();
  REQUIRE(v.ok());
  return *v;
}

std::string CreateLinearJob(Client& client, v1::OptimizerType optimizer, const std::string& name) {
  JobConfig config;
  config.name = name;
  config.mode.set_training(true);
  config.optimizer.set_type(optimizer);
  config.example_inputs = {Linear().x, Linear().y};
  config.input_names = {"x", "y"};
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(Linear().model, config);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  CHECK(!job->job_id().empty());
  REQUIRE(job->outputs_size() == 1);
  CHECK(job->outputs(0).dtype() == v1::FLOAT32);
  CHECK(job->outputs(0).shape_size() == 0);
  std::set<std::string> names;
  for (const v1::ParamInfo& p : job->params()) names.insert(p.name());
  CHECK(names == std::set<std::string>{"fc.weight", "fc.bias"});
  return job->job_id();
}

double ForwardLoss(Client& client, const std::string& job_id, bool requires_grad = true) {
  absl::StatusOr<ForwardResult> out =
      client.Forward(job_id, {Linear().x, Linear().y}, requires_grad);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  REQUIRE(out->outputs.size() == 1);
  std::vector<double> loss = Values(out->outputs[0]);
  REQUIRE(loss.size() == 1);
  return loss[0];
}

void TrainThreeSteps(Client& client, const std::string& job_id, const v1::HyperParams& hyper,
                     const std::string& tag) {
  for (int step = 0; step < 3; ++step) {
    INFO(tag << " step " << step);
    REQUIRE(client.ZeroGrad(job_id).ok());
    const double loss = ForwardLoss(client, job_id);
    CheckClose({loss}, Expected(tag + "_loss " + std::to_string(step)), "loss");
    absl::Status s = client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}});
    INFO(s.ToString());
    REQUIRE(s.ok());
    if (step == 0) {
      for (const char* name : {"fc.weight", "fc.bias"}) {
        absl::StatusOr<std::optional<HostTensor>> grad = client.GetParamGrad(job_id, name);
        INFO(grad.status().ToString());
        REQUIRE(grad.ok());
        REQUIRE(grad->has_value());
        CheckClose(Values(**grad), Expected(tag + "_grad0 " + name), std::string("grad ") + name);
      }
    }
    s = client.Step(job_id, {hyper});
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CheckClose({ForwardLoss(client, job_id, false)}, Expected(tag + "_loss 3"), "loss after 3 steps");
  for (const char* name : {"fc.weight", "fc.bias"}) {
    CheckClose(Values(client.GetParam(job_id, name)), Expected(tag + "_param " + std::string(name)),
               std::string("param ") + name);
  }
}

TEST_CASE("a linear model trains with SGD exactly as in PyTorch", "[integration]") {
  Client& client = Daemon().client();
  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-sgd");
  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  TrainThreeSteps(client, job_id, sgd, "sgd");

  absl::StatusOr<std::vector<v1::JobSummary>> jobs = client.ListJobs();
  REQUIRE(jobs.ok());
  bool listed = false;
  for (const v1::JobSummary& job : *jobs) {
    if (job.job_id() != job_id) continue;
    listed = true;
    CHECK(job.name() == "linear-sgd");
    CHECK(job.state() == v1::DEPLOYED);
    CHECK(job.steps() == 3);
    CHECK(job.num_params() == 4 * 3 + 3);
  }
  CHECK(listed);
  REQUIRE(client.DeleteJob(job_id).ok());
}

TEST_CASE("a linear model trains with AdamW exactly as in PyTorch", "[integration]") {
  Client& client = Daemon().client();
  const std::string job_id = CreateLinearJob(client, v1::ADAMW, "linear-adamw");
  v1::HyperParams adamw;
  adamw.set_lr(0.01);
  adamw.set_beta1(0.9);
  adamw.set_beta2(0.999);
  adamw.set_eps(1e-8);
  adamw.set_weight_decay(0.01);
  TrainThreeSteps(client, job_id, adamw, "adamw");
  REQUIRE(client.DeleteJob(job_id).ok());
}

bool Listed(Client& client, const std::string& job_id, v1::JobSummary* summary = nullptr) {
  absl::StatusOr<std::vector<v1::JobSummary>> jobs = client.ListJobs();
  REQUIRE(jobs.ok());
  for (const v1::JobSummary& job : *jobs) {
    if (job.job_id() != job_id) continue;
    if (summary != nullptr) *summary = job;
    return true;
  }
  return false;
}

TEST_CASE("a leased job lives while its LeaseKeeper does and is deleted after", "[integration]") {
  Client& client = Daemon().client();
  JobConfig config;
  config.name = "linear-leased";
  config.mode.set_training(true);
  config.optimizer.set_type(v1::SGD);
  config.example_inputs = {Linear().x, Linear().y};
  config.options.set_lease_ms(1000);
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(Linear().model, config);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  const std::string id = job->job_id();
  {
    LeaseKeeper keeper(client, id, absl::Seconds(1));
    // Two and a half leases with no call of ours: only the keeper's renewals keep the job.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    v1::JobSummary summary;
    REQUIRE(Listed(client, id, &summary));
    CHECK(summary.lease_ms() == 1000);
    CHECK(summary.idle_ms() < 1000);
    CHECK(ForwardLoss(client, id) > 0);
  }
  // Now nobody renews it: gone within its lease and the daemon's once-a-second sweep.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(6);
  while (Listed(client, id) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK_FALSE(Listed(client, id));
  CHECK(client.ZeroGrad(id).code() == absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<std::string>> unknown = client.RenewLeases({id});
  REQUIRE(unknown.ok());
  CHECK(*unknown == std::vector<std::string>{id});
}

TEST_CASE("state_dict round-trips through StateDict and LoadStateDict", "[integration]") {
  Client& client = Daemon().client();
  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-state");
  const double initial_loss = ForwardLoss(client, job_id, false);
  CheckClose({initial_loss}, Expected("sgd_loss 0"), "initial loss");

  absl::StatusOr<NamedTensors> state = client.StateDict(job_id);
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  REQUIRE(state->count("fc.weight") == 1);
  REQUIRE(state->count("fc.bias") == 1);
  CHECK(state->at("fc.weight").shape == std::vector<int64_t>{3, 4});
  CheckClose(Values(state->at("fc.weight")), Expected("init fc.weight"), "state fc.weight");

  // Move the parameters away from the start, then load the saved state back.
  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  REQUIRE(client.ZeroGrad(job_id).ok());
  ForwardLoss(client, job_id);
  REQUIRE(client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
  REQUIRE(client.Step(job_id, {sgd}).ok());
  CHECK(ForwardLoss(client, job_id, false) != Approx(initial_loss).epsilon(1e-7));

  absl::StatusOr<LoadStateDictResult> loaded = client.LoadStateDict(job_id, *state);
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  CHECK(loaded->missing_keys.empty());
  CHECK(loaded->unexpected_keys.empty());
  CheckClose({ForwardLoss(client, job_id, false)}, {initial_loss}, "loss after LoadStateDict");
  CheckClose(Values(client.GetParam(job_id, "fc.bias")), Expected("init fc.bias"),
             "fc.bias after LoadStateDict");

  // strict=true: an unknown key is an error that names it.
  NamedTensors extra = *state;
  extra["not_a_param"] = HostTensor::FromVector<float>({1});
  absl::StatusOr<LoadStateDictResult> rejected = client.LoadStateDict(job_id, extra, true);
  CHECK(!rejected.ok());
  CHECK(rejected.status().message().find("not_a_param") != std::string::npos);

  // ClipGradNorm over a fresh gradient returns the norm before clipping.
  REQUIRE(client.ZeroGrad(job_id).ok());
  ForwardLoss(client, job_id);
  REQUIRE(client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
  double expected_sq = 0;
  for (const char* name : {"fc.weight", "fc.bias"}) {
    for (double g : Expected(std::string("sgd_grad0 ") + name)) expected_sq += g * g;
  }
  absl::StatusOr<double> norm = client.ClipGradNorm(job_id, 1e-3);
  INFO(norm.status().ToString());
  REQUIRE(norm.ok());
  CHECK(*norm == Approx(std::sqrt(expected_sq)).epsilon(1e-5));
  double clipped_sq = 0;
  for (const char* name : {"fc.weight", "fc.bias"}) {
    absl::StatusOr<std::optional<HostTensor>> grad = client.GetParamGrad(job_id, name);
    REQUIRE(grad.ok());
    REQUIRE(grad->has_value());
    for (double g : Values(**grad)) clipped_sq += g * g;
  }
  CHECK(std::sqrt(clipped_sq) == Approx(1e-3).epsilon(1e-3));

  REQUIRE(client.DeleteJob(job_id).ok());
}

TEST_CASE("a state_dict larger than one chunk round-trips", "[integration]") {
  Client& client = Daemon().client();
  JobConfig config;
  config.name = "big-state";
  config.example_inputs = {HostTensor::Full(v1::FLOAT32, {2, 1200}, 0.5)};
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(Linear().big_model, config);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  const std::string job_id = job->job_id();

  absl::StatusOr<NamedTensors> state = client.StateDict(job_id);
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  REQUIRE(state->count("weight") == 1);
  CHECK(state->at("weight").shape == std::vector<int64_t>{1000, 1200});
  CHECK(state->at("weight").data == Linear().big_weight_bytes);  // bit-exact

  // Zero parameters give zero outputs; loading the saved state back restores every bit.
  NamedTensors zeros;
  for (const auto& [name, tensor] : *state) {
    zeros[name] = HostTensor::Full(tensor.dtype, tensor.shape, 0);
  }
  absl::StatusOr<LoadStateDictResult> loaded = client.LoadStateDict(job_id, zeros);
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  absl::StatusOr<ForwardResult> out = client.Forward(job_id, config.example_inputs, false);
  REQUIRE(out.ok());
  REQUIRE(out->outputs.size() == 1);
  CHECK(out->outputs[0].shape == std::vector<int64_t>{2, 1000});
  CHECK(out->outputs[0].data == std::string(2 * 1000 * 4, '\0'));

  REQUIRE(client.LoadStateDict(job_id, *state).ok());
  absl::StatusOr<NamedTensors> again = client.StateDict(job_id);
  REQUIRE(again.ok());
  CHECK(again->at("weight").data == Linear().big_weight_bytes);
  CHECK(again->at("bias").data == state->at("bias").data);
  REQUIRE(client.DeleteJob(job_id).ok());
}

TEST_CASE("modes: SetMode reports a missing graph until AddMode uploads it", "[integration]") {
  Client& client = Daemon().client();
  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-modes");
  v1::Mode eval;  // training=false, dropout=false
  absl::StatusOr<bool> has_graph = client.SetMode(job_id, eval);
  INFO(has_graph.status().ToString());
  REQUIRE(has_graph.ok());
  CHECK(!*has_graph);
  absl::Status added = client.AddMode(job_id, eval, Linear().model);
  INFO(added.ToString());
  REQUIRE(added.ok());
  has_graph = client.SetMode(job_id, eval);
  REQUIRE(has_graph.ok());
  CHECK(*has_graph);
  CheckClose({ForwardLoss(client, job_id, false)}, Expected("sgd_loss 0"), "eval loss");
  REQUIRE(client.DeleteJob(job_id).ok());
}

TEST_CASE("the daemon's errors reach the client with their codes", "[integration]") {
  Client& client = Daemon().client();
  CHECK(client.Forward("no-such-job", {Linear().x, Linear().y}).status().code() ==
        absl::StatusCode::kNotFound);
  CHECK(client.DeleteJob("no-such-job").code() == absl::StatusCode::kNotFound);

  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-errors");
  absl::Status early = client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}});
  INFO(early.ToString());
  CHECK(early.code() == absl::StatusCode::kFailedPrecondition);

  HostTensor wrong = HostTensor::FromVector<float>(std::vector<float>(8 * 5), {8, 5});
  absl::Status bad_shape = client.Forward(job_id, {wrong, Linear().y}).status();
  INFO(bad_shape.ToString());
  CHECK(bad_shape.code() == absl::StatusCode::kInvalidArgument);

  JobConfig garbage;
  garbage.name = "garbage";
  garbage.example_inputs = {Linear().x};
  absl::Status not_a_model = client.CreateJob("this is not a TorchScript file", garbage).status();
  INFO(not_a_model.ToString());
  CHECK(not_a_model.code() == absl::StatusCode::kInvalidArgument);

  REQUIRE(client.DeleteJob(job_id).ok());
  CHECK(client.Forward(job_id, {Linear().x, Linear().y}).status().code() ==
        absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// The CLI.

std::string Cli() { return Runfile("client/rannc"); }

TEST_CASE("rannc info shows the daemon", "[integration]") {
  const std::string address = Daemon().address();
  CommandResult r = Run(Cli() + " info --daemon " + address);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("LibTorch 1.13") != std::string::npos);
  CHECK(r.out.find("cpu:0") != std::string::npos);
  CHECK(r.out.find("2.0 GiB") != std::string::npos);
  CHECK(std::regex_search(r.out, std::regex("jobs: [0-9]+")));

  // The address can come from the environment too.
  CommandResult env = Run("RANNC_DAEMON=" + address + " " + Cli() + " info");
  CHECK(env.exit_code == 0);
  CHECK(env.out.find(address) != std::string::npos);

  CommandResult jobs = Run(Cli() + " jobs --daemon " + address);
  CHECK(jobs.exit_code == 0);
  CHECK(jobs.out.find("JOB ID") != std::string::npos);
}

TEST_CASE("rannc reports errors with a non-zero exit code", "[integration]") {
  CommandResult missing = Run(Cli() + " delete no-such-job --daemon " + Daemon().address());
  CHECK(missing.exit_code != 0);
  CHECK(missing.err.find("DeleteJob") != std::string::npos);
  CHECK(missing.err.find("no-such-job") != std::string::npos);

  CommandResult unreachable = Run(Cli() + " info --daemon 127.0.0.1:" +
                                  std::to_string(FreeLoopbackPort()));
  CHECK(unreachable.exit_code != 0);
  CHECK(unreachable.err.find("cannot reach ranncd") != std::string::npos);
}

constexpr const char* kLmScript = R"PY(
import random, struct, sys
import torch
import torch.nn.functional as F

out = sys.argv[1]
torch.manual_seed(0)
V, D = 16, 32

class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.fc = torch.nn.Linear(D, V)

    def forward(self, input_ids, targets):
        logits = self.fc(torch.tanh(self.emb(input_ids)))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

ids = torch.randint(0, V, (4, 16))
torch.jit.trace(TinyLM(), (ids, ids)).save(out + "/lm.pt")

# A fixed cycle through a permutation: each token determines the next, so the loss can fall
# from ln(16) toward zero.
perm = list(range(V))
random.Random(0).shuffle(perm)
tokens = [perm[i % V] for i in range(4096)]
open(out + "/tokens.bin", "wb").write(struct.pack("<%dH" % len(tokens), *tokens))
)PY";

TEST_CASE("rannc train lowers the loss of a tiny language model", "[integration]") {
  const std::string dir = TmpDir() + "/lm";
  REQUIRE(Run("mkdir -p " + dir).exit_code == 0);
  RunPython("lm", kLmScript, dir);

  CommandResult r = Run(Cli() + " train " + dir + "/lm.pt --tokens " + dir +
                        "/tokens.bin --token-dtype uint16 --batch 4 --seq 16 --steps 30"
                        " --lr 0.05 --optimizer adamw --log-every 10 --seed 3 --name tiny-lm"
                        " --daemon " + Daemon().address());
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  // Not a TTY: one plain line per --log-every.
  CHECK(std::regex_search(r.out, std::regex("step 10/30 loss [0-9.]+ tokens/s [0-9.]+")));
  CHECK(std::regex_search(r.out, std::regex("step 30/30 loss")));
  std::smatch m;
  REQUIRE(std::regex_search(
      r.out, m, std::regex("summary: steps=30 first_loss=([0-9.]+) last_loss=([0-9.]+) "
                           "tokens/s=([0-9.]+)")));
  const double first = std::stod(m[1]);
  const double last = std::stod(m[2]);
  CHECK(first == Approx(std::log(16.0)).epsilon(0.25));  // an untrained model is near uniform
  CHECK(last < 0.5 * first);
  CHECK(std::stod(m[3]) > 0);

  // The job is gone afterwards.
  absl::StatusOr<std::vector<v1::JobSummary>> jobs = Daemon().client().ListJobs();
  REQUIRE(jobs.ok());
  for (const v1::JobSummary& job : *jobs) CHECK(job.name() != "tiny-lm");
}

// ---------------------------------------------------------------------------------------------
// Planning: dry runs, deployments, `rannc plan`.

constexpr const char* kMlpScript = R"PY(
import sys
import torch
import torch.nn.functional as F

out = sys.argv[1]
torch.manual_seed(0)

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.l3 = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        return F.cross_entropy(self.l3(h), y)

x = torch.randn(16, 8)
y = torch.randint(0, 4, (16,))
torch.jit.trace(MLP().train(), (x, y)).save(out + "/mlp.pt")
)PY";

// A three-layer MLP (x float32[16, 8], y int64[16]) -> loss, traced in training mode.
const std::string& MlpModelPath() {
  static const std::string* path = [] {
    const std::string dir = TmpDir() + "/mlp";
    REQUIRE(Run("mkdir -p " + dir).exit_code == 0);
    RunPython("mlp", kMlpScript, dir);
    return new std::string(dir + "/mlp.pt");
  }();
  return *path;
}

JobConfig MlpConfig() {
  JobConfig config;
  config.name = "mlp-plan";
  config.mode.set_training(true);
  config.optimizer.set_type(v1::ADAMW);
  std::vector<float> x(16 * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i % 7) - 3) * 0.25f;
  config.example_inputs = {HostTensor::FromVector<float>(x, {16, 8}),
                           HostTensor::Full(v1::INT64, {16}, 1)};
  config.input_names = {"x", "y"};
  return config;
}

void CheckCovers(const v1::Deployment& d, uint32_t num_devices) {
  INFO(d.DebugString());
  REQUIRE(d.stages_size() >= 1);
  CHECK(d.format_version() == 1);
  CHECK(!d.model_hash().empty());
  uint32_t next = 0;
  for (int i = 0; i < d.stages_size(); ++i) {
    const v1::DeploymentStage& s = d.stages(i);
    CHECK(s.index() == static_cast<uint32_t>(i));
    CHECK(s.first_node() == next);
    CHECK(s.end_node() > s.first_node());
    next = s.end_node();
    CHECK(s.devices_size() >= 1);
    for (uint32_t device : s.devices()) CHECK(device < num_devices);
  }
  CHECK(next == d.num_nodes());
}

size_t JobCount(Client& client) {
  absl::StatusOr<std::vector<v1::JobSummary>> jobs = client.ListJobs();
  REQUIRE(jobs.ok());
  return jobs->size();
}

TEST_CASE("a dry run plans the MLP for 4 devices and creates no job", "[integration][plan]") {
  Client& client = Daemon().client();
  const std::string model = ReadFile(MlpModelPath());
  const size_t jobs_before = JobCount(client);
  JobConfig config = MlpConfig();
  config.dry_run.set_num_devices(4);
  config.dry_run.set_device_memory_bytes(1ull << 30);
  config.dry_run.set_batch_size(16);
  absl::StatusOr<v1::CreateJobResponse> plan = client.CreateJob(model, config);
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  CHECK(plan->job_id().empty());
  if (!plan->job_id().empty()) (void)client.DeleteJob(plan->job_id());  // keep others' counts
  REQUIRE(plan->has_deployment());
  CheckCovers(plan->deployment(), 4);
  CHECK(plan->deployment().num_devices() == 4);
  CHECK(plan->deployment().device_memory_bytes() == (1ull << 30));
  CHECK(plan->deployment().batch_size() == 16);
  CHECK(!plan->plan_summary().empty());
  CHECK(JobCount(client) == jobs_before);

  // partition_num fixes the number of stages.
  config.config["partition_num"] = "2";
  plan = client.CreateJob(model, config);
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  CHECK(plan->deployment().stages_size() == 2);
  CheckCovers(plan->deployment(), 4);
}

TEST_CASE("a job runs a loaded deployment and refuses another model's", "[integration][plan]") {
  Client& client = Daemon().client();
  const std::string model = ReadFile(MlpModelPath());
  // Planned for the daemon's own device, so that the plan fits it.
  JobConfig dry = MlpConfig();
  dry.dry_run.set_num_devices(1);
  absl::StatusOr<v1::CreateJobResponse> plan = client.CreateJob(model, dry);
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  REQUIRE(plan->has_deployment());

  JobConfig load = MlpConfig();
  load.load_deployment = plan->deployment().SerializeAsString();
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(model, load);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  CHECK(!job->job_id().empty());
  CHECK(job->deployment().loaded());
  CHECK(job->deployment().model_hash() == plan->deployment().model_hash());
  absl::StatusOr<ForwardResult> out = client.Forward(job->job_id(), load.example_inputs);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  REQUIRE(client.DeleteJob(job->job_id()).ok());

  JobConfig other;
  other.name = "linear-with-mlp-plan";
  other.mode.set_training(true);
  other.example_inputs = {Linear().x, Linear().y};
  other.load_deployment = plan->deployment().SerializeAsString();
  absl::Status refused = client.CreateJob(Linear().model, other).status();
  INFO(refused.ToString());
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()), Catch::Contains("model", Catch::CaseSensitive::No));
}

TEST_CASE("rannc plan plans, saves, and shows a deployment", "[integration][plan]") {
  const std::string saved = TmpDir() + "/mlp_plan.pb";
  std::remove(saved.c_str());
  CommandResult r = Run(Cli() + " plan " + MlpModelPath() +
                        " --devices 4 --device-memory 1GiB --batch 32 --input float32:16x8"
                        " --input int64:16 --config partition_num=2 --schedule gpipe --save " +
                        saved + " --daemon " + Daemon().address());
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("saved the deployment to " + saved) != std::string::npos);
  v1::Deployment d;
  REQUIRE(d.ParseFromString(ReadFile(saved)));
  CheckCovers(d, 4);
  CHECK(d.stages_size() == 2);
  CHECK(d.batch_size() == 32);
  CHECK(d.schedule() == v1::SCHEDULE_GPIPE);

  CommandResult show = Run(Cli() + " plan --show " + saved + " --batch 64");
  INFO("stdout:\n" << show.out << "\nstderr:\n" << show.err);
  REQUIRE(show.exit_code == 0);
  CHECK(std::regex_search(show.out, std::regex("cpu:0 -> stage 0, micro-batch size [0-9]+")));
}

// Needs no planner in the daemon: the deployment file is built here.
TEST_CASE("rannc plan --show prints a deployment file without a daemon", "[integration][plan]") {
  v1::Deployment d;
  d.set_format_version(1);
  d.set_model_hash("feedface");
  d.set_num_nodes(5);
  d.set_batch_size(32);
  d.set_device_type("cuda");
  d.set_num_devices(2);
  d.set_micro_batches(2);
  for (uint32_t i = 0; i < 2; ++i) {
    v1::DeploymentStage* s = d.add_stages();
    s->set_index(i);
    s->set_first_node(i == 0 ? 0 : 3);
    s->set_end_node(i == 0 ? 3 : 5);
    s->add_devices(i);
    s->add_ops("aten::linear");
  }
  const std::string path = TmpDir() + "/hand_made.pb";
  WriteFile(path, d.SerializeAsString());
  // An unreachable --daemon proves no daemon is involved.
  const std::string nowhere = " --daemon 127.0.0.1:" + std::to_string(FreeLoopbackPort());
  CommandResult r = Run(Cli() + " plan --show " + path + " --batch 9" + nowhere);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("feedface") != std::string::npos);
  CHECK(r.out.find("cuda:0 -> stage 0, micro-batch size 5") != std::string::npos);  // ceil(9/2)
  CHECK(r.out.find("cuda:1 -> stage 1, micro-batch size 5") != std::string::npos);
  // Without --batch: the planned batch, 32 / 2.
  CHECK(Run(Cli() + " plan --show " + path).out.find("micro-batch size 16") != std::string::npos);

  CommandResult small = Run(Cli() + " plan --show " + path + " --batch 1");
  CHECK(small.exit_code != 0);
  CHECK(small.err.find("cannot run batch size 1") != std::string::npos);

  const std::string text = TmpDir() + "/not_a_plan.txt";
  WriteFile(text, "hello");
  CommandResult bad = Run(Cli() + " plan --show " + text);
  CHECK(bad.exit_code != 0);
  CHECK(bad.err.find(text) != std::string::npos);
  CHECK(bad.err.find("not a deployment file") != std::string::npos);

  CommandResult bad_input = Run(Cli() + " plan " + path + " --devices 2 --input complex:3" +
                                nowhere);
  CHECK(bad_input.exit_code != 0);
  CHECK(bad_input.err.find("unknown dtype 'complex'") != std::string::npos);
  CommandResult bad_memory = Run(Cli() + " plan " + path +
                                 " --devices 2 --device-memory 80XB --input float32:3" + nowhere);
  CHECK(bad_memory.exit_code != 0);
  CHECK(bad_memory.err.find("--device-memory") != std::string::npos);
}

}  // namespace
}  // namespace rannc
