// The pipeline engine's ZeRO stage 2, parameter offload and both, against the plain engine:
// the same gradients, clipping, steps and optimizer state, with less device memory, on every
// host backend.
#include "daemon/runtime/pipeline_engine.h"

#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"
#include "daemon/optim/optimizer.h"
#include "daemon/runtime/plan_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;
using testing::IsParam;
using testing::MakePlan;
using testing::ParamIndices;

using testing::kAtol;
using testing::kRtol;

const char* BackendName(comm::Backend b) { return b == comm::Backend::kUcx ? "ucx" : "fake"; }

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
