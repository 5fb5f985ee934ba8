// End-to-end tests of planning against a real ranncd on a loopback port (integration_testing.h):
// dry runs, jobs that run a loaded deployment, and `rannc plan` (planning, saving, showing a
// deployment file with and without a daemon).
#include <catch2/catch.hpp>
#include <cstdio>
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
using testing::Linear;
using testing::ReadFile;
using testing::Run;
using testing::RunPython;
using testing::TmpDir;
using testing::WriteFile;

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
