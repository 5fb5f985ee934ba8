// The pipeline engine against PyTorch: loss and gradients over stages, replicas and
// micro-batches on both host backends and schedules, SGD steps, failures, Forward and Backward
// with the client's output gradients, recomputation, kept and fused graphs, and the plans it
// refuses. Gradients and optimizers: pipeline_engine_grads_test.cc; ZeRO and offload:
// pipeline_engine_zero_test.cc.
#include "daemon/runtime/pipeline_engine.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"
#include "daemon/graph/subgraph.h"
#include "daemon/runtime/plan_testing.h"
#include "daemon/runtime/stage_executor.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;
using testing::IsParam;
using testing::MakePlan;

using testing::kAtol;
using testing::kRtol;

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
        CHECK((*engine)->fused() ==
              (std::string(name) == "mlp" || std::string(name) == "tiny_gpt"));
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

}  // namespace
}  // namespace rannc
