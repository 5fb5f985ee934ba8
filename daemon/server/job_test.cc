#include "daemon/server/job.h"

#include <stdlib.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/common/files.h"
#include "daemon/server/job_manager.h"
#include "daemon/server/job_model.h"
#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

using testing::Close;

JobSettings SgdConfig() {
  JobSettings config;
  config.name = "test";
  config.optimizer.enabled = true;
  config.optimizer.kind = OptimizerKind::kSgd;
  HyperParams h;
  h.lr = 0.1;
  h.momentum = 0.9;
  config.optimizer.group_hyper = {h};
  return config;
}

// The optimizer step, allreduce_grads() and zero_grad() as the services call them.
absl::Status Step(Job& job, std::vector<HyperParams> hypers) {
  JobOp op;
  op.hypers = std::move(hypers);
  return job.Run(0, op).status();
}

absl::Status AllReduceGrads(Job& job) {
  JobOp op;
  op.kind = JobOp::Kind::kAllReduceGrads;
  return job.Run(0, op).status();
}

void ZeroGrad(Job& job, bool set_to_none) {
  JobOp op;
  op.kind = JobOp::Kind::kZeroGrad;
  op.set_to_none = set_to_none;
  REQUIRE(job.Run(0, op).ok());
}

// A parameter's or buffer's current value, wherever the job keeps it.
at::Tensor Value(Job& job, const std::string& name) {
  absl::StatusOr<std::optional<at::Tensor>> t = job.GetTensor(name, false);
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  return **t;
}

std::unique_ptr<Job> MakeJob(const testing::Fixture& f, JobSettings config = SgdConfig()) {
  absl::StatusOr<std::unique_ptr<Job>> job = Job::Create("job-1", config, f.model_bytes, f.inputs);
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  return std::move(*job);
}

// forward, backward of outputs[0].sum(), step; twice — what make_models.py does in PyTorch.
void TrainTwoSteps(Job& job, const testing::Fixture& f) {
  const HyperParams h = SgdConfig().optimizer.group_hyper[0];
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<std::vector<at::Tensor>> out = job.Forward(0, f.inputs, true);
    REQUIRE(out.ok());
    if (step == 0 && f.ref.count("out_0")) CHECK(Close((*out)[0], f.ref.at("out_0")));
    REQUIRE(job.Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
    if (step == 0) {
      for (const ParamStore::Entry& e : job.params().entries()) {
        if (!e.is_parameter) continue;
        absl::StatusOr<std::optional<at::Tensor>> grad = job.GetTensor(e.name, true);
        REQUIRE(grad.ok());
        REQUIRE(grad->has_value());
        INFO(e.name);
        CHECK(Close(**grad, f.Ref("grad", e.name)));
      }
    }
    REQUIRE(Step(job, {h}).ok());
    ZeroGrad(job, false);
  }
}

TEST_CASE("Job matches PyTorch on an MLP: outputs, grads, two SGD steps", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  std::unique_ptr<Job> job = MakeJob(f);
  // The client learns the outputs' dtypes and shapes from CreateJob; the IR supplies them.
  const at::Tensor& ref = f.ref.at("out_0");
  REQUIRE(job->info().outputs.size() == 1);
  CHECK(job->info().outputs[0].dtype == ref.scalar_type());
  CHECK(job->info().outputs[0].shape == ref.sizes().vec());
  TrainTwoSteps(*job, f);
  for (const ParamStore::Entry& e : job->params().entries()) {
    INFO(e.name);
    CHECK(Close(Value(*job, e.name), f.Ref("step2", e.name)));
  }
  CHECK(job->Summary().steps == 2);
}

TEST_CASE("Job trains a tied weight as one tensor", "[job]") {
  testing::Fixture f = testing::LoadFixture("tied_lm");
  std::unique_ptr<Job> job = MakeJob(f);
  const ParamStore::Entry* emb = job->params().Find("emb.weight");
  REQUIRE(emb != nullptr);
  CHECK(job->params().Find("head.weight") == emb);
  CHECK(emb->aliases == std::vector<std::string>{"head.weight"});
  TrainTwoSteps(*job, f);
  CHECK(Close(Value(*job, "emb.weight"), f.Ref("step2", "emb.weight")));
  CHECK(Close(Value(*job, "mix.weight"), f.Ref("step2", "mix.weight")));
  // state_dict has both names, like PyTorch's.
  int emb_keys = 0;
  for (const StateEntry& s : job->StateDict()) {
    emb_keys += s.name == "emb.weight" || s.name == "head.weight";
  }
  CHECK(emb_keys == 2);
}

TEST_CASE("Job updates BatchNorm buffers as PyTorch, not during validation", "[job]") {
  testing::Fixture f = testing::LoadFixture("bn_net");
  std::unique_ptr<Job> job = MakeJob(f);
  CHECK(Value(*job, "bn.num_batches_tracked").item<int64_t>() == 0);
  TrainTwoSteps(*job, f);
  for (const char* name : {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}) {
    INFO(name);
    CHECK(Close(Value(*job, name), f.Ref("buf", name)));
  }
  for (const char* name : {"conv.weight", "bn.weight"}) {
    INFO(name);
    CHECK(Close(Value(*job, name), f.Ref("step2", name)));
  }
}

TEST_CASE("Job rejects unused parameters unless told not to check", "[job]") {
  testing::Fixture f = testing::LoadFixture("unused");
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create("job-1", SgdConfig(), f.model_bytes, f.inputs);
  REQUIRE_FALSE(job.ok());
  CHECK(job.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(job.status().message()),
             Catch::Contains("unused.weight") && Catch::Contains("check_unused_values=False"));

  JobSettings lenient = SgdConfig();
  lenient.check_unused_values = false;
  std::unique_ptr<Job> ok = MakeJob(f, lenient);
  // The unused parameter has no gradient, so the step leaves it alone, as PyTorch does.
  at::Tensor before = Value(*ok, "unused.weight").clone();
  absl::StatusOr<std::vector<at::Tensor>> out = ok->Forward(0, f.inputs, true);
  REQUIRE(out.ok());
  REQUIRE(ok->Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
  REQUIRE(Step(*ok, {SgdConfig().optimizer.group_hyper[0]}).ok());
  CHECK(at::equal(before, Value(*ok, "unused.weight")));
}

TEST_CASE("Job names the input and both shapes for a bad input", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  JobSettings config = SgdConfig();
  config.input_names = {"x", "y"};
  std::unique_ptr<Job> job = MakeJob(f, config);

  absl::StatusOr<std::vector<at::Tensor>> shape =
      job->Forward(0, {at::zeros({5, 7}), f.inputs[1]}, true);
  CHECK(shape.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(shape.status().message()),
             Catch::Contains("input 'x' (#0)") && Catch::Contains("float32[5, 6]") &&
                 Catch::Contains("float32[5, 7]"));

  absl::StatusOr<std::vector<at::Tensor>> dtype =
      job->Forward(0, {f.inputs[0], f.inputs[1].to(at::kFloat)}, true);
  CHECK_THAT(std::string(dtype.status().message()),
             Catch::Contains("input 'y' (#1)") && Catch::Contains("int64[5]"));

  absl::StatusOr<std::vector<at::Tensor>> count = job->Forward(0, {f.inputs[0]}, true);
  CHECK_THAT(std::string(count.status().message()), Catch::Contains("takes 2 inputs"));

  // A different batch size is fine.
  absl::StatusOr<std::vector<at::Tensor>> batch =
      job->Forward(0, {f.inputs[0].narrow(0, 0, 3), f.inputs[1].narrow(0, 0, 3)}, true);
  CHECK(batch.ok());
}

TEST_CASE("Job refuses calls out of order and keeps working", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  std::unique_ptr<Job> job = MakeJob(f);
  absl::Status early = job->Backward(0, {{0, at::ones({})}}, false);
  CHECK(early.code() == absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
  REQUIRE(out.ok());
  absl::Status bad_grad = job->Backward(0, {{0, at::ones({2})}}, false);
  CHECK(bad_grad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(job->Backward(0, {{3, at::ones({})}}, false).code() == absl::StatusCode::kInvalidArgument);
  CHECK(job->Backward(0, {{0, at::ones({})}}, /*retain_graph=*/true).ok());
  CHECK(job->Backward(0, {{0, at::ones({})}}, false).ok());  // keep_graph: second backward
  CHECK(job->Backward(0, {{0, at::ones({})}}, false).code() ==
        absl::StatusCode::kFailedPrecondition);
  // Two backwards accumulated twice the gradient.
  CHECK(Close(**job->GetTensor("fc1.weight", true), 2 * f.Ref("grad", "fc1.weight")));

  CHECK(Step(*job, {}).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Job without an optimizer refuses step", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  JobSettings config;
  std::unique_ptr<Job> job = MakeJob(f, config);
  CHECK(Step(*job, {HyperParams()}).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("Job clip_grad_norm equals torch.nn.utils.clip_grad_norm_", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  std::unique_ptr<Job> job = MakeJob(f);
  absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
  REQUIRE(job->Backward(0, {{0, at::ones({})}}, false).ok());
  std::vector<at::Tensor> norms;
  for (const char* n : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
    norms.push_back(f.Ref("grad", n).norm());
  }
  const double expected = at::stack(norms).norm().item<double>();
  absl::StatusOr<double> total = job->ClipGradNorm(0, 0.01, 2.0);
  REQUIRE(total.ok());
  CHECK(*total == Approx(expected).epsilon(1e-6));
  const double coef = 0.01 / (expected + 1e-6);
  CHECK(Close(**job->GetTensor("fc1.weight", true), f.Ref("grad", "fc1.weight") * coef));
}

TEST_CASE("Job zero_grad(set_to_none) leaves no gradient", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  std::unique_ptr<Job> job = MakeJob(f);
  REQUIRE(job->Forward(0, f.inputs, true).ok());
  REQUIRE(job->Backward(0, {{0, at::ones({})}}, false).ok());
  ZeroGrad(*job, false);
  CHECK(at::equal(**job->GetTensor("fc2.bias", true), at::zeros({3})));
  ZeroGrad(*job, true);
  CHECK_FALSE(job->GetTensor("fc2.bias", true)->has_value());
  CHECK(job->GetTensor("nope", false).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("Job load_state_dict checks every key before changing anything", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  std::unique_ptr<Job> job = MakeJob(f);
  std::map<std::string, at::Tensor> state;
  for (const StateEntry& s : job->StateDict()) state[s.name] = s.tensor + 1;
  const at::Tensor before = Value(*job, "fc1.weight").clone();
  std::vector<std::string> missing, unexpected;

  std::map<std::string, at::Tensor> wrong_shape = state;
  wrong_shape["fc2.bias"] = at::zeros({4});
  absl::Status shape = job->LoadStateDict(wrong_shape, true, &missing, &unexpected);
  CHECK(shape.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(shape.message()), Catch::Contains("size mismatch for fc2.bias"));
  CHECK(at::equal(before, Value(*job, "fc1.weight")));

  std::map<std::string, at::Tensor> partial = state;
  partial.erase("fc2.weight");
  partial["extra"] = at::zeros({1});
  absl::Status strict = job->LoadStateDict(partial, true, &missing, &unexpected);
  CHECK(strict.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(strict.message()),
             Catch::Contains("missing keys: fc2.weight") && Catch::Contains("unexpected keys: extra"));
  CHECK(at::equal(before, Value(*job, "fc1.weight")));

  REQUIRE(job->LoadStateDict(partial, false, &missing, &unexpected).ok());
  CHECK(missing == std::vector<std::string>{"fc2.weight"});
  CHECK(unexpected == std::vector<std::string>{"extra"});
  CHECK(at::equal(before + 1, Value(*job, "fc1.weight")));
}

TEST_CASE("Job reports a model that fails on its example inputs", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create("job-1", SgdConfig(), f.model_bytes, {at::zeros({5, 4}), f.inputs[1]});
  REQUIRE_FALSE(job.ok());
  CHECK(job.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(job.status().message()),
             Catch::Contains("example inputs") && Catch::Contains("forward failed"));
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

TEST_CASE("Job refuses a model whose state exceeds the devices' memory", "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  JobSettings config = SgdConfig();  // momentum: one state tensor per parameter
  config.planner.auto_memory = false;
  // fc1 6x8+8, fc2 8x3+3 floats = 83 * 4 bytes; with grads and momentum, 3x that.
  config.plan_target.device_memory_bytes = 83 * 4 * 3 - 1;
  absl::StatusOr<std::unique_ptr<Job>> job = Job::Create("job-1", config, f.model_bytes, f.inputs);
  REQUIRE_FALSE(job.ok());
  CHECK(job.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(job.status().message()), Catch::Contains("planning the model"));
  config.plan_target.device_memory_bytes = 64 << 20;
  CHECK(Job::Create("job-1", config, f.model_bytes, f.inputs).ok());
}

TEST_CASE("Job offloads parameters by itself when nothing fits without, and trains the same",
          "[job]") {
  testing::Fixture f = testing::LoadFixture("mlp");
  // The least device memory any plain plan fits in, by bisection over dry runs.
  JobSettings plain = SgdConfig();
  plain.planner.auto_memory = false;
  uint64_t too_little = 1, enough = 64 << 20;
  while (enough - too_little > 1) {
    const uint64_t mid = (too_little + enough) / 2;
    plain.plan_target.device_memory_bytes = mid;
    (PlanJob(plain, f.model_bytes, f.inputs).ok() ? enough : too_little) = mid;
  }
  JobSettings config = SgdConfig();
  config.plan_target.device_memory_bytes = too_little;
  std::unique_ptr<Job> job = MakeJob(f, config);
  CHECK(job->info().plan.offload());
  CHECK_FALSE(job->info().plan.zero());  // one device: nothing to shard over
  TrainTwoSteps(*job, f);
  for (const ParamStore::Entry& e : job->params().entries()) {
    INFO(e.name);
    CHECK(Close(Value(*job, e.name), f.Ref("step2", e.name)));
  }
  // Offloaded indeed: between steps the device holds none of the parameters' state.
  const JobSummary summary = job->Summary();
  REQUIRE(summary.device_bytes.size() == 1);
  CHECK(summary.device_bytes[0] == 0);
  CHECK(summary.peak_device_bytes[0] > 0);
  // Told not to, it fails as before.
  config.planner.auto_memory = false;
  CHECK(Job::Create("job-2", config, f.model_bytes, f.inputs).status().code() ==
        absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

JobSettings PlannedConfig(int devices) {
  JobSettings config = SgdConfig();
  config.plan_target.num_devices = devices;
  config.plan_target.device_memory_bytes = 256ull << 20;
  config.planner.profiling.repeats = 1;
  return config;
}

TEST_CASE("Job plans its model at creation and adopts a saved deployment", "[job]") {
  testing::Fixture f = testing::LoadFixture("tiny_gpt");
  JobSettings config = PlannedConfig(2);
  config.planner.partition_num = 2;
  absl::StatusOr<std::unique_ptr<Job>> planned =
      Job::Create("job-1", config, f.model_bytes, f.inputs);
  REQUIRE(planned.ok());
  const v1::Deployment& d = (*planned)->info().plan;
  REQUIRE(d.stages_size() == 2);
  CHECK(d.stages(0).first_node() == 0);
  CHECK(d.stages(1).first_node() == d.stages(0).end_node());
  CHECK_FALSE(d.loaded());

  JobSettings reload = PlannedConfig(2);
  reload.load_deployment = d.SerializeAsString();
  absl::StatusOr<std::unique_ptr<Job>> loaded =
      Job::Create("job-2", reload, f.model_bytes, f.inputs);
  REQUIRE(loaded.ok());
  CHECK((*loaded)->info().plan.loaded());
  CHECK((*loaded)->info().plan.stages(1).first_node() == d.stages(1).first_node());
  // The loaded job trains like PyTorch all the same.
  absl::StatusOr<std::vector<at::Tensor>> out = (*loaded)->Forward(0, f.inputs, false);
  REQUIRE(out.ok());
  CHECK(Close((*out)[0], f.ref.at("out_0")));

  // Another model's deployment, and bytes that are no deployment at all, are refused.
  testing::Fixture mlp = testing::LoadFixture("mlp");
  absl::StatusOr<std::unique_ptr<Job>> other = Job::Create("job-3", reload, mlp.model_bytes, mlp.inputs);
  CHECK(other.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(other.status().message()), Catch::Contains("another model"));
  reload.load_deployment = "not a deployment";
  CHECK(Job::Create("job-4", reload, f.model_bytes, f.inputs).status().code() ==
        absl::StatusCode::kInvalidArgument);
  // A deployment that places stages on more devices than the daemon has.
  JobSettings fewer = PlannedConfig(1);
  fewer.load_deployment = d.SerializeAsString();
  CHECK(Job::Create("job-5", fewer, f.model_bytes, f.inputs).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("Job resumed from a checkpoint keeps the checkpoint's plan", "[job]") {
  testing::Fixture f = testing::LoadFixture("tiny_gpt");
  char tmpl[] = "/tmp/rannc-job-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  // Saved with a plan of two stages and two micro-batches, which the planner need not pick.
  JobSettings config = PlannedConfig(2);
  config.planner.partition_num = 2;
  config.planner.pipeline_num = 2;
  config.checkpoints.dir = dir;
  absl::StatusOr<std::unique_ptr<Job>> first =
      Job::Create("job-1", config, f.model_bytes, f.inputs);
  REQUIRE(first.ok());
  TrainTwoSteps(**first, f);
  REQUIRE((*first)->Checkpoint(/*wait=*/true).ok());
  const v1::Deployment saved = (*first)->info().plan;
  first->reset();

  // Resumed with no shape asked for: the checkpoint's plan, and the training goes on from it.
  JobSettings resume = PlannedConfig(2);
  resume.checkpoints.dir = dir;
  resume.checkpoints.resume = 0;  // the latest
  absl::StatusOr<std::unique_ptr<Job>> resumed =
      Job::Create("job-2", resume, f.model_bytes, f.inputs);
  REQUIRE(resumed.ok());
  CHECK((*resumed)->resumed_step() == 2);
  const v1::Deployment& kept = (*resumed)->info().plan;
  CHECK(kept.stages_size() == 2);
  CHECK(kept.micro_batches() == saved.micro_batches());
  CHECK(kept.stages(1).first_node() == saved.stages(1).first_node());
  CHECK_FALSE(kept.loaded());
  resumed->reset();

  // A shape asked for wins over the checkpoint's.
  resume.planner.partition_num = 1;
  absl::StatusOr<std::unique_ptr<Job>> reshaped =
      Job::Create("job-3", resume, f.model_bytes, f.inputs);
  REQUIRE(reshaped.ok());
  CHECK((*reshaped)->info().plan.stages_size() == 1);
  CHECK((*reshaped)->resumed_step() == 2);
  reshaped->reset();
  CHECK(RemoveTree(dir).ok());
}

TEST_CASE("The memory model counts autocast's weight copies, not amp_level O2's casts",
          "[job]") {
  JobSettings config = SgdConfig();  // momentum: one state tensor a parameter
  planner::MemoryModel m = MemoryModelFor(config, /*zero=*/true, /*offload=*/false);
  CHECK(m.zero);
  CHECK_FALSE(m.offload);
  CHECK(m.optimizer_state_factor == 1);
  CHECK(m.amp_cast_factor == 0);
  config.amp = at::kBFloat16;  // O1: autocast's bf16 copies, which the profiler does not see
  CHECK(MemoryModelFor(config, false, true).amp_cast_factor == 0.5);
  CHECK(MemoryModelFor(config, false, true).offload);
  // O2: the casts are ops of the graph, and the profiler measures their copies.
  config.amp_o2 = true;
  CHECK(MemoryModelFor(config, false, false).amp_cast_factor == 0);
}

TEST_CASE("PlanJob plans for devices that are not there, and refuses what cannot fit",
          "[job]") {
  testing::Fixture f = testing::LoadFixture("tiny_gpt");
  JobSettings config = PlannedConfig(8);
  absl::StatusOr<v1::Deployment> d = PlanJob(config, f.model_bytes, f.inputs);
  REQUIRE(d.ok());
  CHECK(d->num_devices() == 8);
  int devices = 0;
  for (const v1::DeploymentStage& s : d->stages()) devices += s.devices_size();
  CHECK(devices <= 8);
  config.plan_target.device_memory_bytes = 1024;
  absl::StatusOr<v1::Deployment> none = PlanJob(config, f.model_bytes, f.inputs);
  CHECK(none.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(none.status().message()),
             Catch::Contains("planning the model") && Catch::Contains("offload (auto_memory)"));
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

// A job over 4 CPU devices with a forced plan: PyTorch's gradients and SGD steps, with an
// undeploy (devices freed, state kept on the host) and a bad input between the two steps.
TEST_CASE("Job runs its plan over the devices, undeploys and redeploys, survives bad input",
          "[job]") {
  for (const char* name : {"tiny_gpt", "multi_io"}) {
    INFO(name);
    testing::Fixture f = testing::LoadFixture(name);
    JobSettings config = PlannedConfig(4);
    config.planner.partition_num = 2;
    config.planner.replica_num = 2;
    config.planner.pipeline_num = 2;
    std::unique_ptr<Job> job = MakeJob(f, config);
    const v1::Deployment& d = job->info().plan;
    REQUIRE(d.stages_size() == 2);
    CHECK(d.micro_batches() == 2);
    JobSummary before = job->Summary();
    CHECK(job->info().devices == std::vector<std::string>{"cpu:0", "cpu:1", "cpu:2", "cpu:3"});
    // Every device holds its stage's parameters: tiny_gpt's stages each have some; multi_io's
    // split is timed by the planner's profiles, and a stage of it may hold none.
    int64_t total = 0;
    for (int64_t bytes : before.device_bytes) {
      total += bytes;
      if (std::string(name) == "tiny_gpt") CHECK(bytes > 0);
    }
    CHECK(total > 0);

    const HyperParams h = SgdConfig().optimizer.group_hyper[0];
    for (int step = 0; step < 2; ++step) {
      INFO("step " << step);
      if (step == 1) {
        job->Undeploy();
        JobSummary undeployed = job->Summary();
        CHECK(undeployed.state == JobState::kUndeployed);
        CHECK(undeployed.device_bytes == std::vector<int64_t>(4, 0));
        // A bad input fails and changes nothing (it also redeploys the job).
        std::vector<at::Tensor> bad = f.inputs;
        if (std::string(name) == "tiny_gpt") {
          bad[0] = bad[0].clone();
          bad[0][1][0] = 1000;  // out of the vocabulary, on one replica of micro-batch 0
          absl::StatusOr<std::vector<at::Tensor>> failed = job->Forward(0, bad, true);
          CHECK(failed.status().code() == absl::StatusCode::kInvalidArgument);
        }
        bad[0] = bad[0].to(at::kDouble);
        CHECK(job->Forward(0, bad, true).status().code() == absl::StatusCode::kInvalidArgument);
      }
      absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
      INFO(out.status().ToString());
      REQUIRE(out.ok());
      CHECK(Close((*out)[0], step == 0 ? f.ref.at("out_0") : (*out)[0]));
      REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
      if (step == 0) {
        for (const ParamStore::Entry& e : job->params().entries()) {
          if (!e.is_parameter) continue;
          absl::StatusOr<std::optional<at::Tensor>> grad = job->GetTensor(e.name, true);
          REQUIRE(grad.ok());
          REQUIRE(grad->has_value());
          INFO(e.name);
          CHECK(Close(**grad, f.Ref("grad", e.name)));
        }
      }
      REQUIRE(Step(*job, {h}).ok());
      ZeroGrad(*job, false);
    }
    CHECK(job->Summary().state == JobState::kDeployed);
    for (const ParamStore::Entry& e : job->params().entries()) {
      if (!e.is_parameter) continue;
      INFO(e.name);
      CHECK(Close(Value(*job, e.name), f.Ref("step2", e.name)));
    }
    // state_dict reads the devices' values.
    for (const StateEntry& entry : job->StateDict()) {
      if (entry.is_buffer) continue;
      INFO(entry.name);
      CHECK(Close(entry.tensor, f.Ref("step2", job->params().Find(entry.name)->name)));
    }
  }
}

TEST_CASE("Job keeps no host copy of what its devices hold while deployed, loses no value",
          "[job]") {
  testing::Fixture f = testing::LoadFixture("tiny_gpt");
  JobSettings config = PlannedConfig(2);
  config.planner.partition_num = 2;
  std::unique_ptr<Job> job = MakeJob(f, config);
  REQUIRE(job->info().plan.stages_size() == 2);
  const ParamStore& store = job->params();
  int params = 0;
  for (const ParamStore::Entry& e : store.entries()) params += e.is_parameter;
  REQUIRE(params > 2);
  // Dropped: no memory beyond one element, the shape and dtype kept (the client's, the
  // checks' and the optimizer state's reference).
  auto dropped = [&] {
    int n = 0;
    for (const ParamStore::Entry& e : store.entries()) {
      if (!e.dropped) continue;
      ++n;
      CHECK(static_cast<int64_t>(e.tensor.storage().nbytes()) == e.tensor.element_size());
      CHECK(e.tensor.sizes().equals(f.Ref("step2", e.name).sizes()));
      CHECK(e.tensor.requires_grad());
    }
    return n;
  };
  TrainTwoSteps(*job, f);
  CHECK(dropped() == params);
  {  // what a reader that forgot to restore would meet: NaN, and no write
    const at::Tensor t = store.entries()[0].tensor.detach();
    CHECK(at::isnan(t).all().item<bool>());
    CHECK_THROWS(t.copy_(at::zeros(t.sizes(), t.options())));
  }
  for (const StateEntry& entry : job->StateDict()) {
    INFO(entry.name);
    if (!entry.is_buffer) {
      CHECK(Close(entry.tensor, f.Ref("step2", store.Find(entry.name)->name)));
    }
  }
  CHECK(dropped() == params);  // state_dict copies from the devices, not through the store

  // A partial load writes its entry on the devices; the others keep theirs.
  std::string loaded_name, kept_name;
  for (const ParamStore::Entry& e : store.entries()) {
    if (!e.is_parameter) continue;
    (loaded_name.empty() ? loaded_name : kept_name) = e.name;
    if (!kept_name.empty()) break;
  }
  const at::Tensor loaded = f.Ref("step2", loaded_name) + 1;
  std::vector<std::string> missing, unexpected;
  REQUIRE(job->LoadStateDict({{loaded_name, loaded}}, false, &missing, &unexpected).ok());
  CHECK_FALSE(missing.empty());
  CHECK(Close(Value(*job, loaded_name), loaded));
  CHECK(Close(Value(*job, kept_name), f.Ref("step2", kept_name)));
  CHECK(dropped() == params);

  // Another mode's graph runs over the store: its copies come back for it, and go at the next
  // planned forward.
  absl::StatusOr<std::vector<at::Tensor>> planned = job->Forward(0, f.inputs, false);
  REQUIRE(planned.ok());
  const ModelMode trained = config.mode;
  REQUIRE(job->AddMode(ModelMode{false, false}, f.model_bytes).ok());
  REQUIRE(job->SetMode(ModelMode{false, false}));
  absl::StatusOr<std::vector<at::Tensor>> eval = job->Forward(0, f.inputs, false);
  REQUIRE(eval.ok());
  CHECK(Close((*eval)[0], (*planned)[0]));
  CHECK(dropped() == 0);
  REQUIRE(job->SetMode(trained));
  REQUIRE(job->Forward(0, f.inputs, false).ok());
  CHECK(dropped() == params);

  // Undeployed, the store has every value again, and a redeployment starts from them.
  job->Undeploy();
  CHECK(dropped() == 0);
  CHECK(Close(store.Find(loaded_name)->tensor, loaded));
  CHECK(Close(store.Find(kept_name)->tensor, f.Ref("step2", kept_name)));
  absl::StatusOr<std::vector<at::Tensor>> again = job->Forward(0, f.inputs, false);
  REQUIRE(again.ok());
  CHECK(Close((*again)[0], (*planned)[0]));
  CHECK(dropped() == params);
}

TEST_CASE("Job delays gradient reduction until AllReduceGrads, across an undeploy", "[job]") {
  // Fused with a tied weight, and kept graphs.
  for (const char* name : {"tiny_gpt", "multi_io"}) {
    INFO(name);
    testing::Fixture f = testing::LoadFixture(name);
    JobSettings config = PlannedConfig(4);
    config.planner.partition_num = 2;
    config.planner.replica_num = 2;
    config.planner.pipeline_num = 2;
    std::unique_ptr<Job> job = MakeJob(f, config);
    auto delayed_backward = [&] {
      absl::StatusOr<std::vector<at::Tensor>> out =
          job->Forward(0, f.inputs, true, /*delay_grad_allreduce=*/true);
      REQUIRE(out.ok());
      REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false, true).ok());
    };
    auto check_grads = [&](double times) {
      for (const ParamStore::Entry& e : job->params().entries()) {
        if (!e.is_parameter) continue;
        INFO(e.name << " x " << times);
        absl::StatusOr<std::optional<at::Tensor>> grad = job->GetTensor(e.name, true);
        REQUIRE(grad.ok());
        REQUIRE(grad->has_value());
        CHECK(Close(**grad, f.Ref("grad", e.name) * times));
      }
    };
    const HyperParams h = SgdConfig().optimizer.group_hyper[0];
    delayed_backward();
    delayed_backward();
    check_grads(2);  // read before the reduction: the devices' sum
    absl::Status step = Step(*job, {h});
    CHECK(step.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(step.message().find("allreduce_grads()") != std::string::npos);
    CHECK(job->ClipGradNorm(0, 1.0, 2.0).status().code() == absl::StatusCode::kFailedPrecondition);
    // Undeployed with reductions pending, the job parks the reduced gradients and goes on.
    job->Undeploy();
    check_grads(2);
    delayed_backward();
    REQUIRE(AllReduceGrads(*job).ok());
    check_grads(3);
    std::map<std::string, at::Tensor> before;
    for (const ParamStore::Entry& e : job->params().entries()) {
      if (e.is_parameter) before[e.name] = Value(*job, e.name);
    }
    REQUIRE(Step(*job, {h}).ok());
    for (const auto& [param, value] : before) {
      INFO(param);
      CHECK(Close(Value(*job, param), value - f.Ref("grad", param) * 3 * h.lr));
    }
  }
}

TEST_CASE("JobManager deletes a job whose client lease ran out; a call renews it", "[job]") {
  using std::chrono::milliseconds;
  testing::Fixture f = testing::LoadFixture("mlp");
  auto now = std::chrono::steady_clock::now();
  JobManager jobs([&now] { return now; });
  for (const char* id : {"leased", "unleased"}) {
    JobSettings config = SgdConfig();
    if (std::string(id) == "leased") config.lease = milliseconds(500);  // else 0: no lease
    absl::StatusOr<std::unique_ptr<Job>> job = Job::Create(id, config, f.model_bytes, f.inputs);
    REQUIRE(job.ok());
    jobs.Add(std::move(*job));
  }
  REQUIRE(jobs.size() == 2);

  // Add started the lease; a call naming the job (Get) renews it from the time of the call.
  CHECK(jobs.RemoveExpired().empty());
  now += milliseconds(400);
  CHECK(jobs.RemoveExpired().empty());
  REQUIRE(jobs.Get("leased").ok());
  now += milliseconds(400);  // 800 ms after Add, 400 after the call
  CHECK(jobs.RemoveExpired().empty());
  for (const JobManager::Listed& l : jobs.List()) {
    CHECK(l.idle == milliseconds(l.job->info().id == "leased" ? 400 : 800));
  }
  now += milliseconds(101);
  std::vector<JobManager::Expired> expired = jobs.RemoveExpired();
  REQUIRE(expired.size() == 1);
  CHECK(expired[0].id == "leased");
  CHECK(expired[0].name == "test");
  CHECK(expired[0].lease == milliseconds(500));
  CHECK(jobs.Get("leased").status().code() == absl::StatusCode::kNotFound);
  // A job without a lease stays, however long nobody calls.
  now += std::chrono::hours(24);
  CHECK(jobs.RemoveExpired().empty());
  CHECK(jobs.Get("unleased").ok());
}

TEST_CASE("JobManager's JoinJob wait: a job here, one added meanwhile, a leader elsewhere, "
          "a timeout on the injected clock", "[job]") {
  using std::chrono::milliseconds;
  testing::Fixture f = testing::LoadFixture("mlp");
  auto now = std::chrono::steady_clock::now();
  JobManager jobs([&now] { return now; });
  auto nowhere = [] { return std::optional<std::string>(); };
  auto never = [] { return false; };
  auto add = [&](const std::string& id) {
    JobSettings config = SgdConfig();
    config.name = "ranks";
    config.client_world = 2;
    absl::StatusOr<std::unique_ptr<Job>> job = Job::Create(id, config, f.model_bytes, f.inputs);
    REQUIRE(job.ok());
    v1::CreateJobResponse answer;
    answer.set_job_id(id);
    jobs.Add(std::move(*job), answer);
  };

  // Nobody creates it: the injected clock runs out after the first round, no real waiting.
  absl::StatusOr<v1::CreateJobResponse> late = jobs.WaitForJoinable(
      "ranks", 2, milliseconds(500), nowhere, [&] {
        now += milliseconds(600);  // each round's check moves the clock past the deadline
        return false;
      });
  CHECK(late.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(late.status().message().find("'ranks' for 2 client ranks") != std::string::npos);

  // Another daemon leads it: the answer names that daemon only.
  absl::StatusOr<v1::CreateJobResponse> elsewhere = jobs.WaitForJoinable(
      "ranks", 2, milliseconds(500), [] { return std::optional<std::string>("b:1"); }, never);
  REQUIRE(elsewhere.ok());
  CHECK(elsewhere->leader() == "b:1");
  CHECK(elsewhere->job_id().empty());

  // Rank 0 creates it while rank 1 waits: rank 1 gets its answer as soon as it is added (the
  // poll is an hour: only the job's arrival wakes the wait).
  absl::StatusOr<v1::CreateJobResponse> joined = absl::UnknownError("not yet");
  std::thread rank1([&] {
    joined = jobs.WaitForJoinable("ranks", 2, milliseconds(60000), nowhere, never,
                                  std::chrono::hours(1));
  });
  add("job-ranks");
  rank1.join();
  REQUIRE(joined.ok());
  CHECK(joined->job_id() == "job-ranks");
  // A job with another client count is not it.
  CHECK(jobs.WaitForJoinable("ranks", 3, milliseconds(0), nowhere, never).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace rannc
