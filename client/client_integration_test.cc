// End-to-end tests of the SDK against a real ranncd on a loopback port (integration_testing.h):
// training a linear model exactly as PyTorch does (SGD, AdamW, and SGD momentum through dropped
// answers that the SDK retries and the daemon applies once), leases, state_dict round trips,
// modes, checkpoints (write, list, export), and the daemon's errors. The CLI:
// client_cli_integration_test.cc; planning: client_plan_integration_test.cc.
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/integration_testing.h"
#include "daemon/cluster/etcd_testing.h"
#include "client/rannc_client.h"

namespace rannc {
namespace {

using testing::Daemon;
using testing::Linear;
using testing::ReadFile;
using testing::RunPython;
using testing::TmpDir;

// What PyTorch computed for the linear model (testing::Linear): "kind name" -> values.
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

std::string CreateLinearJob(Client& client, v1::OptimizerType optimizer, const std::string& name,
                            const std::map<std::string, std::string>& keys = {}) {
  JobConfig config;
  config.name = name;
  config.config = keys;
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

// The C++ suites' tolerance against PyTorch (tests/fixtures/fixture.h: kRtol, kAtol, Close,
// which needs LibTorch; this is its allclose on plain values).
void CheckAllClose(const std::vector<double>& actual, const std::vector<double>& expected,
                   const std::string& what) {
  constexpr double kRtol = 1e-5;
  constexpr double kAtol = 1e-6;
  INFO(what);
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    INFO("element " << i << ": " << actual[i] << " vs " << expected[i]);
    CHECK(std::abs(actual[i] - expected[i]) <= kAtol + kRtol * std::abs(expected[i]));
  }
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_CASE("dropped answers are retried and applied once: SGD momentum trains as in PyTorch",
          "[integration][retry]") {
  // A daemon of its own whose fault hook runs and records these calls but answers UNAVAILABLE,
  // as if the response were lost: the 1st ZeroGrad, 2nd Forward, 3rd Backward, 2nd Step and
  // 1st LoadStateDict.
  const std::string drops = "ZeroGrad:1,Forward:2,Backward:3,Step:2,LoadStateDict:1";
  std::mutex retried_mu;
  std::map<std::string, int> retried;  // RPC -> retries the SDK made
  ClientOptions options;
  options.on_retry = [&](absl::string_view rpc, const absl::Status& cause) {
    std::lock_guard<std::mutex> lock(retried_mu);
    ++retried[std::string(rpc)];
    CHECK(cause.code() == absl::StatusCode::kUnavailable);
  };
  testing::DaemonProcess daemon("ranncd_drops", {{"RANNC_TEST_DROP_RESPONSES", drops}}, options);
  const absl::Status started = daemon.Start();
  INFO(started.ToString());
  REQUIRE(started.ok());
  Client& client = daemon.client();
  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-sgd-momentum-drops");
  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  sgd.set_momentum(0.9);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    absl::Status s = client.ZeroGrad(job_id);
    INFO(s.ToString());
    REQUIRE(s.ok());
    CheckAllClose({ForwardLoss(client, job_id)}, Expected("sgdm_loss " + std::to_string(step)),
                  "loss");
    s = client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}});
    INFO(s.ToString());
    REQUIRE(s.ok());
    s = client.Step(job_id, {sgd});
    INFO(s.ToString());
    REQUIRE(s.ok());
    if (step == 1) {  // a streamed mutating call: its whole stream is sent again
      absl::StatusOr<NamedTensors> state = client.StateDict(job_id);
      REQUIRE(state.ok());
      absl::StatusOr<LoadStateDictResult> loaded = client.LoadStateDict(job_id, *state);
      INFO(loaded.status().ToString());
      REQUIRE(loaded.ok());
      CHECK(loaded->missing_keys.empty());
      CHECK(loaded->unexpected_keys.empty());
    }
  }
  CheckAllClose({ForwardLoss(client, job_id, false)}, Expected("sgdm_loss 3"),
                "loss after 3 steps");
  for (const char* name : {"fc.weight", "fc.bias"}) {
    CheckAllClose(Values(client.GetParam(job_id, name)),
                  Expected("sgdm_param " + std::string(name)), std::string("param ") + name);
  }
  v1::JobSummary summary;
  REQUIRE(Listed(client, job_id, &summary));
  CHECK(summary.steps() == 3);  // the dropped Step ran once
  REQUIRE(client.DeleteJob(job_id).ok());

  // Every dropped answer was retried once by the SDK and answered from the daemon's record.
  {
    std::lock_guard<std::mutex> lock(retried_mu);
    CHECK(retried == std::map<std::string, int>{{"ZeroGrad", 1}, {"Forward", 1}, {"Backward", 1},
                                                {"Step", 1}, {"LoadStateDict", 1}});
  }
  const std::string log = daemon.Log();
  INFO("ranncd log:\n" << log);
  CHECK(Count(log, "dropping the answer") == 5);
  CHECK(Count(log, "answered from the record") == 5);
  for (const std::string rpc : {"ZeroGrad", "Forward", "Backward", "Step", "LoadStateDict"}) {
    INFO(rpc);
    CHECK(Count(log, rpc + ": dropping the answer to call ") == 1);
    CHECK(Count(log, rpc + ": call ") == 1);  // "...came again (a retry): answered from the record"
  }
  daemon.Stop();
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

TEST_CASE("optimizer state moves between jobs, and training goes on the same", "[integration]") {
  Client& client = Daemon().client();
  v1::HyperParams adamw;
  adamw.set_lr(0.01);
  adamw.set_beta1(0.9);
  adamw.set_beta2(0.999);
  adamw.set_eps(1e-8);
  adamw.set_weight_decay(0.01);
  auto step = [&](const std::string& job_id) {
    REQUIRE(client.ZeroGrad(job_id).ok());
    ForwardLoss(client, job_id);
    REQUIRE(client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
    REQUIRE(client.Step(job_id, {adamw}).ok());
  };
  const std::string first = CreateLinearJob(client, v1::ADAMW, "optimizer-state-a");
  absl::StatusOr<Client::OptimizerState> empty = client.GetOptimizerState(first);
  REQUIRE(empty.ok());
  CHECK(empty->empty());  // no step yet
  for (int i = 0; i < 2; ++i) step(first);
  absl::StatusOr<Client::OptimizerState> state = client.GetOptimizerState(first);
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  REQUIRE(state->count("fc.weight") == 1);
  const NamedTensors& weight = state->at("fc.weight");
  for (const char* key : {"step", "exp_avg", "exp_avg_sq"}) CHECK(weight.count(key) == 1);
  CHECK(Values(weight.at("step")) == std::vector<double>{2});
  CHECK(weight.at("exp_avg").shape == std::vector<int64_t>{3, 4});

  // A second job of the same model with the first's parameters and optimizer state takes the
  // same third step.
  const std::string second = CreateLinearJob(client, v1::ADAMW, "optimizer-state-b");
  absl::StatusOr<NamedTensors> params = client.StateDict(first);
  REQUIRE(params.ok());
  REQUIRE(client.LoadStateDict(second, *params).ok());
  absl::Status loaded = client.LoadOptimizerState(second, *state);
  INFO(loaded.ToString());
  REQUIRE(loaded.ok());
  step(first);
  step(second);
  for (const char* name : {"fc.weight", "fc.bias"}) {
    CHECK(Values(client.GetParam(second, name)) == Values(client.GetParam(first, name)));
  }

  // A wrong shape or an unknown key is refused, naming it, and changes nothing.
  Client::OptimizerState bad = *state;
  bad["fc.weight"]["exp_avg"] = HostTensor::Full(v1::FLOAT32, {2}, 0);
  absl::Status refused = client.LoadOptimizerState(second, bad);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK(refused.message().find("exp_avg") != std::string::npos);
  bad = *state;
  bad["fc.weight"]["momentum_buffer"] = HostTensor::Full(v1::FLOAT32, {3, 4}, 0);
  CHECK(client.LoadOptimizerState(second, bad).code() == absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Client::OptimizerState> after = client.GetOptimizerState(second);
  REQUIRE(after.ok());
  CHECK(Values(after->at("fc.weight").at("step")) == std::vector<double>{3});
  REQUIRE(client.DeleteJob(first).ok());
  REQUIRE(client.DeleteJob(second).ok());
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

// Reads an exported checkpoint with plain torch.load and writes what it holds, one line per
// tensor: "model NAME v0 v1 ..." and "optimizer KEY" for each top-level key of its state_dict.
constexpr const char* kLoadExportScript = R"PY(
import sys
import torch

blob = torch.load(sys.argv[1])
assert set(blob) == {"model", "optimizer"}, sorted(blob)
with open(sys.argv[2], "w") as out:
    for name, t in blob["model"].items():
        out.write("model %s %s\n" % (name, " ".join(repr(float(v)) for v in t.flatten())))
    for key in blob["optimizer"]:
        out.write("optimizer %s\n" % key)
)PY";

// The bytes an ExportCheckpoint stream announces (total_bytes) and carries, read with a raw stub.
std::pair<uint64_t, uint64_t> ExportStreamSizes(const v1::CheckpointsRef& ref) {
  auto stub = v1::TrainingService::NewStub(
      grpc::CreateChannel(Daemon().address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader =
      stub->ExportCheckpoint(&context, ref);
  v1::ExportChunk chunk;
  uint64_t total = 0;
  uint64_t carried = 0;
  while (reader->Read(&chunk)) {
    total = chunk.total_bytes();
    carried += chunk.data().size();
  }
  grpc::Status s = reader->Finish();
  INFO(s.error_message());
  REQUIRE(s.ok());
  return {total, carried};
}

TEST_CASE("checkpoints: written on request, listed, and exported for torch.load",
          "[integration]") {
  Client& client = Daemon().client();
  const std::string dir = TmpDir() + "/sdk_checkpoints";
  const std::string job_id =
      CreateLinearJob(client, v1::SGD, "linear-ckpt", {{"checkpoint_dir", dir}});
  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  REQUIRE(client.ZeroGrad(job_id).ok());
  ForwardLoss(client, job_id);
  REQUIRE(client.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
  REQUIRE(client.Step(job_id, {sgd}).ok());

  absl::StatusOr<v1::CheckpointInfo> info = client.Checkpoint(job_id, /*wait=*/true);
  INFO(info.status().ToString());
  REQUIRE(info.ok());
  CHECK(info->step() == 1);
  CHECK(info->committed());
  CHECK(info->bytes() > 0);
  CHECK(info->path().rfind(dir + "/linear-ckpt/", 0) == 0);
  CHECK(std::filesystem::is_directory(info->path()));

  v1::CheckpointsRef live;
  live.set_job_id(job_id);
  absl::StatusOr<v1::ListCheckpointsResponse> list = client.ListCheckpoints(live);
  INFO(list.status().ToString());
  REQUIRE(list.ok());
  REQUIRE(list->checkpoints_size() == 1);
  CHECK(list->checkpoints(0).step() == 1);
  CHECK(list->checkpoints(0).committed());
  CHECK(list->checkpoints(0).bytes() > 0);
  CHECK(list->checkpoints(0).path() == info->path());
  CHECK(list->checkpoints(0).created_unix_ms() > 0);
  CHECK(list->error().empty());

  // Exported: the file holds every byte the stream announced, and plain torch.load reads the
  // parameters the job has.
  const std::string out = TmpDir() + "/linear-ckpt.pt";
  absl::StatusOr<int64_t> step = client.ExportCheckpoint(live, out);
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  CHECK(*step == 1);
  CHECK(!std::filesystem::exists(out + ".tmp"));
  const auto [total, carried] = ExportStreamSizes(live);
  CHECK(total > 0);
  CHECK(carried == total);
  CHECK(std::filesystem::file_size(out) == total);
  const std::string listing = TmpDir() + "/linear-ckpt.txt";
  RunPython("load_export", kLoadExportScript, out + " " + listing);
  const std::string loaded = ReadFile(listing);
  INFO(loaded);
  for (const char* name : {"fc.weight", "fc.bias"}) {
    const size_t at = loaded.find(std::string("model ") + name + " ");
    REQUIRE(at != std::string::npos);
    std::istringstream fields(loaded.substr(at, loaded.find('\n', at) - at));
    std::string kind, got_name;
    fields >> kind >> got_name;
    std::vector<double> got;
    for (double v; fields >> v;) got.push_back(v);
    CheckClose(got, Values(client.GetParam(job_id, name)), std::string("exported ") + name);
  }
  CHECK(loaded.find("optimizer state") != std::string::npos);
  CHECK(loaded.find("optimizer param_groups") != std::string::npos);

  // A step that was never written: NOT_FOUND, and no file.
  v1::CheckpointsRef missing = live;
  missing.set_step(12345);
  const std::string nowhere = TmpDir() + "/missing.pt";
  absl::Status not_found = client.ExportCheckpoint(missing, nowhere).status();
  INFO(not_found.ToString());
  CHECK(not_found.code() == absl::StatusCode::kNotFound);
  CHECK(not_found.message().rfind("ExportCheckpoint: ", 0) == 0);
  CHECK(!std::filesystem::exists(nowhere));
  CHECK(!std::filesystem::exists(nowhere + ".tmp"));

  // Once the job is gone its checkpoints are found by name under the directory.
  REQUIRE(client.DeleteJob(job_id).ok());
  v1::CheckpointsRef by_name;
  by_name.set_job_name("linear-ckpt");
  by_name.set_checkpoint_dir(dir);
  list = client.ListCheckpoints(by_name);
  INFO(list.status().ToString());
  REQUIRE(list.ok());
  REQUIRE(list->checkpoints_size() == 1);
  CHECK(list->checkpoints(0).step() == 1);
  const std::string again = TmpDir() + "/linear-ckpt-again.pt";
  step = client.ExportCheckpoint(by_name, again);
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  CHECK(*step == 1);
  CHECK(std::filesystem::file_size(again) == total);
  CHECK(client.ListCheckpoints(live).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("a job without checkpoint_dir cannot checkpoint", "[integration]") {
  Client& client = Daemon().client();
  const std::string job_id = CreateLinearJob(client, v1::SGD, "linear-no-ckpt");
  absl::Status s = client.Checkpoint(job_id).status();
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  v1::CheckpointsRef ref;
  ref.set_job_id(job_id);
  CHECK(client.ListCheckpoints(ref).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(client.Checkpoint("no-such-job").status().code() == absl::StatusCode::kNotFound);
  REQUIRE(client.DeleteJob(job_id).ok());
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

TEST_CASE("failover: a job whose daemon is lost is found where it was taken over and trains on "
          "from its checkpoint as in PyTorch", "[integration][etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  const std::string a = "127.0.0.1:" + std::to_string(testing::FreeLoopbackPort());
  const std::string b = "127.0.0.1:" + std::to_string(testing::FreeLoopbackPort());
  const std::vector<std::string> flags = {
      "--peers", a + "," + b, "--cluster-store", "etcd://" + etcd.endpoints()[0],
      "--cluster-lease", "3s", "--heartbeat-interval", "200ms", "--profile-cache", "none",
      "--links", "p2p=5GB/s,allreduce=2:3GB/s"};
  const std::map<std::string, std::string> env = {{"RANNC_STATE_DIR", "none"}};
  testing::DaemonProcess first("failover-a", env, {}, flags, std::stoi(a.substr(10)));
  testing::DaemonProcess second("failover-b", env, {}, flags, std::stoi(b.substr(10)));
  REQUIRE(first.Start().ok());
  REQUIRE(second.Start().ok());
  // Both UP in the first's view before a job is planned over them.
  REQUIRE(testing::Eventually([&] {
    absl::StatusOr<v1::DaemonInfo> info = first.client().GetInfo();
    if (!info.ok() || info->cluster_size() != 2) return false;
    for (const v1::ClusterMember& m : info->cluster()) {
      if (m.state() != v1::MEMBER_UP) return false;
    }
    return true;
  }, std::chrono::seconds(30)));

  ClientOptions no_retries;
  no_retries.call_retry_timeout = absl::ZeroDuration();
  Client client(a + "," + b, no_retries);
  CHECK(client.addresses() == std::vector<std::string>{a, b});
  const std::string name = "sdk-failover";
  const std::string dir = TmpDir() + "/sdk_failover";
  std::string job_id = CreateLinearJob(client, v1::SGD, name,
                                       {{"checkpoint_dir", dir}, {"checkpoint_every", "2"}});
  absl::StatusOr<v1::RegisteredJob> entry = client.LocateJob(name);
  INFO(entry.status().ToString());
  REQUIRE(entry.ok());
  CHECK(entry->job_id() == job_id);
  CHECK(entry->leader() == a);
  CHECK(entry->generation() == 0);
  CHECK(client.Moved(job_id, name).value() == std::nullopt);
  CHECK(client.LocateJob("no-such-job").status().code() == absl::StatusCode::kNotFound);

  v1::HyperParams sgd;
  sgd.set_lr(0.1);
  auto step = [&](Client& c, int k) {
    INFO("step " << k);
    REQUIRE(c.ZeroGrad(job_id).ok());
    CheckClose({ForwardLoss(c, job_id)}, Expected("sgd_loss " + std::to_string(k)), "loss");
    REQUIRE(c.Backward(job_id, {{0, HostTensor::Scalar(1.0f)}}).ok());
    REQUIRE(c.Step(job_id, {sgd}).ok());
  };
  step(client, 0);
  step(client, 1);  // checkpoint_every 2: the checkpoint of step 2
  REQUIRE(testing::Eventually([&] {
    v1::CheckpointsRef ref;
    ref.set_job_id(job_id);
    absl::StatusOr<v1::ListCheckpointsResponse> list = client.ListCheckpoints(ref);
    return list.ok() && list->checkpoints_size() == 1 && list->checkpoints(0).committed();
  }));
  step(client, 2);

  first.Kill();  // SIGKILL the leading daemon
  CHECK_FALSE(client.ZeroGrad(job_id).ok());
  std::optional<v1::RegisteredJob> moved;
  REQUIRE(testing::Eventually([&] {
    absl::StatusOr<std::optional<v1::RegisteredJob>> m = client.Moved(job_id, name);
    if (m.ok()) moved = *m;
    return moved.has_value();
  }, std::chrono::seconds(30)));
  CHECK(moved->leader() == b);
  CHECK(moved->resumed_step() == 2);
  CHECK(moved->generation() == 1);
  // Driven there from the checkpoint's step: the third step again, as PyTorch took it.
  Client there(moved->leader());
  job_id = moved->job_id();
  step(there, 2);
  for (const char* param : {"fc.weight", "fc.bias"}) {
    CheckClose(Values(there.GetParam(job_id, param)), Expected("sgd_param " + std::string(param)),
               std::string("param ") + param);
  }
  REQUIRE(there.DeleteJob(job_id).ok());
  CHECK(there.LocateJob(name).status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace rannc
