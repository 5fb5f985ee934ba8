// End-to-end tests of the `rannc` CLI against a real ranncd on a loopback port
// (integration_testing.h): info and jobs, errors and exit codes, and `rannc train` on a tiny
// language model traced by /usr/bin/python3.
#include <catch2/catch.hpp>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "client/integration_testing.h"
#include "client/rannc_client.h"

namespace rannc {
namespace {

using testing::Cli;
using testing::CommandResult;
using testing::Daemon;
using testing::FreeLoopbackPort;
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

}  // namespace
}  // namespace rannc
