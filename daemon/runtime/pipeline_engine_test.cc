#include "daemon/runtime/pipeline_engine.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <catch2/catch.hpp>

#include "daemon/comm/fake/fake_communicator.h"
#include "daemon/graph/ir_testing.h"
#include "daemon/graph/subgraph.h"
#include "daemon/optim/optimizer.h"
#include "daemon/runtime/plan_testing.h"
#include "daemon/runtime/stage_executor.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;
using testing::IsParam;
using testing::MakePlan;
using testing::ParamIndices;

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

const char* BackendName(comm::Backend b) { return b == comm::Backend::kUcx ? "ucx" : "fake"; }

struct Shape {
  std::vector<std::vector<int>> devices;
  int m;
};

TEST_CASE("The engine gives PyTorch's loss and gradients over stages, replicas, micro-batches",
          "[runtime]") {
  const auto start = std::chrono::steady_clock::now();
  for (const char* name : {"mlp", "tiny_gpt", "multi_io"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const int64_t batch = ir.example_batch;
    REQUIRE(ir.nodes.size() >= 4);
    // Re-splitting between 1 and 3 replicas needs m * 3 <= batch.
    const int m13 = batch >= 6 ? 2 : 1;
    const std::vector<Shape> shapes = {
        {{{0, 1, 2, 3}}, 1},
        {{{0}, {1}}, 2},
        {{{0, 1}, {2, 3}}, 2},
        {{{0}, {1}, {2}, {3}}, 4},
        {{{0}, {1, 2, 3}}, m13},
        {{{3, 1, 2}, {0}}, m13},
    };
    for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
      for (v1::PipelineSchedule schedule : {v1::SCHEDULE_1F1B, v1::SCHEDULE_GPIPE}) {
        for (size_t k = 0; k < shapes.size(); ++k) {
          INFO(name << ", " << BackendName(backend) << ", "
                    << (schedule == v1::SCHEDULE_GPIPE ? "gpipe" : "1f1b") << ", shape " << k
                    << " (" << shapes[k].devices.size() << " stages, m=" << shapes[k].m << ")");
          v1::Deployment plan = MakePlan(ir, shapes[k].devices, shapes[k].m, schedule);
          absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
              PipelineEngine::Create(ir, plan, f.tensors, backend, 4);
          INFO(engine.status().ToString());
          REQUIRE(engine.ok());
          absl::StatusOr<StepResult> step = (*engine)->TrainStep(f.fixture.inputs);
          INFO(step.status().ToString());
          REQUIRE(step.ok());
          CHECK(at::allclose(step->loss, f.fixture.ref.at("out_0"), kRtol, kAtol));
          for (size_t i = 0; i < f.tensors.size(); ++i) {
            if (!IsParam(ir, i)) continue;
            const std::string& param = ir.tensor_names[i];
            INFO(param);
            absl::StatusOr<at::Tensor> grad = (*engine)->Grad(param);
            REQUIRE(grad.ok());
            REQUIRE(grad->defined());
            CHECK(at::allclose(*grad, f.fixture.Ref("grad", param), kRtol, kAtol));
            // Every holder (replicas, and stages sharing a tied weight) agrees.
            for (int dev = 0; dev < 4; ++dev) {
              absl::StatusOr<at::Tensor> g = (*engine)->Grad(param, dev);
              if (!g.ok()) continue;
              CHECK(at::allclose(*g, *grad, kRtol, kAtol));
            }
          }
        }
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WARN("engine conformance took " << seconds << " s");
}

// Plain SGD on one device: a whole-model StageExecutor.
TEST_CASE("Three SGD steps keep every replica equal to single-device SGD", "[runtime]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  std::vector<at::Tensor> leaves;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    at::Tensor t = f.tensors[i].detach().clone();
    if (IsParam(ir, i)) t.requires_grad_(true);
    leaves.push_back(t);
  }
  absl::StatusOr<Subgraph> whole = BuildSubgraph(ir, 0, static_cast<int>(ir.nodes.size()));
  REQUIRE(whole.ok());
  absl::StatusOr<std::unique_ptr<StageExecutor>> ref =
      StageExecutor::Create(ir, std::move(*whole), leaves);
  REQUIRE(ref.ok());

  for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
    for (const auto& devices : std::vector<std::vector<std::vector<int>>>{
             {{0, 1}, {2, 3}}, {{0}, {1, 2, 3}}}) {
      INFO(BackendName(backend) << ", " << devices.size() << " stages");
      // Fresh reference parameters.
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < leaves.size(); ++i) {
          leaves[i].copy_(f.tensors[i]);
          if (leaves[i].grad().defined()) leaves[i].mutable_grad().zero_();
        }
      }
      v1::Deployment plan = MakePlan(ir, devices, 1, v1::SCHEDULE_1F1B);
      absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
          PipelineEngine::Create(ir, plan, f.tensors, backend, 4);
      REQUIRE(engine.ok());
      for (int it = 0; it < 3; ++it) {
        INFO("step " << it);
        // Reference step.
        std::vector<at::Tensor> in;
        for (int v : (*ref)->data_inputs()) in.push_back(f.user_inputs[v]);
        absl::StatusOr<std::vector<at::Tensor>> out = (*ref)->Forward(0, in, true);
        REQUIRE(out.ok());
        std::vector<at::Tensor> out_grads((*ref)->outputs().size());
        for (size_t k = 0; k < out_grads.size(); ++k) {
          if ((*ref)->outputs()[k] == ir.outputs[0]) out_grads[k] = at::ones({});
        }
        REQUIRE((*ref)->Backward(0, out_grads).ok());
        const at::Tensor ref_loss = (*out)[0].detach();
        {
          at::NoGradGuard no_grad;
          for (at::Tensor& p : leaves) {
            if (p.requires_grad()) {
              p.sub_(p.grad(), 0.1);
              p.mutable_grad().zero_();
            }
          }
        }
        // Engine step.
        (*engine)->ZeroGrad();
        absl::StatusOr<StepResult> step = (*engine)->TrainStep(f.fixture.inputs);
        INFO(step.status().ToString());
        REQUIRE(step.ok());
        CHECK(at::allclose(step->loss, ref_loss, kRtol, kAtol));
        (*engine)->ApplySgd(0.1);
        for (size_t i = 0; i < leaves.size(); ++i) {
          if (!IsParam(ir, i)) continue;
          INFO(ir.tensor_names[i]);
          absl::StatusOr<at::Tensor> p = (*engine)->Param(ir.tensor_names[i]);
          REQUIRE(p.ok());
          CHECK(at::allclose(*p, leaves[i].detach(), kRtol, kAtol));
        }
      }
    }
  }
}

TEST_CASE("A worker's failure fails the step promptly with its device, and breaks the engine",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
    INFO(BackendName(backend));
    absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
        ir, MakePlan(ir, {{0}, {1, 2}}, 2, v1::SCHEDULE_1F1B), f.tensors, backend, 4,
        std::chrono::seconds(30));
    REQUIRE(engine.ok());
    std::vector<at::Tensor> inputs = f.fixture.inputs;
    inputs[0] = inputs[0].clone();
    inputs[0][3][0] = 1000;  // out of the vocabulary: the embedding of micro-batch 1 fails
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<StepResult> step = (*engine)->TrainStep(inputs);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(step.status().ToString());
    REQUIRE(!step.ok());
    CHECK(step.status().message().find("device 0 (stage 0, replica 0)") != std::string::npos);
    CHECK(step.status().message().find("micro-batch 1") != std::string::npos);
    CHECK(seconds < 10);
    CHECK((*engine)->TrainStep(f.fixture.inputs).status().code() ==
          absl::StatusCode::kFailedPrecondition);
    engine->reset();  // stops the workers with transfers abandoned
  }
}

// Every output of every fixture, and the gradients of `outputs[0].sum()` sent as the client's
// output gradient (what the fixtures' references hold): fused for losses, kept graphs otherwise.
TEST_CASE("Forward returns every output and Backward takes the client's output gradients",
          "[runtime]") {
  for (const char* name : {"mlp", "tied_lm", "multi_io", "tiny_gpt"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const std::vector<Shape> shapes = {
        {{{0, 1, 2}}, 1}, {{{0}, {1}}, 3}, {{{0, 1}, {2}}, 1}, {{{0}, {1}, {2, 3}}, 1}};
    for (size_t k = 0; k < shapes.size(); ++k) {
      for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
        INFO(name << ", shape " << k << ", " << BackendName(backend));
        absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
            ir, MakePlan(ir, shapes[k].devices, shapes[k].m, v1::SCHEDULE_1F1B), f.tensors,
            backend, 4);
        REQUIRE(engine.ok());
        CHECK((*engine)->fused() == (std::string(name) == "mlp" || std::string(name) == "tiny_gpt"));
        for (bool requires_grad : {false, true}) {
          absl::StatusOr<std::vector<at::Tensor>> out =
              (*engine)->Forward(f.fixture.inputs, requires_grad);
          INFO(out.status().ToString());
          REQUIRE(out.ok());
          REQUIRE(out->size() == ir.outputs.size());
          for (size_t i = 0; i < out->size(); ++i) {
            INFO("output " << i);
            CHECK(at::allclose((*out)[i], f.fixture.ref.at("out_" + std::to_string(i)), kRtol,
                               kAtol));
          }
          if (!requires_grad) {
            CHECK((*engine)->Backward({{0, at::ones_like((*out)[0])}}, false).code() ==
                  absl::StatusCode::kFailedPrecondition);
            continue;
          }
          absl::Status back = (*engine)->Backward({{0, at::ones_like((*out)[0])}}, false);
          INFO(back.ToString());
          REQUIRE(back.ok());
          CHECK((*engine)->Backward({{0, at::ones_like((*out)[0])}}, false).code() ==
                absl::StatusCode::kFailedPrecondition);
          for (size_t i = 0; i < f.tensors.size(); ++i) {
            if (!IsParam(ir, i)) continue;
            INFO(ir.tensor_names[i]);
            absl::StatusOr<at::Tensor> grad = (*engine)->Grad(ir.tensor_names[i]);
            REQUIRE(grad.ok());
            REQUIRE(grad->defined());
            CHECK(at::allclose(*grad, f.fixture.Ref("grad", ir.tensor_names[i]), kRtol, kAtol));
          }
        }
      }
    }
  }
}

TEST_CASE("Stages the plan marks for recomputation give the same gradients", "[runtime]") {
  for (const char* name : {"tiny_gpt", "multi_io"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    for (v1::PipelineSchedule schedule : {v1::SCHEDULE_1F1B, v1::SCHEDULE_GPIPE}) {
      INFO(name << (schedule == v1::SCHEDULE_GPIPE ? ", gpipe" : ", 1f1b"));
      v1::Deployment plan = MakePlan(ir, {{0, 1}, {2}, {3}}, 2, schedule);
      plan.mutable_stages(0)->set_recompute(true);
      plan.mutable_stages(2)->set_recompute(true);
      absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
          PipelineEngine::Create(ir, plan, f.tensors, comm::Backend::kUcx, 4);
      REQUIRE(engine.ok());
      absl::StatusOr<StepResult> step = (*engine)->TrainStep(f.fixture.inputs);
      INFO(step.status().ToString());
      REQUIRE(step.ok());
      CHECK(at::allclose(step->loss, f.fixture.ref.at("out_0"), kRtol, kAtol));
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        if (!IsParam(ir, i)) continue;
        INFO(ir.tensor_names[i]);
        CHECK(at::allclose((*engine)->GradAt(i), f.fixture.Ref("grad", ir.tensor_names[i]),
                           kRtol, kAtol));
      }
    }
  }
}

TEST_CASE("Kept graphs take a second backward with retain_graph", "[runtime]") {
  // Offloaded parameters stay on the devices while the graphs are kept.
  for (bool offload : {false, true})
  for (const char* name : {"multi_io", "tied_lm"}) {
    INFO(name << (offload ? ", offload" : ""));
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    EngineOptions options;
    options.backend = comm::Backend::kFake;
    options.num_devices = 4;
    options.offload = offload;
    absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
        ir, MakePlan(ir, {{0}, {1, 2}}, 1, v1::SCHEDULE_1F1B), f.tensors, options);
    REQUIRE(engine.ok());
    REQUIRE_FALSE((*engine)->fused());
    absl::StatusOr<std::vector<at::Tensor>> out = (*engine)->Forward(f.fixture.inputs, true);
    REQUIRE(out.ok());
    REQUIRE((*engine)->Backward({{0, at::ones_like((*out)[0])}}, true).ok());
    REQUIRE((*engine)->Backward({{0, at::ones_like((*out)[0])}}, false).ok());
    CHECK((*engine)->Backward({{0, at::ones_like((*out)[0])}}, false).code() ==
          absl::StatusCode::kFailedPrecondition);
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      if (!IsParam(ir, i)) continue;
      INFO(ir.tensor_names[i]);
      CHECK(at::allclose((*engine)->GradAt(i), f.fixture.Ref("grad", ir.tensor_names[i]) * 2,
                         kRtol, kAtol));
    }
  }
}

TEST_CASE("A fused forward scales by the client's loss gradient and keeps it for retain_graph",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
      ir, MakePlan(ir, {{0, 1}, {2, 3}}, 2, v1::SCHEDULE_1F1B), f.tensors, comm::Backend::kFake,
      4);
  REQUIRE(engine.ok());
  REQUIRE((*engine)->fused());
  auto check_grads = [&](double scale) {
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      if (!IsParam(ir, i)) continue;
      INFO(ir.tensor_names[i] << " x " << scale);
      at::Tensor grad = (*engine)->GradAt(static_cast<int>(i));
      REQUIRE(grad.defined());
      CHECK(at::allclose(grad, f.fixture.Ref("grad", ir.tensor_names[i]) * scale, kRtol, kAtol));
    }
  };
  REQUIRE((*engine)->Forward(f.fixture.inputs, true).ok());
  REQUIRE((*engine)->Backward({{0, at::full({}, 2.5)}}, false).ok());
  check_grads(2.5);
  (*engine)->ZeroGrad(/*set_to_none=*/true);
  CHECK(!(*engine)->GradAt(0).defined());
  REQUIRE((*engine)->Forward(f.fixture.inputs, true).ok());
  REQUIRE((*engine)->Backward({{0, at::ones({})}}, /*retain_graph=*/true).ok());
  REQUIRE((*engine)->Backward({{0, at::ones({})}}, false).ok());
  check_grads(2.0);
  // A forward whose backward never came: its gradients are dropped by the next forward.
  (*engine)->ZeroGrad();
  REQUIRE((*engine)->Forward(f.fixture.inputs, true).ok());
  REQUIRE((*engine)->Forward(f.fixture.inputs, true).ok());
  REQUIRE((*engine)->Backward({{0, at::ones({})}}, false).ok());
  check_grads(1.0);
  CHECK((*engine)->Backward({{0, at::ones({2})}}, false).code() ==
        absl::StatusCode::kFailedPrecondition);
  REQUIRE((*engine)->Forward(f.fixture.inputs, true).ok());
  CHECK((*engine)->Backward({{0, at::ones({2})}}, false).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK((*engine)->Backward({{5, at::ones({})}}, false).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Per-device optimizers match single-device SGD; state moves between engines; clipping",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("multi_io");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  const std::vector<int> params = ParamIndices(ir);
  HyperParams sgd;
  sgd.lr = 0.1;
  sgd.momentum = 0.9;
  const v1::Deployment plan = MakePlan(ir, {{0, 1}, {2}, {3}}, 2, v1::SCHEDULE_GPIPE);
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(ir, plan, f.tensors, comm::Backend::kUcx, 4);
  REQUIRE(engine.ok());
  CHECK((*engine)->Step({sgd}).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE((*engine)->SetOptimizer(OptimizerKind::kSgd, {params}).ok());
  auto train = [&](PipelineEngine& e) {
    e.ZeroGrad();
    absl::StatusOr<std::vector<at::Tensor>> out = e.Forward(f.fixture.inputs, true);
    REQUIRE(out.ok());
    REQUIRE(e.Backward({{0, at::ones({})}}, false).ok());
  };
  train(**engine);
  REQUIRE((*engine)->Step({sgd}).ok());
  // The step's state, moved to a fresh engine built from the updated parameters, continues as
  // the first one does (what a job's undeploy and redeploy do).
  std::vector<at::Tensor> now;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    now.push_back((*engine)->ParamAt(i).requires_grad_(IsParam(ir, i)));
  }
  absl::StatusOr<std::unique_ptr<PipelineEngine>> second =
      PipelineEngine::Create(ir, plan, now, comm::Backend::kFake, 4);
  REQUIRE(second.ok());
  REQUIRE((*second)->SetOptimizer(OptimizerKind::kSgd, {params}).ok());
  REQUIRE((*second)->LoadOptimizerState((*engine)->OptimizerState()).ok());
  for (PipelineEngine* e : {engine->get(), second->get()}) {
    train(*e);
    REQUIRE(e->Step({sgd}).ok());
    for (int li : params) {
      INFO(ir.tensor_names[li]);
      CHECK(at::allclose(e->ParamAt(li), f.fixture.Ref("step2", ir.tensor_names[li]), kRtol,
                         kAtol));
    }
  }
  CHECK((*engine)->DeviceBytes(0) > 0);
  CHECK((*engine)->DeviceBytes(7) == 0);

  // Clipping: torch.nn.utils.clip_grad_norm_ over every parameter, each counted once.
  train(**engine);
  std::vector<at::Tensor> grads, norms;
  for (int li : params) {
    grads.push_back((*engine)->GradAt(li));
    norms.push_back(at::norm(grads.back(), 2));
  }
  const double expected = at::norm(at::stack(norms), 2).item<double>();
  absl::StatusOr<double> total = (*engine)->ClipGradNorm(params, expected / 4, 2);
  REQUIRE(total.ok());
  CHECK(*total == Approx(expected).epsilon(1e-6));
  for (size_t k = 0; k < params.size(); ++k) {
    for (int dev = 0; dev < 4; ++dev) {
      absl::StatusOr<at::Tensor> g = (*engine)->Grad(ir.tensor_names[params[k]], dev);
      if (!g.ok()) continue;
      CHECK(at::allclose(*g, grads[k] * (expected / 4) / (expected + 1e-6), kRtol, kAtol));
    }
  }
}

// Batch k of three different batches made from a fixture's inputs: floating inputs scaled and
// shifted, integer ones (token ids, targets) rotated along their last dimension.
std::vector<at::Tensor> VariedBatch(const std::vector<at::Tensor>& inputs, int k) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : inputs) {
    out.push_back(at::isFloatingType(t.scalar_type()) ? t * (1.0 + 0.25 * k) + 0.1 * k
                                                      : at::roll(t, k, t.dim() - 1));
  }
  return out;
}

// The whole model on one device, plain LibTorch autograd: parameter gradients accumulate over
// backwards as in PyTorch.
class Reference {
 public:
  explicit Reference(const FixtureIr& f) : f_(f) {
    const IrGraph& ir = *f.ir;
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      at::Tensor t = f.tensors[i].detach().clone();
      if (IsParam(ir, i)) t.requires_grad_(true);
      leaves_.push_back(t);
    }
    absl::StatusOr<Subgraph> whole = BuildSubgraph(ir, 0, static_cast<int>(ir.nodes.size()));
    REQUIRE(whole.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> exec =
        StageExecutor::Create(ir, std::move(*whole), leaves_);
    REQUIRE(exec.ok());
    exec_ = std::move(*exec);
  }
  // Forward and backward with the gradient of the first output all ones.
  void Backward(const std::vector<at::Tensor>& client_inputs) {
    absl::StatusOr<std::vector<at::Tensor>> inputs =
        WithStepInputs(*f_.ir, client_inputs, leaves_);
    REQUIRE(inputs.ok());
    std::vector<at::Tensor> in;
    for (int v : exec_->data_inputs()) in.push_back((*inputs)[v]);
    absl::StatusOr<std::vector<at::Tensor>> out = exec_->Forward(0, in, true);
    REQUIRE(out.ok());
    std::vector<at::Tensor> out_grads(exec_->outputs().size());
    for (size_t k = 0; k < out_grads.size(); ++k) {
      if (exec_->outputs()[k] == f_.ir->outputs[0]) out_grads[k] = at::ones_like((*out)[k]);
    }
    REQUIRE(exec_->Backward(0, out_grads).ok());
  }
  at::Tensor Grad(size_t lifted) const { return leaves_[lifted].grad(); }

 private:
  const FixtureIr& f_;
  std::vector<at::Tensor> leaves_;
  std::unique_ptr<StageExecutor> exec_;
};

TEST_CASE("Delayed gradient reduction accumulates like PyTorch and all-reduces once",
          "[runtime]") {
  // Fused (mlp, tiny_gpt with a tied embedding) and kept graphs (multi_io, tied_lm).
  // Offloaded too: the delayed gradients wait in host memory.
  for (bool offload : {false, true})
  for (const char* name : {"mlp", "tiny_gpt", "multi_io", "tied_lm"}) {
    INFO(name << (offload ? ", offload" : ""));
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const v1::Deployment plan = MakePlan(ir, {{0, 1}, {2, 3}}, 2, v1::SCHEDULE_1F1B);
    auto make = [&](const std::string& group) {
      EngineOptions options;
      options.backend = comm::Backend::kFake;
      options.num_devices = 4;
      options.offload = offload;
      options.group = group;
      absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
          PipelineEngine::Create(ir, plan, f.tensors, options);
      REQUIRE(engine.ok());
      return std::move(*engine);
    };
    const std::string suffix = std::string(name) + (offload ? "_offload" : "");
    const std::string delayed_group = "delayed_" + suffix;
    const std::string eager_group = "eager_" + suffix;
    std::unique_ptr<PipelineEngine> delayed = make(delayed_group);
    std::unique_ptr<PipelineEngine> eager = make(eager_group);
    // Collectives issued on a group (by its rank 0) since the engines were created.
    auto counter = [](const std::string& group) {
      const int64_t base = comm::FakeCollectivesIssued(group, 0);
      return [group, base] { return comm::FakeCollectivesIssued(group, 0) - base; };
    };
    std::vector<std::function<int64_t()>> delayed_counts, eager_counts;
    for (const char* g : {"/stage0", "/stage1", "/world"}) {
      delayed_counts.push_back(counter(delayed_group + g));
      eager_counts.push_back(counter(eager_group + g));
    }
    const std::vector<int> params = ParamIndices(ir);
    Reference ref(f);
    auto backward = [&](PipelineEngine& e, const std::vector<at::Tensor>& batch) {
      absl::StatusOr<std::vector<at::Tensor>> out = e.Forward(batch, true);
      INFO(out.status().ToString());
      REQUIRE(out.ok());
      absl::Status back = e.Backward({{0, at::ones_like((*out)[0])}}, false);
      INFO(back.ToString());
      REQUIRE(back.ok());
    };
    // Every holder of every parameter (for reads, the sum of the devices' shares) equals the
    // reference's accumulated gradient.
    auto check_grads = [&](PipelineEngine& e) {
      for (int li : params) {
        INFO(ir.tensor_names[li]);
        REQUIRE(e.GradAt(li).defined());
        CHECK(at::allclose(e.GradAt(li), ref.Grad(li), kRtol, kAtol));
        for (int dev = 0; dev < 4; ++dev) {
          absl::StatusOr<at::Tensor> g = e.Grad(ir.tensor_names[li], dev);
          if (g.ok()) CHECK(at::allclose(*g, ref.Grad(li), kRtol, kAtol));
        }
      }
    };

    delayed->SetDelayGradReduction(true);
    for (int k = 0; k < 3; ++k) {
      const std::vector<at::Tensor> batch = VariedBatch(f.fixture.inputs, k);
      ref.Backward(batch);
      backward(*delayed, batch);
      backward(*eager, batch);
    }
    CHECK(delayed->grads_pending());
    CHECK_FALSE(eager->grads_pending());
    for (const auto& count : delayed_counts) CHECK(count() == 0);
    check_grads(*delayed);
    check_grads(*eager);
    // The optimizer step and clipping need reduced gradients.
    REQUIRE(delayed->SetOptimizer(OptimizerKind::kSgd, {params}).ok());
    HyperParams sgd;
    sgd.lr = 0.1;
    absl::Status step = delayed->Step({sgd});
    CHECK(step.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(step.message().find("allreduce_grads()") != std::string::npos);
    CHECK(delayed->ClipGradNorm(params, 1.0, 2.0).status().code() ==
          absl::StatusCode::kFailedPrecondition);

    REQUIRE(delayed->AllReduceGrads().ok());
    CHECK_FALSE(delayed->grads_pending());
    // One all-reduce per bucket of each replica group (one bucket: these models are small) and
    // one per tied parameter, where reducing after every backward issued three.
    int64_t reduced = 0;
    for (size_t g = 0; g < delayed_counts.size(); ++g) {
      INFO("group " << g);
      CHECK(eager_counts[g]() == 3 * delayed_counts[g]());
      if (g < 2) CHECK(delayed_counts[g]() <= 1);
      reduced += delayed_counts[g]();
    }
    CHECK(reduced > 0);
    check_grads(*delayed);
    // Nothing pending: a second call issues nothing.
    REQUIRE(delayed->AllReduceGrads().ok());
    for (size_t g = 0; g < delayed_counts.size(); ++g) {
      CHECK(eager_counts[g]() == 3 * delayed_counts[g]());
    }

    // Reduced gradients, then a delayed backward, then an eager one while that is pending: each
    // counted once.
    for (int k : {0, 1}) {
      const std::vector<at::Tensor> batch = VariedBatch(f.fixture.inputs, k);
      ref.Backward(batch);
      delayed->SetDelayGradReduction(k == 0);
      backward(*delayed, batch);
      CHECK(delayed->grads_pending());
      check_grads(*delayed);
    }
    REQUIRE(delayed->AllReduceGrads().ok());
    check_grads(*delayed);
    REQUIRE(delayed->Step({sgd}).ok());
    for (int li : params) {
      INFO(ir.tensor_names[li]);
      const at::Tensor want = f.tensors[li].detach() - ref.Grad(li) * 0.1;
      for (int dev = 0; dev < 4; ++dev) {
        absl::StatusOr<at::Tensor> p = delayed->Param(ir.tensor_names[li], dev);
        if (p.ok()) CHECK(at::allclose(*p, want, kRtol, kAtol));
      }
    }
    delayed->SetDelayGradReduction(true);
    backward(*delayed, f.fixture.inputs);
    CHECK(delayed->grads_pending());
    delayed->ZeroGrad();
    CHECK_FALSE(delayed->grads_pending());
  }
}

TEST_CASE("The engine refuses plans that do not fit the model or the devices", "[runtime]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  auto create = [&](const v1::Deployment& plan) {
    return PipelineEngine::Create(ir, plan, f.tensors, comm::Backend::kFake, 4).status().code();
  };
  v1::Deployment plan = MakePlan(ir, {{0}, {1}}, 1, v1::SCHEDULE_1F1B);
  v1::Deployment gap = plan;
  gap.mutable_stages(1)->set_first_node(plan.stages(1).first_node() + 1);
  CHECK(create(gap) == absl::StatusCode::kInvalidArgument);
  v1::Deployment short_plan = plan;
  short_plan.mutable_stages(1)->set_end_node(plan.stages(1).end_node() - 1);
  CHECK(create(short_plan) == absl::StatusCode::kInvalidArgument);
  v1::Deployment far = MakePlan(ir, {{0}, {4}}, 1, v1::SCHEDULE_1F1B);
  CHECK(create(far) == absl::StatusCode::kInvalidArgument);
  v1::Deployment twice = MakePlan(ir, {{0, 1}, {1}}, 1, v1::SCHEDULE_1F1B);
  CHECK(create(twice) == absl::StatusCode::kInvalidArgument);
  v1::Deployment other = plan;
  other.set_model_hash("another model");
  CHECK(create(other) == absl::StatusCode::kInvalidArgument);

  // A batch smaller than micro-batches x replicas runs in fewer micro-batches, and one smaller
  // than the replicas leaves some replicas without samples: the same loss and gradients as one
  // device.
  REQUIRE(ir.example_batch >= 4);
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
      ir, MakePlan(ir, {{0, 1, 2, 3}}, 2, v1::SCHEDULE_1F1B), f.tensors, comm::Backend::kFake, 4);
  REQUIRE(engine.ok());
  CHECK((*engine)->TrainStep(f.fixture.inputs).ok());
  absl::StatusOr<std::unique_ptr<PipelineEngine>> two_stages = PipelineEngine::Create(
      ir, MakePlan(ir, {{0, 1, 2}, {3}}, 2, v1::SCHEDULE_GPIPE), f.tensors, comm::Backend::kUcx,
      4);
  absl::StatusOr<std::unique_ptr<PipelineEngine>> one = PipelineEngine::Create(
      ir, MakePlan(ir, {{0}}, 1, v1::SCHEDULE_1F1B), f.tensors, comm::Backend::kFake, 4);
  REQUIRE(two_stages.ok());
  REQUIRE(one.ok());
  for (int64_t samples : {3, 1}) {
    INFO(samples << " samples");
    std::vector<at::Tensor> few;
    for (const at::Tensor& t : f.fixture.inputs) few.push_back(t.narrow(0, 0, samples));
    absl::StatusOr<StepResult> want = (*one)->TrainStep(few);
    REQUIRE(want.ok());
    for (PipelineEngine* e : {engine->get(), two_stages->get()}) {
      e->ZeroGrad();
      absl::StatusOr<StepResult> got = e->TrainStep(few);
      INFO(got.status().ToString());
      REQUIRE(got.ok());
      CHECK(at::allclose(got->loss, want->loss, kRtol, kAtol));
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        if (IsParam(ir, i)) CHECK(at::allclose(e->GradAt(i), (*one)->GradAt(i), kRtol, kAtol));
      }
    }
    (*one)->ZeroGrad();
  }
  CHECK((*engine)->Grad("no.such.param").status().code() == absl::StatusCode::kNotFound);
}


namespace zero_test {

std::unique_ptr<PipelineEngine> MakeEngine(const FixtureIr& f, const v1::Deployment& plan,
                                           const std::vector<at::Tensor>& lifted,
                                           comm::Backend backend, bool zero,
                                           bool offload = false,
                                           size_t bucket_bytes = EngineOptions().bucket_bytes) {
  EngineOptions options;
  options.bucket_bytes = bucket_bytes;
  options.backend = backend;
  options.num_devices = 4;
  options.zero = zero;
  options.offload = offload;
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(*f.ir, plan, lifted, options);
  INFO(engine.status().ToString());
  REQUIRE(engine.ok());
  return std::move(*engine);
}

}  // namespace zero_test

TEST_CASE("ZeRO, offload and both train exactly like the plain engine, with less device memory",
          "[runtime]") {
  struct Mode {
    const char* name;
    bool zero, offload;
    // Small buckets lay ZeRO out in several partitions (one per parameter or two), each
    // reduce-scattered on its own, most of them during the backward.
    size_t bucket_bytes = EngineOptions().bucket_bytes;
  };
  struct Case {
    const char* model;
    std::vector<std::vector<int>> devices;
    int m;
  };
  // Pure data parallelism over 4; a tied embedding (not sharded) across 2 x 2; 3 replicas,
  // whose shards need padding.
  const std::vector<Case> cases = {{"mlp", {{0, 1, 2, 3}}, 1},
                                   {"tiny_gpt", {{0, 1}, {2, 3}}, 2},
                                   {"multi_io", {{0, 1, 2}, {3}}, 1}};
  for (const Case& c : cases) {
   for (const Mode& mode :
        {Mode{"zero", true, false}, Mode{"zero, 64-byte buckets", true, false, 64},
         Mode{"offload", false, true}, Mode{"zero+offload", true, true},
         Mode{"zero+offload, 64-byte buckets", true, true, 64}}) {
    for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
      INFO(c.model << ", " << mode.name << ", " << BackendName(backend));
      FixtureIr f = BuildFixtureIr(c.model);
      REQUIRE(f.ir.ok());
      const IrGraph& ir = *f.ir;
      const std::vector<int> params = ParamIndices(ir);
      const v1::Deployment plan = MakePlan(ir, c.devices, c.m, v1::SCHEDULE_1F1B);
      std::unique_ptr<PipelineEngine> plain =
          zero_test::MakeEngine(f, plan, f.tensors, backend, false);
      std::unique_ptr<PipelineEngine> zero = zero_test::MakeEngine(
          f, plan, f.tensors, backend, mode.zero, mode.offload, mode.bucket_bytes);
      HyperParams adam;
      adam.lr = 0.01;
      adam.weight_decay = 0.1;
      for (PipelineEngine* e : {plain.get(), zero.get()}) {
        REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
      }
      auto same_grads = [&](const char* when) {
        for (int li : params) {
          INFO(when << ": grad of " << ir.tensor_names[li]);
          const at::Tensor want = plain->GradAt(li);
          const at::Tensor got = zero->GradAt(li);
          REQUIRE(got.defined() == want.defined());
          if (want.defined()) CHECK(at::allclose(got, want, kRtol, kAtol));
          absl::StatusOr<at::Tensor> named = zero->Grad(ir.tensor_names[li]);
          REQUIRE(named.ok());
          if (want.defined()) CHECK(at::allclose(*named, want, kRtol, kAtol));
        }
      };
      for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        for (PipelineEngine* e : {plain.get(), zero.get()}) {
          e->ZeroGrad(/*set_to_none=*/step == 1);
          // Two backwards accumulate, the second with the client's loss gradient 0.5.
          for (double g : {1.0, 0.5}) {
            absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
            REQUIRE(out.ok());
            REQUIRE(e->Backward({{0, at::full({}, g)}}, false).ok());
          }
        }
        same_grads("after backward");
        if (mode.zero && mode.bucket_bytes < 1024) {
          // Every replica's reduce-scatter overlapped with its last backward: a bucket
          // started while autograd ran (a hook issued it). mlp's and tiny_gpt's devices have
          // several (multi_io's replicated stage shards one parameter).
          int replicas = 0, all_buckets = 0;
          for (const std::vector<int>& stage : c.devices) {
            if (stage.size() == 1) continue;
            for (int dev : stage) {
              const auto [early, buckets] = zero->OverlappedBuckets(dev);
              INFO("device " << dev << ": " << early << " of " << buckets << " buckets early");
              CHECK(early > 0);
              ++replicas;
              all_buckets += buckets;
            }
          }
          if (std::string(c.model) != "multi_io") CHECK(all_buckets > replicas);
        }
        if (step == 1) {
          // Gradients added from outside the engine (another mode's backward), and clipping.
          for (int li : params) {
            const at::Tensor extra = at::full(ir.values[ir.inputs[ir.num_user_inputs + li]].shape,
                                              0.01 * (li + 1));
            plain->AddGrad(li, extra);
            zero->AddGrad(li, extra);
          }
          absl::StatusOr<double> want = plain->ClipGradNorm(params, 0.05, 2);
          absl::StatusOr<double> got = zero->ClipGradNorm(params, 0.05, 2);
          REQUIRE(want.ok());
          REQUIRE(got.ok());
          CHECK(*got == Approx(*want).epsilon(1e-6));
          same_grads("after clipping");
        }
        REQUIRE(plain->Step({adam}).ok());
        REQUIRE(zero->Step({adam}).ok());
        for (int li : params) {
          INFO("after the step: " << ir.tensor_names[li]);
          CHECK(at::allclose(zero->ParamAt(li), plain->ParamAt(li), kRtol, kAtol));
          // Every replica's copy was all-gathered.
          for (int dev = 0; dev < 4; ++dev) {
            absl::StatusOr<at::Tensor> p = zero->Param(ir.tensor_names[li], dev);
            if (p.ok()) CHECK(at::allclose(*p, plain->ParamAt(li), kRtol, kAtol));
          }
        }
      }
      // The optimizer state reads back whole, per parameter, as the unsharded engine's.
      const auto want_state = plain->OptimizerState();
      const auto got_state = zero->OptimizerState();
      REQUIRE(got_state.size() == want_state.size());
      for (const auto& [li, entries] : want_state) {
        INFO("optimizer state of " << ir.tensor_names[li]);
        REQUIRE(got_state.count(li));
        REQUIRE(got_state.at(li).size() == entries.size());
        for (size_t k = 0; k < entries.size(); ++k) {
          CHECK(got_state.at(li)[k].first == entries[k].first);
          CHECK(at::allclose(got_state.at(li)[k].second, entries[k].second, kRtol, kAtol));
        }
      }
      // Each replica holds a shard, or nothing between steps when offloaded: the first device
      // holds less than the plain engine's, between steps and at its peak during one, which
      // includes the step's activations and gradients (and, offloaded, its parameters).
      const int first = c.devices[0][0];
      CHECK(zero->DeviceBytes(first) < plain->DeviceBytes(first));
      CHECK(plain->PeakDeviceBytes(first) > plain->DeviceBytes(first));
      CHECK(zero->PeakDeviceBytes(first) > zero->DeviceBytes(first));
      CHECK(zero->PeakDeviceBytes(first) < plain->PeakDeviceBytes(first));
      if (mode.offload) {
        // Only buffers stay on the device between steps; a step held at least the stage's
        // parameters there.
        int64_t stage_param_bytes = 0, stage_buffer_bytes = 0;
        for (size_t li = 0; li < f.tensors.size(); ++li) {
          if (!zero->Param(ir.tensor_names[li], first).ok()) continue;
          (IsParam(ir, li) ? stage_param_bytes : stage_buffer_bytes) += f.tensors[li].nbytes();
        }
        CHECK(zero->DeviceBytes(first) == stage_buffer_bytes);
        CHECK(zero->PeakDeviceBytes(first) > stage_param_bytes);
      }
      // The state moves into a fresh ZeRO engine (a job's undeploy and redeploy), which then
      // trains on as the unsharded engine does.
      std::vector<at::Tensor> now;
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        now.push_back(plain->ParamAt(i).requires_grad_(IsParam(ir, i)));
      }
      std::unique_ptr<PipelineEngine> moved = zero_test::MakeEngine(
          f, plan, now, backend, mode.zero, mode.offload, mode.bucket_bytes);
      REQUIRE(moved->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
      REQUIRE(moved->LoadOptimizerState(got_state).ok());
      for (PipelineEngine* e : {plain.get(), moved.get()}) {
        e->ZeroGrad(true);
        REQUIRE(e->Forward(f.fixture.inputs, true).ok());
        REQUIRE(e->Backward({{0, at::ones({})}}, false).ok());
        REQUIRE(e->Step({adam}).ok());
      }
      for (int li : params) {
        INFO("after moving: " << ir.tensor_names[li]);
        CHECK(at::allclose(moved->ParamAt(li), plain->ParamAt(li), kRtol, kAtol));
      }
    }
   }
  }
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

TEST_CASE("Loss scaling skips an overflowing step everywhere and otherwise trains unscaled",
          "[runtime]") {
  // Fused (mlp) and client output gradients (multi_io); unsharded and ZeRO (whose shards are
  // unscaled after the reduce-scatter). A scale of 1024 (a power of two, so scaling is exact)
  // that halves on overflow and doubles after 2 good steps.
  for (const char* name : {"mlp", "multi_io"}) {
    for (bool zero : {false, true}) {
      INFO(name << (zero ? ", zero" : ""));
      FixtureIr f = BuildFixtureIr(name);
      REQUIRE(f.ir.ok());
      const IrGraph& ir = *f.ir;
      const v1::Deployment plan = MakePlan(ir, {{0, 1}, {2, 3}}, 2, v1::SCHEDULE_1F1B);
      const std::vector<int> params = ParamIndices(ir);
      LossScaleOptions scaling;
      scaling.enabled = true;
      scaling.init = 1024;
      scaling.growth_interval = 2;
      auto make = [&](bool scaled) {
        EngineOptions options;
        options.backend = comm::Backend::kFake;
        options.num_devices = 4;
        options.zero = zero;
        if (scaled) options.loss_scaler = LossScaler(scaling);
        absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
            PipelineEngine::Create(ir, plan, f.tensors, options);
        REQUIRE(engine.ok());
        REQUIRE((*engine)->SetOptimizer(OptimizerKind::kSgd, {params}).ok());
        return std::move(*engine);
      };
      std::unique_ptr<PipelineEngine> scaled = make(true), plain = make(false);
      HyperParams sgd;
      sgd.lr = 0.1;
      auto backward = [&](PipelineEngine& e, const std::vector<at::Tensor>& batch) {
        absl::StatusOr<std::vector<at::Tensor>> out = e.Forward(batch, true);
        REQUIRE(out.ok());
        REQUIRE(e.Backward({{0, at::ones_like((*out)[0])}}, false).ok());
      };
      // Step 1's inputs overflow fp32 in the forward: every gradient is inf or NaN.
      const std::vector<double> want_scale = {1024, 512, 512, 1024};
      for (int step = 0; step < 4; ++step) {
        INFO("step " << step);
        std::vector<at::Tensor> batch = VariedBatch(f.fixture.inputs, step);
        if (step == 1) {
          for (at::Tensor& t : batch) {
            if (at::isFloatingType(t.scalar_type())) t = t * 1e38;
          }
        }
        scaled->ZeroGrad();
        backward(*scaled, batch);
        if (step != 1) {
          plain->ZeroGrad();
          backward(*plain, batch);
          for (int li : params) {
            INFO(ir.tensor_names[li]);
            CHECK(at::allclose(scaled->GradAt(li), plain->GradAt(li), kRtol, kAtol));
          }
          REQUIRE(plain->Step({sgd}).ok());
        }
        REQUIRE(scaled->Step({sgd}).ok());
        CHECK(scaled->loss_scaler().scale() == want_scale[step]);
        for (int li : params) {
          INFO(ir.tensor_names[li]);
          CHECK(at::allclose(scaled->ParamAt(li), plain->ParamAt(li), kRtol, kAtol));
        }
      }
      CHECK(scaled->loss_scaler().skipped_steps() == 1);
    }
  }
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

TEST_CASE("zero_grad(set_to_none=False) frees the gradients and keeps their zeros' meaning",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  const v1::Deployment plan = MakePlan(ir, {{0, 1}, {2, 3}}, 2, v1::SCHEDULE_1F1B);
  const std::vector<int> params = ParamIndices(ir);
  auto make = [&] {
    absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
        PipelineEngine::Create(ir, plan, f.tensors, comm::Backend::kFake, 4);
    REQUIRE(engine.ok());
    REQUIRE((*engine)->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
    return std::move(*engine);
  };
  // `zeroed` zeroes its gradients; `explicit_zeros` holds them as zero tensors (AddGrad onto
  // none), as PyTorch's zero_grad(set_to_none=False) leaves them.
  std::unique_ptr<PipelineEngine> zeroed = make(), explicit_zeros = make();
  HyperParams adamw;
  adamw.lr = 0.01;
  adamw.weight_decay = 0.5;
  for (PipelineEngine* e : {zeroed.get(), explicit_zeros.get()}) {
    REQUIRE(e->TrainStep(f.fixture.inputs).ok());
    REQUIRE(e->Step({adamw}).ok());
  }
  const int64_t holding = zeroed->DeviceBytes(0);
  zeroed->ZeroGrad(/*set_to_none=*/false);
  explicit_zeros->ZeroGrad(/*set_to_none=*/true);
  for (int li : params) {
    explicit_zeros->AddGrad(li, at::zeros_like(f.tensors[li]));
    // Read as zeros, not as None.
    const at::Tensor g = zeroed->GradAt(li);
    REQUIRE(g.defined());
    CHECK(at::equal(g, at::zeros_like(f.tensors[li])));
  }
  // The zeros are not held: device 0 frees its gradients' bytes.
  int64_t grad_bytes = 0;
  for (int li : params) {
    if (zeroed->Param(ir.tensor_names[li], 0).ok()) grad_bytes += f.tensors[li].nbytes();
  }
  CHECK(zeroed->DeviceBytes(0) == holding - grad_bytes);
  // A step with no backward in between steps zeros (weight decay and moments move), and a
  // backward after zero_grad accumulates onto zeros: both as PyTorch does.
  for (PipelineEngine* e : {zeroed.get(), explicit_zeros.get()}) REQUIRE(e->Step({adamw}).ok());
  zeroed->ZeroGrad(false);
  explicit_zeros->ZeroGrad(false);
  for (PipelineEngine* e : {zeroed.get(), explicit_zeros.get()}) {
    REQUIRE(e->TrainStep(f.fixture.inputs).ok());
    REQUIRE(e->Step({adamw}).ok());
  }
  for (int li : params) {
    INFO(ir.tensor_names[li]);
    CHECK(at::allclose(zeroed->ParamAt(li), explicit_zeros->ParamAt(li), kRtol, kAtol));
    CHECK(at::allclose(zeroed->GradAt(li), explicit_zeros->GradAt(li), kRtol, kAtol));
  }
}

}  // namespace
}  // namespace rannc
