// End-to-end tests of the `rannc` CLI against a real ranncd on a loopback port
// (integration_testing.h): info and jobs, errors and exit codes, `rannc train` on a tiny
// language model traced by /usr/bin/python3, and checkpoints (`rannc checkpoint`, `rannc
// checkpoints`, `rannc export`) of the shared linear model.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "client/integration_testing.h"
#include "daemon/optim/lr_schedule.h"
#include "client/rannc_client.h"

namespace rannc {
namespace {

using testing::Cli;
using testing::CommandResult;
using testing::Daemon;
using testing::FreeLoopbackPort;
using testing::Linear;
using testing::Run;
using testing::RunPython;
using testing::TmpDir;

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

TEST_CASE("rannc --wait-for-daemon waits out a daemon that is starting", "[integration]") {
  const int port = FreeLoopbackPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  // Nothing there: the wait runs out with what it waited for.
  const auto before = std::chrono::steady_clock::now();
  CommandResult gone = Run(Cli() + " info --wait-for-daemon 0.5 --daemon " + address);
  CHECK(gone.exit_code != 0);
  CHECK(gone.err.find("ranncd at " + address + " did not become ready within 500ms") !=
        std::string::npos);
  CHECK(std::chrono::steady_clock::now() - before >= std::chrono::milliseconds(500));
  // A daemon that comes up while the command waits serves it.
  auto waiting = std::async(std::launch::async, [&] {
    return Run(Cli() + " info --daemon " + address + " --wait-for-daemon 60");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  REQUIRE(waiting.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  testing::DaemonProcess late("ranncd-late", {}, {}, {}, port);
  REQUIRE(late.Start().ok());
  CommandResult served = waiting.get();
  INFO("stdout:\n" << served.out << "\nstderr:\n" << served.err);
  CHECK(served.exit_code == 0);
  CHECK(served.out.find(address) != std::string::npos);
  // The same from the environment; and the flag refuses a negative wait.
  CHECK(Run("RANNC_WAIT_FOR_DAEMON=5 " + Cli() + " info --daemon " + address).exit_code == 0);
  CommandResult negative = Run(Cli() + " info --wait-for-daemon -1 --daemon " + address);
  CHECK(negative.exit_code != 0);
  CHECK(negative.err.find("--wait-for-daemon") != std::string::npos);
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

TEST_CASE("rannc train sets each step's lr from its schedule", "[integration]") {
  const std::string dir = TmpDir() + "/lm-schedule";
  REQUIRE(Run("mkdir -p " + dir).exit_code == 0);
  RunPython("lm", kLmScript, dir);
  CommandResult r = Run(Cli() + " train " + dir + "/lm.pt --tokens " + dir +
                        "/tokens.bin --batch 2 --seq 8 --steps 6 --lr 0.02 --schedule cosine"
                        " --warmup 2 --min-lr 0.002 --log-every 1 --daemon " +
                        Daemon().address());
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  const LrSchedule schedule{LrSchedule::Kind::kCosine, 0.02, 2, 0.002, 6};
  for (int step = 1; step <= 6; ++step) {
    std::smatch m;
    REQUIRE(std::regex_search(
        r.out, m, std::regex("step " + std::to_string(step) + "/6 loss [0-9.]+ tokens/s "
                             "[0-9.]+ lr ([0-9.e-]+)")));
    CHECK(std::stod(m[1]) == Approx(schedule.At(step)).epsilon(1e-5).margin(1e-9));
  }
  // A schedule that cannot be is refused before any job is made.
  CommandResult bad = Run(Cli() + " train " + dir + "/lm.pt --tokens " + dir +
                          "/tokens.bin --batch 2 --seq 8 --steps 6 --warmup 7 --daemon " +
                          Daemon().address());
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.err, Catch::Contains("warmup steps 7 must be in [0, steps = 6]"));
}

void TrainOneStep(const std::string& job_id);

// A linear job (testing::Linear) with these config keys, trained for `steps` SGD steps.
std::string CreateLinearJob(const std::string& name,
                            const std::map<std::string, std::string>& keys, int steps) {
  Client& client = Daemon().client();
  JobConfig config;
  config.name = name;
  config.config = keys;
  config.mode.set_training(true);
  config.optimizer.set_type(v1::SGD);
  config.example_inputs = {Linear().x, Linear().y};
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(Linear().model, config);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  for (int i = 0; i < steps; ++i) TrainOneStep(job->job_id());
  return job->job_id();
}

void TrainOneStep(const std::string& job_id) {
  Client& client = Daemon().client();
  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  REQUIRE(client.ZeroGrad(job_id).ok());
  REQUIRE(client.Forward(job_id, {Linear().x, Linear().y}).ok());
  REQUIRE(client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
  REQUIRE(client.Step(job_id, {sgd}).ok());
}

TEST_CASE("rannc checkpoint, checkpoints and export", "[integration]") {
  const std::string daemon = " --daemon " + Daemon().address();
  const std::string dir = TmpDir() + "/cli_checkpoints";
  const std::string job_id = CreateLinearJob("linear-cli-ckpt", {{"checkpoint_dir", dir}}, 1);

  // By name; waits for the commit.
  CommandResult r = Run(Cli() + " checkpoint linear-cli-ckpt" + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(std::regex_search(
      r.out, std::regex("^checkpoint step=1 path=" + dir +
                        "/linear-cli-ckpt/\\S+ bytes=[1-9][0-9]* blocked_s=[0-9.]+ "
                        "write_s=[0-9.]+ committed=true\n$")));

  // By id, without waiting: the daemon commits it on its own.
  TrainOneStep(job_id);
  r = Run(Cli() + " checkpoint " + job_id + " --no-wait" + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("checkpoint step=2 ", 0) == 0);
  v1::CheckpointsRef live;
  live.set_job_id(job_id);
  int committed = 0;
  for (int i = 0; i < 300 && committed < 2; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    absl::StatusOr<v1::ListCheckpointsResponse> list = Daemon().client().ListCheckpoints(live);
    REQUIRE(list.ok());
    committed = 0;
    for (const v1::CheckpointInfo& c : list->checkpoints()) committed += c.committed();
  }
  REQUIRE(committed == 2);

  r = Run(Cli() + " checkpoints linear-cli-ckpt" + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());
  CHECK(std::regex_search(r.out, std::regex("^STEP +CREATED +SIZE +PATH\n")));
  const std::regex row_of_step_1("\n1 +[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8} +[0-9.]+ [KMG]?i?B +" +
                                 dir + "/linear-cli-ckpt/\\S+\n");
  CHECK(std::regex_search(r.out, row_of_step_1));
  CHECK(std::regex_search(r.out, std::regex("\n2 +[0-9]{4}-")));

  // A chosen step, then the newest; each file is what torch.load would read (its size checked
  // against the stream in client_integration_test).
  const std::string out1 = TmpDir() + "/cli-step1.pt";
  r = Run(Cli() + " export linear-cli-ckpt@1 " + out1 + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(std::regex_search(r.out, std::regex("^exported step 1 of linear-cli-ckpt to " + out1 +
                                            " \\([0-9.]+ [KMG]?i?B\\)\n$")));
  CHECK(std::filesystem::file_size(out1) > 0);
  const std::string newest = TmpDir() + "/cli-newest.pt";
  r = Run(Cli() + " export " + job_id + " " + newest + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("exported step 2 of " + job_id + " to " + newest, 0) == 0);
  CHECK(std::filesystem::exists(newest));

  r = Run(Cli() + " export linear-cli-ckpt@777 " + TmpDir() + "/no.pt" + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("ExportCheckpoint") != std::string::npos);
  CHECK(r.err.find("777") != std::string::npos);
  CHECK(!std::filesystem::exists(TmpDir() + "/no.pt"));
  r = Run(Cli() + " export linear-cli-ckpt@latest " + TmpDir() + "/no.pt" + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("JOB@STEP") != std::string::npos);

  // Once the job is gone: by name under --dir, or $RANNC_CHECKPOINT_DIR.
  REQUIRE(Daemon().client().DeleteJob(job_id).ok());
  r = Run(Cli() + " checkpoints linear-cli-ckpt" + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("no job with id or name 'linear-cli-ckpt'") != std::string::npos);
  CHECK(r.err.find("--dir") != std::string::npos);
  r = Run(Cli() + " checkpoints linear-cli-ckpt --dir " + dir + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(std::regex_search(r.out, row_of_step_1));
  r = Run("RANNC_CHECKPOINT_DIR=" + dir + " " + Cli() + " checkpoints linear-cli-ckpt" + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(std::regex_search(r.out, std::regex("\n2 +[0-9]{4}-")));
  const std::string after = TmpDir() + "/cli-after.pt";
  r = Run(Cli() + " export linear-cli-ckpt " + after + " --dir " + dir + daemon);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("exported step 2 of linear-cli-ckpt to " + after, 0) == 0);
  CHECK(std::filesystem::file_size(after) == std::filesystem::file_size(newest));
}

TEST_CASE("rannc checkpoint names a job by id or by a name only one job has", "[integration]") {
  const std::string daemon = " --daemon " + Daemon().address();
  CommandResult r = Run(Cli() + " checkpoint no-such-job" + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("no job with id or name 'no-such-job'") != std::string::npos);

  const std::string a = CreateLinearJob("linear-twin", {}, 0);
  const std::string b = CreateLinearJob("linear-twin", {}, 0);
  r = Run(Cli() + " checkpoint linear-twin" + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("2 jobs are named 'linear-twin'") != std::string::npos);
  CHECK(r.err.find(a) != std::string::npos);
  // By id it reaches the daemon, which refuses a job without checkpoint_dir.
  r = Run(Cli() + " checkpoint " + a + daemon);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("Checkpoint: ") != std::string::npos);
  CHECK(r.err.find("checkpoint_dir") != std::string::npos);
  REQUIRE(Daemon().client().DeleteJob(a).ok());
  REQUIRE(Daemon().client().DeleteJob(b).ok());
}

}  // namespace
}  // namespace rannc
