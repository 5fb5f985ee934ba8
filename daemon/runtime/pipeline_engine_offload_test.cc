// Offload's streaming (EngineOptions::offload_block_bytes) against the plain engine: stages of
// one replica run as blocks whose parameters are on the device only while the block computes,
// with the same gradients, clipping, steps and optimizer state, and less device memory than
// offload that uploads a stage's parameters at once.
#include "daemon/runtime/pipeline_engine.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
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
using testing::BuildO2FixtureIr;
using testing::FixtureIr;
using testing::IsParam;
using testing::MakePlan;
using testing::ParamIndices;

using testing::kAtol;
using testing::kRtol;

std::unique_ptr<PipelineEngine> MakeEngine(
    const FixtureIr& f, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
    bool offload, int64_t block_bytes, bool low_precision = false,
    std::function<void(int, int)> before_host_step_unit = nullptr) {
  EngineOptions options;
  options.before_host_step_unit = std::move(before_host_step_unit);
  options.offload_low_precision = low_precision;
  options.backend = comm::Backend::kFake;
  options.num_devices = 4;
  options.offload = offload;
  options.offload_block_bytes = block_bytes;
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(*f.ir, plan, lifted, options);
  INFO(engine.status().ToString());
  REQUIRE(engine.ok());
  return std::move(*engine);
}

// `plan` with each stage of one replica keeping about half of its parameters' bytes on the
// device (DeploymentStage::kept_on_device_bytes, the planner's choice where memory has room).
// `holder` is an engine of the plan, telling which stage holds what.
v1::Deployment KeepingHalf(const FixtureIr& f, const PipelineEngine& holder,
                           v1::Deployment plan) {
  for (v1::DeploymentStage& stage : *plan.mutable_stages()) {
    if (stage.devices_size() != 1) continue;
    int64_t bytes = 0;
    for (size_t li = 0; li < f.tensors.size(); ++li) {
      if (IsParam(*f.ir, li) && holder.Param(f.ir->tensor_names[li], stage.devices(0)).ok()) {
        bytes += f.tensors[li].nbytes();
      }
    }
    stage.set_kept_on_device_bytes(bytes / 2);
  }
  return plan;
}

// A model's plan: its stages' plan devices, and micro-batches.
struct Case {
  const char* model;
  std::vector<std::vector<int>> devices;
  int m;
};

TEST_CASE("Streamed offload trains exactly like the plain engine, holding a block at a time",
          "[runtime]") {
  // One stage over micro-batches; two stages (tiny_gpt's tied embedding is read by both, so it
  // is uploaded whole; 1F1B keeps two micro-batches in the first stage); a stage with replicas
  // beside one without (only the latter streams). Each streamed as a whole, and keeping half
  // of its parameters on the device.
  const std::vector<Case> cases = {{"mlp", {{0}}, 1},
                                   {"tiny_gpt", {{0}}, 2},
                                   {"tiny_gpt", {{0}, {1}}, 2},
                                   {"multi_io", {{0}, {1}}, 1},
                                   {"multi_io", {{0, 1, 2}, {3}}, 1}};
  for (const Case& c : cases) {
    INFO(c.model << ", " << c.devices.size() << " stages, " << c.m << " micro-batches");
    FixtureIr f = BuildFixtureIr(c.model);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const std::vector<int> params = ParamIndices(ir);
    const v1::Deployment plan = MakePlan(ir, c.devices, c.m, v1::SCHEDULE_1F1B);
    std::unique_ptr<PipelineEngine> plain = MakeEngine(f, plan, f.tensors, false, 0);
    std::unique_ptr<PipelineEngine> whole = MakeEngine(f, plan, f.tensors, true, 0);
    // One byte: every atomic node that reads a parameter starts a block.
    std::unique_ptr<PipelineEngine> streamed = MakeEngine(f, plan, f.tensors, true, 1);
    const v1::Deployment keeping = KeepingHalf(f, *plain, plan);
    std::unique_ptr<PipelineEngine> kept = MakeEngine(f, keeping, f.tensors, true, 1);
    const std::vector<PipelineEngine*> offloaded = {streamed.get(), kept.get()};
    const std::vector<PipelineEngine*> all = {plain.get(), whole.get(), streamed.get(),
                                              kept.get()};
    HyperParams adam;
    adam.lr = 0.01;
    adam.weight_decay = 0.1;
    for (PipelineEngine* e : all) {
      REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
    }
    auto same_grads = [&](const char* when) {
      for (PipelineEngine* e : offloaded) {
        for (int li : params) {
          INFO(when << ": grad of " << ir.tensor_names[li] << (e == kept.get() ? ", kept" : ""));
          const at::Tensor want = plain->GradAt(li);
          const at::Tensor got = e->GradAt(li);
          REQUIRE(got.defined() == want.defined());
          if (want.defined()) CHECK(at::allclose(got, want, kRtol, kAtol));
        }
      }
    };
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      for (PipelineEngine* e : all) {
        e->ZeroGrad(/*set_to_none=*/step == 1);
        // Two backwards accumulate, the second with the client's loss gradient 0.5; the
        // evaluation forward between them runs the blocks without keeping anything.
        for (double g : {1.0, 0.5}) {
          absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
          REQUIRE(out.ok());
          CHECK(at::allclose((*out)[0], f.fixture.ref.at("out_0"), kRtol, kAtol) == (step == 0));
          REQUIRE(e->Backward({{0, at::full({}, g)}}, false).ok());
          REQUIRE(e->Forward(f.fixture.inputs, false).ok());
        }
      }
      same_grads("after backward");
      if (step == 1) {
        // Gradients added from outside the engine, and clipping.
        for (int li : params) {
          const at::Tensor extra =
              at::full(ir.values[ir.inputs[ir.num_user_inputs + li]].shape, 0.01 * (li + 1));
          plain->AddGrad(li, extra);
          for (PipelineEngine* e : offloaded) e->AddGrad(li, extra);
        }
        absl::StatusOr<double> want = plain->ClipGradNorm(params, 0.05, 2);
        REQUIRE(want.ok());
        for (PipelineEngine* e : offloaded) {
          absl::StatusOr<double> got = e->ClipGradNorm(params, 0.05, 2);
          REQUIRE(got.ok());
          CHECK(*got == Approx(*want).epsilon(1e-6));
        }
        same_grads("after clipping");
        REQUIRE(whole->ClipGradNorm(params, 0.05, 2).ok());
      }
      for (PipelineEngine* e : all) {
        REQUIRE(e->Step({adam}).ok());
      }
      for (PipelineEngine* e : offloaded) {
        for (int li : params) {
          INFO("after the step: " << ir.tensor_names[li] << (e == kept.get() ? ", kept" : ""));
          CHECK(at::allclose(e->ParamAt(li), plain->ParamAt(li), kRtol, kAtol));
        }
      }
    }
    const auto want_state = plain->OptimizerState();
    for (PipelineEngine* e : offloaded) {
      const auto got_state = e->OptimizerState();
      REQUIRE(got_state.size() == want_state.size());
      for (const auto& [li, entries] : want_state) {
        INFO("optimizer state of " << ir.tensor_names[li] << (e == kept.get() ? ", kept" : ""));
        REQUIRE(got_state.count(li));
        for (size_t k = 0; k < entries.size(); ++k) {
          CHECK(at::allclose(got_state.at(li)[k].second, entries[k].second, kRtol, kAtol));
        }
      }
    }
    // Per stage of one replica: it streamed in blocks, held less of its parameters at once
    // than the stage has, and less memory at its peak than offload without streaming. Between
    // steps both hold only buffers.
    for (const std::vector<int>& stage : c.devices) {
      const int dev = stage[0];
      INFO("device " << dev);
      if (stage.size() > 1) {
        CHECK(streamed->StreamedBlocks(dev) == 1);
        CHECK(streamed->StreamedPeakBytes(dev) == 0);
        CHECK(kept->KeptOnDeviceBytes(dev) == 0);
        continue;
      }
      int64_t stage_param_bytes = 0;
      for (size_t li = 0; li < f.tensors.size(); ++li) {
        if (IsParam(ir, li) && streamed->Param(ir.tensor_names[li], dev).ok()) {
          stage_param_bytes += f.tensors[li].nbytes();
        }
      }
      // Kept: whole parameters within the plan's bytes (some, where the stage streams), held
      // with their gradients and AdamW's two moments between steps; the rest streamed, never
      // more of it at once than streaming all of them.
      const int64_t kept_bytes = kept->KeptOnDeviceBytes(dev);
      if (streamed->StreamedBlocks(dev) > 1) CHECK(kept_bytes > 0);
      CHECK(kept_bytes <= stage_param_bytes / 2);
      // The kept ones are the stage's parameters in the order its nodes first read them, up
      // to the first that does not fit (the planner counts their gradients so), less those
      // another stage reads too.
      int64_t prefix = 0, room = 0;
      for (const v1::DeploymentStage& st : keeping.stages()) {
        if (st.devices(0) == dev) room = static_cast<int64_t>(st.kept_on_device_bytes());
      }
      std::vector<bool> seen(f.tensors.size(), false);
      bool full = false;
      for (size_t n = 0; n < ir.nodes.size() && !full; ++n) {
        for (int v : ir.nodes[n].inputs) {
          const int li = v - static_cast<int>(ir.num_user_inputs);
          if (v >= static_cast<int>(ir.inputs.size()) || li < 0 || !IsParam(ir, li) ||
              seen[li] || !streamed->Param(ir.tensor_names[li], dev).ok()) {
            continue;
          }
          seen[li] = true;
          bool tied = false;
          for (const std::vector<int>& other : c.devices) {
            if (other[0] != dev && streamed->Param(ir.tensor_names[li], other[0]).ok()) {
              tied = true;
            }
          }
          if (tied) continue;
          const int64_t size = static_cast<int64_t>(f.tensors[li].nbytes());
          if (prefix + size > room) {
            full = true;
            break;
          }
          prefix += size;
        }
      }
      CHECK(kept_bytes == prefix);
      CHECK(kept->DeviceBytes(dev) == whole->DeviceBytes(dev) + 4 * kept_bytes);
      CHECK(kept->StreamedPeakBytes(dev) <= streamed->StreamedPeakBytes(dev));
      if (streamed->StreamedBlocks(dev) < 3) continue;  // too small a stage to tell
      CHECK(streamed->StreamedPeakBytes(dev) > 0);
      CHECK(streamed->StreamedPeakBytes(dev) < stage_param_bytes);
      CHECK(streamed->DeviceBytes(dev) == whole->DeviceBytes(dev));
      // With one stage the parameters are most of what offload uploads (tiny_gpt's first of
      // two stages also holds the tied embedding whole, and two micro-batches' activations).
      INFO("peak " << streamed->PeakDeviceBytes(dev) << " streamed, "
                   << whole->PeakDeviceBytes(dev) << " whole");
      if (c.devices.size() == 1) {
        CHECK(streamed->PeakDeviceBytes(dev) < whole->PeakDeviceBytes(dev));
      }
    }
    // The state moves into fresh streamed engines (a job's undeploy and redeploy), one keeping
    // half its parameters on the device.
    std::vector<at::Tensor> now;
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      now.push_back(plain->ParamAt(i).requires_grad_(IsParam(ir, i)));
    }
    const auto state = streamed->OptimizerState();
    std::unique_ptr<PipelineEngine> moved = MakeEngine(f, plan, now, true, 1);
    std::unique_ptr<PipelineEngine> moved_kept = MakeEngine(f, keeping, now, true, 1);
    for (PipelineEngine* e : {moved.get(), moved_kept.get()}) {
      REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
      REQUIRE(e->LoadOptimizerState(state).ok());
    }
    for (PipelineEngine* e : {plain.get(), moved.get(), moved_kept.get()}) {
      e->ZeroGrad(true);
      REQUIRE(e->Forward(f.fixture.inputs, true).ok());
      REQUIRE(e->Backward({{0, at::ones({})}}, false).ok());
      REQUIRE(e->Step({adam}).ok());
    }
    for (PipelineEngine* e : {moved.get(), moved_kept.get()}) {
      for (int li : params) {
        INFO("after moving: " << ir.tensor_names[li] << (e == moved_kept.get() ? ", kept" : ""));
        CHECK(at::allclose(e->ParamAt(li), plain->ParamAt(li), kRtol, kAtol));
      }
    }
  }
}

bool OneReader(const IrGraph& ir, int li) {
  return ir.values[ir.inputs[ir.num_user_inputs + li]].consumers.size() == 1;
}

// The difference's norm within 1% of the reference's (bf16 keeps 8 bits).
bool WithinBf16(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() <= 1e-2 * want.norm().item<double>();
}

TEST_CASE("offload_low_precision streams O2's parameters in bf16, training exactly alike",
          "[runtime]") {
  // One micro-batch: tiny_gpt's bf16 loss is not the mean of its samples' (rounded apart), so
  // its batch is not split. Two backwards a step accumulate all the same.
  const std::vector<Case> cases = {{"mlp", {{0}}, 1},
                                   {"tiny_gpt", {{0}}, 1},
                                   {"tiny_gpt", {{0}, {1}}, 1}};
  for (const Case& c : cases) {
    INFO(c.model << ", " << c.devices.size() << " stages, " << c.m << " micro-batches");
    FixtureIr f = BuildO2FixtureIr(c.model);
    FixtureIr f32 = BuildFixtureIr(c.model);
    REQUIRE(f32.ir.ok());
    const IrGraph& ir = *f.ir;
    const std::vector<int> params = ParamIndices(ir);
    const v1::Deployment plan = MakePlan(ir, c.devices, c.m, v1::SCHEDULE_1F1B);
    std::unique_ptr<PipelineEngine> plain = MakeEngine(f, plan, f.tensors, false, 0);
    std::unique_ptr<PipelineEngine> streamed = MakeEngine(f, plan, f.tensors, true, 1, true);
    // offload_low_precision=false (the default): the masters' dtype over the link, as in fp32.
    std::unique_ptr<PipelineEngine> wide = MakeEngine(f, plan, f.tensors, true, 1);
    // The same model in fp32, streamed: its parameters travel in their masters' dtype.
    std::unique_ptr<PipelineEngine> fp32 = MakeEngine(
        f32, MakePlan(*f32.ir, c.devices, c.m, v1::SCHEDULE_1F1B), f32.tensors, true, 1);
    HyperParams adam;
    adam.lr = 0.01;
    adam.weight_decay = 0.1;
    for (PipelineEngine* e : {plain.get(), streamed.get()}) {
      REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
    }
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      for (PipelineEngine* e : {plain.get(), streamed.get()}) {
        e->ZeroGrad(/*set_to_none=*/true);
        for (double g : {1.0, 0.5}) {
          absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
          REQUIRE(out.ok());
          REQUIRE(e->Backward({{0, at::full({}, g, (*out)[0].options())}}, false).ok());
        }
      }
      // The host casts each master as the device's cast would, and the gradients come back
      // widened as the cast's backward widens them: equal, not merely close. A parameter read
      // by several nodes (tiny_gpt's embedding, tied to its head) is in several blocks, so it
      // does not stream; each block casts it apart, and their gradients add up widened, where
      // one backward over the whole stage adds them in bf16 before its one cast widens them:
      // within bf16's round-off of each other.
      for (int li : params) {
        INFO("grad of " << ir.tensor_names[li]);
        const at::Tensor want = plain->GradAt(li);
        const at::Tensor got = streamed->GradAt(li);
        REQUIRE(got.defined() == want.defined());
        if (!want.defined()) continue;
        CHECK(got.scalar_type() == at::kFloat);
        if (OneReader(ir, li)) {
          CHECK(at::equal(got, want));
        } else {
          CHECK(WithinBf16(got, want));
        }
      }
      if (step == 1) {
        // A master written between steps is cast again before it is uploaded.
        for (int li : params) {
          const at::Tensor value = plain->ParamAt(li) * 0.5;
          plain->SetParam(li, value);
          streamed->SetParam(li, value);
        }
      }
      for (PipelineEngine* e : {plain.get(), streamed.get()}) REQUIRE(e->Step({adam}).ok());
      for (int li : params) {
        INFO("after the step: " << ir.tensor_names[li]);
        CHECK(streamed->ParamAt(li).scalar_type() == at::kFloat);
        if (OneReader(ir, li)) {
          CHECK(at::equal(streamed->ParamAt(li), plain->ParamAt(li)));
        } else {
          CHECK(WithinBf16(streamed->ParamAt(li), plain->ParamAt(li)));
        }
      }
    }
    REQUIRE(fp32->Forward(f32.fixture.inputs, true).ok());
    REQUIRE(fp32->Backward({{0, at::ones({})}}, false).ok());
    absl::StatusOr<std::vector<at::Tensor>> out = wide->Forward(f.fixture.inputs, true);
    REQUIRE(out.ok());
    REQUIRE(wide->Backward({{0, at::ones({}, (*out)[0].options())}}, false).ok());
    for (const std::vector<int>& stage : c.devices) {
      const int dev = stage[0];
      INFO("device " << dev);
      CHECK(streamed->StreamedBlocks(dev) == fp32->StreamedBlocks(dev));
      if (streamed->StreamedBlocks(dev) < 2) continue;
      // Every streamed parameter is read through its cast: half the bytes on the device.
      CHECK(streamed->StreamedPeakBytes(dev) > 0);
      CHECK(2 * streamed->StreamedPeakBytes(dev) == fp32->StreamedPeakBytes(dev));
      CHECK(wide->StreamedPeakBytes(dev) == fp32->StreamedPeakBytes(dev));
    }
  }
}

TEST_CASE("A streamed device's optimizer step runs beside the next forward, to the same bits",
          "[runtime]") {
  struct StepCase {
    Case c;
    bool o2;  // amp_level O2 with offload_low_precision: the bf16 casts are made by the step
    bool keep = false;  // half of each stage's parameters kept on the device (KeepingHalf)
  };
  const std::vector<StepCase> cases = {{{"mlp", {{0}}, 1}, false},
                                       {{"tiny_gpt", {{0}}, 2}, false},
                                       {{"tiny_gpt", {{0}, {1}}, 2}, false},
                                       {{"tiny_gpt", {{0}}, 1}, true},
                                       {{"tiny_gpt", {{0}}, 2}, false, true}};
  for (const StepCase& sc : cases) {
    const Case& c = sc.c;
    INFO(c.model << ", " << c.devices.size() << " stages, " << c.m << " micro-batches"
                 << (sc.o2 ? ", O2 in bf16" : "") << (sc.keep ? ", half kept" : ""));
    FixtureIr f = sc.o2 ? BuildO2FixtureIr(c.model) : BuildFixtureIr(c.model);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const std::vector<int> params = ParamIndices(ir);
    v1::Deployment plan = MakePlan(ir, c.devices, c.m, v1::SCHEDULE_1F1B);
    if (sc.keep) plan = KeepingHalf(f, *MakeEngine(f, plan, f.tensors, false, 0), plan);
    // The step's thread holds each block's unit until the next forward has begun (at most
    // 5 s): that forward has to wait for the blocks it reads, and a unit stepped after the
    // forward began shows that the step did overlap it. The kept parameters' step, on the
    // worker, comes 20 ms late: the zero_grad right after the step must not take their
    // gradients before it has read them.
    std::atomic<bool> forward_began{false};
    std::atomic<int> overlapped{0};
    auto hold = [&](int, int unit) {
      if (unit < 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return;
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!forward_began && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (forward_began) ++overlapped;
    };
    std::unique_ptr<PipelineEngine> beside = MakeEngine(f, plan, f.tensors, true, 1, sc.o2, hold);
    // The same engine with each step finished before the next forward: a read waits for it.
    std::unique_ptr<PipelineEngine> before = MakeEngine(f, plan, f.tensors, true, 1, sc.o2);
    HyperParams adam;
    adam.lr = 0.01;
    adam.weight_decay = 0.1;
    for (PipelineEngine* e : {beside.get(), before.get()}) {
      REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
    }
    for (int step = 0; step < 4; ++step) {
      INFO("step " << step);
      std::vector<at::Tensor> losses;
      for (PipelineEngine* e : {beside.get(), before.get()}) {
        // A training loop's zero_grad comes while the step still runs; both kinds.
        e->ZeroGrad(/*set_to_none=*/step % 2 == 0);
        if (e == beside.get()) forward_began = true;
        absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
        REQUIRE(out.ok());
        losses.push_back((*out)[0]);
        REQUIRE(e->Backward({{0, at::ones({}, (*out)[0].options())}}, false).ok());
        if (e == beside.get()) forward_began = false;
        REQUIRE(e->Step({adam}).ok());
        if (e == before.get()) before->ParamAt(params[0]);
      }
      // The loss of a forward that ran beside the step equals the one after it.
      CHECK(at::equal(losses[0], losses[1]));
    }
    forward_began = true;  // the last step's thread has no forward to wait for
    CHECK(overlapped > 0);
    for (int li : params) {
      INFO(ir.tensor_names[li]);
      CHECK(at::equal(beside->ParamAt(li), before->ParamAt(li)));
      // The step gives the gradients back.
      const at::Tensor want = before->GradAt(li);
      const at::Tensor got = beside->GradAt(li);
      REQUIRE(got.defined() == want.defined());
      if (want.defined()) CHECK(at::equal(got, want));
    }
    const auto want_state = before->OptimizerState();
    const auto got_state = beside->OptimizerState();
    REQUIRE(got_state.size() == want_state.size());
    for (const auto& [li, entries] : want_state) {
      INFO("optimizer state of " << ir.tensor_names[li]);
      for (size_t k = 0; k < entries.size(); ++k) {
        CHECK(at::equal(got_state.at(li)[k].second, entries[k].second));
      }
    }
    // zero_grad(False) while the step runs leaves zeros, which a read makes.
    auto train = [&] {
      absl::StatusOr<std::vector<at::Tensor>> out = beside->Forward(f.fixture.inputs, true);
      REQUIRE(out.ok());
      REQUIRE(beside->Backward({{0, at::ones({}, (*out)[0].options())}}, false).ok());
    };
    train();
    REQUIRE(beside->Step({adam}).ok());
    beside->ZeroGrad(false);
    for (int li : params) {
      INFO("zeroed while stepping: " << ir.tensor_names[li]);
      const at::Tensor g = beside->GradAt(li);
      REQUIRE(g.defined());
      CHECK(g.abs().max().item<double>() == 0);
    }
    // Hyper-parameters the optimizer refuses: the error at once, nothing stepped, the
    // gradients kept.
    train();
    std::vector<at::Tensor> values, grads;
    for (int li : params) {
      values.push_back(beside->ParamAt(li));
      grads.push_back(beside->GradAt(li));
    }
    HyperParams refused = adam;
    refused.lr = -1;
    const absl::Status stepped = beside->Step({refused});
    INFO(stepped.ToString());
    CHECK(stepped.code() == absl::StatusCode::kInvalidArgument);
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("after the refused step: " << ir.tensor_names[params[i]]);
      CHECK(at::equal(beside->ParamAt(params[i]), values[i]));
      CHECK(at::equal(beside->GradAt(params[i]), grads[i]));
    }
  }
}

TEST_CASE("Offload refuses host memory the host does not have, before allocating it",
          "[runtime]") {
  // mlp in O2 on one streamed stage: every parameter is read once, through a cast to bf16.
  FixtureIr f = BuildO2FixtureIr("mlp");
  const IrGraph& ir = *f.ir;
  const std::vector<int> params = ParamIndices(ir);
  const v1::Deployment plan = MakePlan(ir, {{0}}, 1, v1::SCHEDULE_1F1B);
  int64_t available = 0;
  EngineOptions options;
  options.backend = comm::Backend::kFake;
  options.num_devices = 4;
  options.offload = true;
  options.offload_block_bytes = 1;
  options.offload_low_precision = true;
  options.host_memory_available = [&available] { return available; };
  absl::StatusOr<std::unique_ptr<PipelineEngine>> made =
      PipelineEngine::Create(ir, plan, f.tensors, options);
  REQUIRE(made.ok());
  PipelineEngine& engine = **made;
  REQUIRE(engine.SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
  int64_t masters = 0, copies = 0;
  for (int li : params) {
    masters += engine.ParamAt(li).nbytes();
    copies += engine.ParamAt(li).numel() * 2;  // bf16
  }
  HyperParams adam;
  adam.lr = 0.01;

  // The first forward makes the masters' bf16 copies for upload.
  available = copies - 1;
  absl::StatusOr<std::vector<at::Tensor>> out = engine.Forward(f.fixture.inputs, true);
  REQUIRE(out.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(out.status().message()), Catch::Contains("offload_low_precision"));
  available = copies;
  out = engine.Forward(f.fixture.inputs, true);
  REQUIRE(out.ok());
  REQUIRE(engine.Backward({{0, at::ones({}, (*out)[0].options())}}, false).ok());

  // The first step makes AdamW's two moments of each master: refused with nothing stepped.
  std::vector<at::Tensor> before;
  for (int li : params) before.push_back(engine.ParamAt(li).clone());
  available = 2 * masters - 1;
  absl::Status stepped = engine.Step({adam});
  REQUIRE(stepped.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(stepped.message()), Catch::Contains("optimizer's state"));
  CHECK(engine.OptimizerState().empty());
  for (size_t i = 0; i < params.size(); ++i) CHECK(at::equal(engine.ParamAt(params[i]), before[i]));
  available = 2 * masters;
  REQUIRE(engine.Step({adam}).ok());
  CHECK_FALSE(at::equal(engine.ParamAt(params[0]), before[0]));

  // Made once, they are not asked for again; an unknown amount (-1) is not checked.
  available = 0;
  out = engine.Forward(f.fixture.inputs, true);
  REQUIRE(out.ok());
  REQUIRE(engine.Backward({{0, at::ones({}, (*out)[0].options())}}, false).ok());
  REQUIRE(engine.Step({adam}).ok());
  available = -1;
  REQUIRE(engine.Forward(f.fixture.inputs, true).ok());
}

}  // namespace
}  // namespace rannc
