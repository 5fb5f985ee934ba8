// A job over three "daemons" in one process: the leader ("a", plan devices 0 and 1) and parts on
// "b" (device 2) and "c" (device 3), reached through FakePartChannels, their engines meeting
// through one in-memory store. Every cross-daemon path the multi-process cluster tests reach:
// creating parts, training (outputs, gradients and parameters as PyTorch's), reads of tensors
// held elsewhere, clip_grad_norm over the daemons, load_state_dict pushed to the parts, a
// part's failure aborting the step everywhere, a lost member, deleting the parts.
#include "daemon/server/coordinator.h"

#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/comm/store.h"
#include "daemon/server/fake_part_channel.h"
#include "daemon/server/job.h"
#include "daemon/server/job_manager.h"
#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

using testing::Close;

DaemonFacts Facts(std::vector<std::string> devices) {
  DaemonFacts facts;
  facts.version = "test";
  for (const std::string& name : devices) facts.devices.push_back({name, "cpu", 256ull << 20});
  return facts;
}

cluster::MemberInfo Member(const std::string& address, int rank, int devices, bool self) {
  cluster::MemberInfo m;
  m.address = address;
  m.rank = rank;
  m.state = cluster::MemberState::kUp;
  m.self = self;
  for (int d = 0; d < devices; ++d) {
    m.devices.push_back({"cpu:" + std::to_string(d), "cpu", 256ull << 20});
  }
  return m;
}

// The leading daemon's side: what CreateJob on "a" makes of the client's spec.
class Cluster {
 public:
  explicit Cluster(const std::string& fixture)
      : f(testing::LoadFixture(fixture)), store(comm::MakeInMemoryStore()), channels(store.get()) {
    channels.AddDaemon("b", Facts({"cpu:0"}));
    channels.AddDaemon("c", Facts({"cpu:0"}));
  }

  // `spare`: the cluster has a fourth daemon, "d" (device 4), which the plan leaves unused.
  std::unique_ptr<Job> MakeJob(bool spare = false) {
    v1::JobSpec spec;
    spec.set_name("spanning");
    spec.mutable_mode()->set_training(true);
    spec.mutable_mode()->set_dropout(true);
    spec.mutable_optimizer()->set_type(v1::SGD);  // one group of every parameter
    spec.mutable_options()->set_check_unused_values(true);
    (*spec.mutable_options()->mutable_config())["partition_num"] = "2";
    (*spec.mutable_options()->mutable_config())["replica_num"] = "2";
    (*spec.mutable_options()->mutable_config())["pipeline_num"] = "2";
    const DaemonFacts facts = Facts({"cpu:0", "cpu:1"});
    absl::StatusOr<JobSettings> settings = JobSettingsFromSpec(spec, facts);
    REQUIRE(settings.ok());
    settings->planner.profiling.repeats = 1;
    std::vector<std::string> left_out;
    std::vector<cluster::MemberInfo> members = {Member("a", 0, 2, true), Member("b", 1, 1, false),
                                                Member("c", 2, 1, false)};
    if (spare) members.push_back(Member("d", 3, 1, false));
    REQUIRE(SpanCluster("job-a", spec, members, facts, store.get(), &*settings, &left_out).ok());
    CHECK(left_out.empty());
    REQUIRE(settings->members.size() == members.size() - 1);
    settings->backend = JobBackend(settings->placement, facts.devices);
    absl::StatusOr<std::unique_ptr<Job>> job =
        Job::Create("job-a", std::move(*settings), f.model_bytes, f.inputs, {}, &channels);
    INFO(job.status().ToString());
    REQUIRE(job.ok());
    return std::move(*job);
  }

  size_t Parts(const std::string& address) { return channels.jobs(address)->size(); }

  testing::Fixture f;
  std::unique_ptr<comm::Store> store;
  FakePartChannels channels;
};

absl::Status Step(Job& job) {
  JobOp op;
  HyperParams h;
  h.lr = 0.1;
  h.momentum = 0.9;
  op.hypers = {h};
  return job.Run(0, op).status();
}

void ZeroGrad(Job& job) {
  JobOp op;
  op.kind = JobOp::Kind::kZeroGrad;
  REQUIRE(job.Run(0, op).ok());
}

at::Tensor Value(Job& job, const std::string& name, bool grad = false) {
  absl::StatusOr<std::optional<at::Tensor>> t = job.GetTensor(name, grad);
  INFO(name << ": " << t.status().ToString());
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  return **t;
}

TEST_CASE("Coordinator trains a job over three daemons as PyTorch does", "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  CHECK(job->coordinator().leads());
  CHECK(cluster.Parts("b") == 1);
  CHECK(cluster.Parts("c") == 1);
  CHECK(job->info().devices ==
        std::vector<std::string>{"a/cpu:0", "a/cpu:1", "b/cpu:0", "c/cpu:0"});
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    if (step == 0) CHECK(Close((*out)[0], f.ref.at("out_0")));
    REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
    if (step == 0) {
      // Gradients wherever they are held: here, or read from a part.
      for (const ParamStore::Entry& e : job->params().entries()) {
        if (!e.is_parameter) continue;
        INFO(e.name);
        CHECK(Close(Value(*job, e.name, true), f.Ref("grad", e.name)));
      }
    }
    REQUIRE(Step(*job).ok());
    ZeroGrad(*job);
  }
  for (const StateEntry& entry : job->StateDict()) {
    if (entry.is_buffer) continue;
    INFO(entry.name);
    CHECK(Close(entry.tensor, f.Ref("step2", job->params().Find(entry.name)->name)));
  }
  // Undeployed everywhere and rebuilt by the next forward, losing nothing.
  job->Undeploy();
  CHECK(job->Summary().state == JobState::kUndeployed);
  REQUIRE(job->Forward(0, f.inputs, false).ok());
  for (const ParamStore::Entry& e : job->params().entries()) {
    if (e.is_parameter) CHECK(Close(Value(*job, e.name), f.Ref("step2", e.name)));
  }
  // Deleting the job deletes its parts.
  job.reset();
  CHECK(cluster.Parts("b") == 0);
  CHECK(cluster.Parts("c") == 0);
}

TEST_CASE("Coordinator clips gradients over every daemon as clip_grad_norm_", "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
  REQUIRE(out.ok());
  REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
  std::vector<at::Tensor> ref_grads;
  for (const ParamStore::Entry& e : job->params().entries()) {
    if (e.is_parameter) ref_grads.push_back(f.Ref("grad", e.name).flatten());
  }
  const double ref_total = at::cat(ref_grads).norm().item<double>();
  const double max_norm = ref_total / 4;
  absl::StatusOr<double> total = job->ClipGradNorm(0, max_norm, 2.0);
  REQUIRE(total.ok());
  CHECK(std::abs(*total - ref_total) <= 1e-5 * ref_total);
  const double coef = max_norm / (ref_total + 1e-6);
  for (const ParamStore::Entry& e : job->params().entries()) {
    if (!e.is_parameter) continue;
    INFO(e.name);
    CHECK(Close(Value(*job, e.name, true), f.Ref("grad", e.name) * coef));
  }
}

TEST_CASE("Coordinator loads a state_dict into the daemons that hold each entry", "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  std::map<std::string, at::Tensor> state;
  for (const StateEntry& s : job->StateDict()) state[s.name] = s.tensor + 1;
  std::vector<std::string> missing, unexpected;
  REQUIRE(job->LoadStateDict(state, true, &missing, &unexpected).ok());
  for (const StateEntry& s : job->StateDict()) {
    INFO(s.name);
    CHECK(Close(s.tensor, state.at(s.name)));
  }
  // The parts' devices hold the new values: the forward uses them.
  absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, false);
  REQUIRE(out.ok());
  CHECK_FALSE(Close((*out)[0], f.ref.at("out_0")));
}

TEST_CASE("Coordinator aborts the step everywhere when a part fails, losing nothing",
          "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  cluster.channels.FailNext("b", absl::InvalidArgumentError("injected failure"));
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<at::Tensor>> failed = job->Forward(0, f.inputs, true);
  // The cause, not its consequences on the other daemons (ABORTED), and at once: the waits of
  // the leader's and c's engines on b are cancelled, not timed out.
  CHECK(failed.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(failed.status().message().find("daemon b: injected failure") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  // Every daemon rebuilds its engine at the next call; training goes on exactly.
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    if (step == 0) CHECK(Close((*out)[0], f.ref.at("out_0")));
    REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
    REQUIRE(Step(*job).ok());
    ZeroGrad(*job);
  }
  for (const ParamStore::Entry& e : job->params().entries()) {
    if (e.is_parameter) CHECK(Close(Value(*job, e.name), f.Ref("step2", e.name)));
  }
  // A failed optimizer step on a part is reported the same way.
  cluster.channels.FailNext("c", absl::InternalError("injected step failure"));
  absl::Status step = Step(*job);
  CHECK(step.code() == absl::StatusCode::kInternal);
  CHECK(step.message().find("daemon c") != std::string::npos);
}

TEST_CASE("Coordinator fails every call of a job that lost a member, naming it", "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  REQUIRE(job->Forward(0, f.inputs, true).ok());
  cluster.channels.Cut("c");
  absl::StatusOr<std::vector<at::Tensor>> lost = job->Forward(0, f.inputs, true);
  CHECK(lost.status().code() == absl::StatusCode::kUnavailable);
  CHECK(lost.status().message().find("daemon c") != std::string::npos);
  CHECK(lost.status().message().find("is lost") != std::string::npos);
  CHECK(Step(*job).code() == absl::StatusCode::kUnavailable);
  CHECK(job->Forward(0, f.inputs, false).status().code() == absl::StatusCode::kUnavailable);
  // The cluster's word that a daemon is gone (heartbeats): a daemon the job does not use is
  // ignored; on a part, the loss of its leader makes it useless (the caller deletes it).
  CHECK_FALSE(job->coordinator().MemberLost("z", "not heard from"));
  CHECK(job->coordinator().Lost().message().find("daemon c") != std::string::npos);
  std::vector<JobManager::Listed> parts = cluster.channels.jobs("b")->List();
  REQUIRE(parts.size() == 1);
  CHECK(parts[0].job->coordinator().MemberLost("a", "not heard from for 3 s"));
  CHECK(parts[0].job->Forward(0, f.inputs, false).status().code() ==
        absl::StatusCode::kUnavailable);
}

TEST_CASE("Coordinator ignores the loss of a member whose devices the plan leaves unused",
          "[cluster]") {
  // The chaos test's kill_spare: a daemon that is UP when the job is created, but holds no part
  // of its plan, restarts; the job goes on.
  Cluster cluster("tiny_gpt");
  cluster.channels.AddDaemon("d", Facts({"cpu:0"}));
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob(/*spare=*/true);
  CHECK(cluster.Parts("d") == 0);
  REQUIRE(job->Forward(0, f.inputs, true).ok());
  CHECK_FALSE(job->coordinator().MemberLost("d", "restarted (incarnation 1 -> 2)"));
  CHECK(job->coordinator().Lost().ok());
  absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, f.inputs, true);
  INFO(out.status().ToString());
  CHECK(out.ok());
  // A member with a part is the job's.
  CHECK_FALSE(job->coordinator().MemberLost("b", "restarted (incarnation 1 -> 2)"));
  CHECK(job->coordinator().Lost().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("Coordinator delays reduction on every daemon; reads, steps and rebuilds over them",
          "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> job = cluster.MakeJob();
  std::map<std::string, at::Tensor> before;
  for (const ParamStore::Entry& e : job->params().entries()) {
    if (e.is_parameter) before[e.name] = Value(*job, e.name);
  }
  // Two accumulated backwards, unreduced on every daemon.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::vector<at::Tensor>> out =
        job->Forward(0, f.inputs, true, /*delay_grad_allreduce=*/true);
    REQUIRE(out.ok());
    REQUIRE(job->Backward(0, {{0, at::ones_like((*out)[0])}}, false, true).ok());
  }
  CHECK(Step(*job).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(job->ClipGradNorm(0, 1.0, 2.0).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // Reading a gradient reduces everywhere first (a part holds only its share).
  for (const auto& [name, value] : before) {
    INFO(name);
    CHECK(Close(Value(*job, name, true), 2 * f.Ref("grad", name)));
  }
  REQUIRE(Step(*job).ok());
  for (const auto& [name, value] : before) {
    INFO(name);
    CHECK(Close(Value(*job, name), value - f.Ref("grad", name) * 2 * 0.1));
  }
  // recreate_all_communicators: every daemon rebuilds its engine; nothing changes.
  absl::StatusOr<std::vector<at::Tensor>> first = job->Forward(0, f.inputs, false);
  REQUIRE(first.ok());
  JobOp recreate;
  recreate.kind = JobOp::Kind::kRecreateCommunicators;
  REQUIRE(job->Run(0, recreate).ok());
  absl::StatusOr<std::vector<at::Tensor>> again = job->Forward(0, f.inputs, false);
  REQUIRE(again.ok());
  CHECK(at::equal((*first)[0], (*again)[0]));
  // A graph for another mode runs whole on the leader's host, over values read from the parts.
  REQUIRE(job->AddMode(ModelMode{false, false}, f.model_bytes).ok());
  REQUIRE(job->SetMode(ModelMode{false, false}));
  absl::StatusOr<std::vector<at::Tensor>> eval = job->Forward(0, f.inputs, false);
  REQUIRE(eval.ok());
  CHECK(Close((*eval)[0], (*first)[0]));
}

TEST_CASE("Coordinator gathers and loads the optimizer state of every daemon", "[cluster]") {
  Cluster cluster("tiny_gpt");
  const testing::Fixture& f = cluster.f;
  std::unique_ptr<Job> first = cluster.MakeJob();
  auto train = [&](Job& job) {
    absl::StatusOr<std::vector<at::Tensor>> out = job.Forward(0, f.inputs, true);
    REQUIRE(out.ok());
    REQUIRE(job.Backward(0, {{0, at::ones_like((*out)[0])}}, false).ok());
    REQUIRE(Step(job).ok());
    ZeroGrad(job);
  };
  for (int i = 0; i < 2; ++i) train(*first);
  absl::StatusOr<std::vector<OptimizerEntry>> state = first->OptimizerState();
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  // Every parameter's momentum, wherever it is held, once.
  std::set<std::string> params;
  for (const OptimizerEntry& e : *state) {
    CHECK(e.key == "momentum_buffer");
    CHECK(params.insert(e.param).second);
  }
  size_t trained = 0;
  for (const ParamStore::Entry& e : first->params().entries()) trained += e.is_parameter;
  CHECK(params.size() == trained);

  // A second job over the daemons, given the first's parameters and optimizer state, takes
  // the same third step.
  std::unique_ptr<Job> second = cluster.MakeJob();
  std::map<std::string, at::Tensor> values;
  for (const StateEntry& s : first->StateDict()) values[s.name] = s.tensor;
  std::vector<std::string> missing, unexpected;
  REQUIRE(second->LoadStateDict(values, true, &missing, &unexpected).ok());
  // A bad entry is refused before any daemon loads anything.
  std::vector<OptimizerEntry> bad = *state;
  bad.back().value = at::zeros({2});
  CHECK(second->LoadOptimizerState(bad).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(second->LoadOptimizerState(*state).ok());
  train(*first);
  train(*second);
  for (const ParamStore::Entry& e : first->params().entries()) {
    if (!e.is_parameter) continue;
    INFO(e.name);
    CHECK(at::equal(Value(*first, e.name), Value(*second, e.name)));
  }
}

}  // namespace
}  // namespace rannc
