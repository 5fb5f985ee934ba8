// A job whose plan spans processes, as it will span daemons: each process runs its devices'
// part (//daemon/runtime:engine_part) and the parts meet through a gRPC store served here. Each
// part checks its own devices' gradients and parameters against PyTorch; their shares of the
// loss must add up to PyTorch's loss.
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "daemon/comm/process_testing.h"
#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

struct Split {
  std::string fixture, plan;
  int micro_batches;
  std::vector<std::string> parts;  // each process's local devices
};

TEST_CASE("Processes running parts of one plan train like PyTorch", "[runtime]") {
  testing::StoreServer store;
  const std::vector<Split> splits = {
      // Stage 0 (2 replicas) in one process, stage 1 (2 replicas) in the other.
      {"mlp", "0,1/2,3", 2, {"0,1", "2,3"}},
      // A tied embedding held by the first and last stage, in different processes.
      {"tiny_gpt", "0/1/2/3", 2, {"0,1", "2,3"}},
      // A stage's replicas split between processes: their all-reduce crosses.
      {"multi_io", "0,2/1,3", 2, {"0,1", "2,3"}},
  };
  for (const Split& split : splits) {
    INFO(split.fixture << " plan " << split.plan);
    std::vector<pid_t> pids;
    std::vector<std::string> outs;
    for (size_t p = 0; p < split.parts.size(); ++p) {
      outs.push_back(std::string(std::getenv("TEST_TMPDIR")) + "/" + split.fixture + "_" +
                     std::to_string(p));
      pids.push_back(testing::Spawn({testing::Runfile("daemon/runtime/engine_part"),
                                     store.address(), split.fixture, split.plan,
                                     std::to_string(split.micro_batches), split.parts[p],
                                     outs.back()}));
    }
    double loss = 0;
    for (size_t p = 0; p < pids.size(); ++p) {
      INFO("part " << split.parts[p]);
      REQUIRE(testing::Reap(pids[p], std::chrono::seconds(120)) == 0);
      double share = 0;
      std::ifstream(outs[p]) >> share;
      loss += share;
    }
    testing::Fixture f = testing::LoadFixture(split.fixture);
    CHECK(loss == Approx(f.ref.at("out_0").item<double>()).epsilon(1e-5));
  }
}

}  // namespace
}  // namespace rannc
