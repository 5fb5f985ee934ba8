// Fuzz target: a deployment file (RaNNCModule's load_deployment, a checkpoint's recorded plan,
// `rannc` printing one), a serialized rannc.v1.Deployment, as the daemon checks it against a
// model and its devices (CheckDeployment) and describes it (DescribeDeployment, also for files
// that fail the check). The model is the tiny_gpt fixture's IR on 4 CPU devices of 1 GiB. The
// harness gives every input the model's hash, node count and device type, which a file of
// another model fails at once, so that the fuzzer spends its time on the plan itself: stages,
// devices, micro-batches, batch sizes and memory figures. Every path must end in a status: no
// crash, hang or undefined behaviour.
//
// The fixture is read from the target's runfiles (tests/fixtures/tiny_gpt.pt), whatever
// directory the fuzzer runs in. RANNC_FUZZ_WRITE_SEED=FILE writes the planner's own deployment of
// the model to FILE (the seed in fuzz/corpus/deployment).
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include <google/protobuf/stubs/logging.h>

#include "daemon/graph/ir_testing.h"
#include "daemon/planner/deployment.h"
#include "daemon/planner/links.h"
#include "daemon/planner/planner.h"
#include "fuzz/runfiles.h"

namespace {

struct Model {
  rannc::testing::FixtureIr fixture;
  rannc::planner::PlanTarget target;
};

const Model& TheModel() {
  static const Model* model = [] {
    auto* m = new Model;  // the fuzzer's lifetime
    rannc::fuzz::InRunfiles([&] { m->fixture = rannc::testing::BuildFixtureIr("tiny_gpt"); });
    if (!m->fixture.ir.ok()) std::abort();
    m->target.num_devices = 4;
    m->target.device_memory_bytes = uint64_t{1} << 30;
    m->target.links = *rannc::planner::LinksFromString("p2p=10GB/s,allreduce=2:5GB/s;4:3GB/s");
    return m;
  }();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs each string field that is not UTF-8: most mutated inputs, at a cost per run.
  google::protobuf::SetLogHandler(nullptr);
  rannc::fuzz::FindRunfiles((*argv)[0]);
  if (const char* seed = std::getenv("RANNC_FUZZ_WRITE_SEED")) {
    const Model& m = TheModel();
    absl::StatusOr<rannc::planner::PlannerConfig> config =
        rannc::planner::PlannerConfigFromKeys({});
    if (!config.ok()) std::abort();
    config->profiling.repeats = 1;
    absl::StatusOr<rannc::v1::Deployment> d = rannc::planner::PlanModel(
        *m.fixture.ir, m.fixture.tensors, m.fixture.fixture.inputs, m.target, {}, *config,
        nullptr, "fuzz");
    if (!d.ok()) std::abort();
    std::ofstream(seed, std::ios::binary) << d->SerializeAsString();
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Model& m = TheModel();
  rannc::v1::Deployment d;
  if (!d.ParseFromArray(data, static_cast<int>(size))) return 0;
  d.set_model_hash(m.fixture.ir->hash);
  d.set_num_nodes(static_cast<uint32_t>(m.fixture.ir->nodes.size()));
  d.set_device_type(m.target.device_type);
  (void)rannc::planner::CheckDeployment(d, *m.fixture.ir, m.target);
  (void)rannc::planner::DescribeDeployment(d);
  return 0;
}
