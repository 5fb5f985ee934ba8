// The pipeline engine on CUDA devices (EngineOptions::placement) against the same plan on the
// CPU, which pipeline_engine_test holds to PyTorch (bf16 and fp16: against one device of the
// same GPU).
// Needs a CUDA LibTorch and at least one GPU (tag gpu; it fails, not skips, without them). The
// plan's four devices go round-robin over the GPUs, so on one GPU they share it, and transfers
// go through host memory (host-staged fake backend); with NCCL built in, a case per GPU count
// runs over NCCL with one plan device per GPU.
//
// fp32 is held to the CPU engine: losses and gradients of the first step to rtol 1e-5 /
// atol 1e-6 (fp32 round-off: CUDA's kernels sum in other orders), parameters after each of
// three AdamW steps, and the later steps' losses and gradients, to rtol 1e-4 / atol 1e-5. AdamW
// runs with eps 1e-4: with PyTorch's 1e-8 it turns the round-off on a gradient that is zero in
// exact arithmetic (the attention's key bias, which softmax ignores) into
// lr-sized steps of either sign, on any two devices. bf16 autocast differs between the CPU and
// CUDA (other ops cast), so a bf16 plan is held to the same model on one device of the same GPU
// instead: each tensor within 2% of the reference's norm (atol 1e-3), since the batch split
// over micro-batches and replicas rounds differently in bf16 (Close below). fp16 (which CPU
// devices lack) is held the same way, with dynamic loss scaling: an overflow skips the step on
// every device and backs the scale off, as torch.cuda.amp.GradScaler does.
#include "daemon/runtime/pipeline_engine.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <catch2/catch.hpp>

#include "daemon/comm/factory.h"
#include "daemon/graph/ir_testing.h"
#include "daemon/optim/optimizer.h"
#include "daemon/runtime/plan_testing.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;
using testing::MakePlan;
using testing::ParamIndices;

int GpuCount() {
  // The CUDA hooks answer once libtorch_cuda is loaded (linked in a CUDA LibTorch build).
  return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
}

struct Mode {
  const char* name;
  bool zero, offload;
  AmpDtype amp;
  int64_t offload_block_bytes = 0;  // EngineOptions::offload_block_bytes
};

std::unique_ptr<PipelineEngine> MakeEngine(const FixtureIr& f, const v1::Deployment& plan,
                                           comm::Backend backend, const Mode& mode,
                                           std::vector<c10::Device> placement,
                                           const LossScaleOptions& scaling = {}) {
  EngineOptions options;
  options.loss_scaler = LossScaler(scaling);
  options.backend = backend;
  options.num_devices = plan.num_devices();
  options.zero = mode.zero;
  options.offload = mode.offload;
  options.offload_block_bytes = mode.offload_block_bytes;
  options.amp = mode.amp;
  options.placement = std::move(placement);
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(*f.ir, plan, f.tensors, options);
  INFO(engine.status().ToString());
  REQUIRE(engine.ok());
  return std::move(*engine);
}

// fp32: elementwise within rtol / atol. bf16: the whole tensor within 2% relative (the norm of
// the difference against the reference's norm, atol for tensors near zero), since bf16's 8-bit
// significand rounds single elements of a split batch's sums past any elementwise bound.
bool Close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol, bool amp) {
  if (!amp) return at::allclose(got, want, rtol, atol);
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  return (g - w).norm().item<double>() <= 2e-2 * w.norm().item<double>() + atol;
}

// Three AdamW steps (two accumulated backwards each, clipping in the second) on `cuda` and on
// `cpu`, the same plan and mode: losses, gradients, parameters and optimizer state agree.
void TrainAlike(const FixtureIr& f, PipelineEngine& cpu, PipelineEngine& cuda, bool amp) {
  const IrGraph& ir = *f.ir;
  const double param_rtol = 1e-4, param_atol = amp ? 1e-3 : 1e-5;
  // Outputs and gradients of later steps come from parameters that already differ by the
  // optimizer's round-off (on CUDA, AdamW's fused kernel orders its arithmetic differently),
  // so they are held to the parameters' bound; the first step's, to fp32 round-off.
  double rtol = 1e-5, atol = amp ? 1e-3 : 1e-6;
  const std::vector<int> params = ParamIndices(ir);
  HyperParams adam;
  adam.lr = 0.01;
  adam.weight_decay = 0.1;
  adam.eps = 1e-4;
  for (PipelineEngine* e : {&cpu, &cuda}) {
    REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
  }
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    if (step > 0) {
      rtol = param_rtol;
      atol = param_atol;
    }
    for (double g : {1.0, 0.5}) {
      absl::StatusOr<std::vector<at::Tensor>> want = cpu.Forward(f.fixture.inputs, true);
      absl::StatusOr<std::vector<at::Tensor>> got = cuda.Forward(f.fixture.inputs, true);
      INFO(want.status().ToString() << " / " << got.status().ToString());
      REQUIRE(want.ok());
      REQUIRE(got.ok());
      REQUIRE(got->size() == want->size());
      for (size_t k = 0; k < want->size(); ++k) {
        INFO("output " << k);
        CHECK((*got)[k].device().is_cpu());
        if ((*want)[k].is_floating_point()) {
          CHECK(Close((*got)[k], (*want)[k], rtol, atol, amp));
        } else {
          CHECK(at::equal((*got)[k], (*want)[k]));
        }
      }
      // The loss's gradient in the loss's dtype (bf16 under autocast, where the loss is).
      const at::Tensor seed = at::full({}, g, at::TensorOptions().dtype((*want)[0].scalar_type()));
      absl::Status ref_back = cpu.Backward({{0, seed}}, false);
      INFO(ref_back.ToString());
      REQUIRE(ref_back.ok());
      absl::Status back = cuda.Backward({{0, seed}}, false);
      INFO(back.ToString());
      REQUIRE(back.ok());
    }
    for (int li : params) {
      INFO("grad of " << ir.tensor_names[li]);
      const at::Tensor want = cpu.GradAt(li);
      const at::Tensor got = cuda.GradAt(li);
      REQUIRE(got.defined() == want.defined());
      if (!want.defined()) continue;
      CHECK(got.device().is_cpu());
      CHECK(Close(got, want, rtol, atol, amp));
    }
    if (step == 1) {
      absl::StatusOr<double> want = cpu.ClipGradNorm(params, 0.05, 2);
      absl::StatusOr<double> got = cuda.ClipGradNorm(params, 0.05, 2);
      REQUIRE(want.ok());
      INFO(got.status().ToString());
      REQUIRE(got.ok());
      CHECK(*got == Approx(*want).epsilon(amp ? 2e-2 : 1e-5));
    }
    REQUIRE(cpu.Step({adam}).ok());
    absl::Status stepped = cuda.Step({adam});
    INFO(stepped.ToString());
    REQUIRE(stepped.ok());
    for (PipelineEngine* e : {&cpu, &cuda}) e->ZeroGrad(/*set_to_none=*/step == 0);
    for (int li : params) {
      INFO("after the step: " << ir.tensor_names[li]);
      const at::Tensor got = cuda.ParamAt(li);
      CHECK(got.device().is_cpu());
      CHECK(Close(got, cpu.ParamAt(li), param_rtol, param_atol, amp));
    }
  }
  const auto want_state = cpu.OptimizerState();
  const auto got_state = cuda.OptimizerState();
  REQUIRE(got_state.size() == want_state.size());
  for (const auto& [li, entries] : want_state) {
    INFO("optimizer state of " << ir.tensor_names[li]);
    REQUIRE(got_state.at(li).size() == entries.size());
    for (size_t k = 0; k < entries.size(); ++k) {
      CHECK(got_state.at(li)[k].second.device().is_cpu());
      CHECK(Close(got_state.at(li)[k].second, entries[k].second, param_rtol, param_atol, amp));
    }
  }
}

struct Case {
  const char* model;
  std::vector<std::vector<int>> devices;
  int m;
};

const std::vector<Case>& StagedCases() {
  // Pipeline + replicas with a tied embedding; pure data parallelism; 3 replicas (padded ZeRO
  // shards) feeding one stage.
  static const std::vector<Case> cases = {{"tiny_gpt", {{0, 1}, {2, 3}}, 2},
                                          {"mlp", {{0, 1, 2, 3}}, 1},
                                          {"multi_io", {{0, 1, 2}, {3}}, 1}};
  return cases;
}

std::vector<c10::Device> RoundRobin(int devices, int gpus) {
  std::vector<c10::Device> placement;
  for (int d = 0; d < devices; ++d) placement.emplace_back(c10::kCUDA, d % gpus);
  return placement;
}

TEST_CASE("On CUDA devices the engine trains as on the CPU: plain, ZeRO, offload, both",
          "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  const std::vector<Mode> modes = {{"plain", false, false, {}},
                                   {"zero", true, false, {}},
                                   {"offload", false, true, {}},
                                   {"zero+offload", true, true, {}}};
  for (const Case& c : StagedCases()) {
    for (const Mode& mode : modes) {
      INFO(c.model << ", " << mode.name << ", 4 plan devices on " << gpus << " GPU(s), staged");
      FixtureIr f = BuildFixtureIr(c.model);
      REQUIRE(f.ir.ok());
      const v1::Deployment plan = MakePlan(*f.ir, c.devices, c.m, v1::SCHEDULE_1F1B);
      std::unique_ptr<PipelineEngine> cuda =
          MakeEngine(f, plan, comm::Backend::kFake, mode, RoundRobin(4, gpus));
      std::unique_ptr<PipelineEngine> cpu = MakeEngine(f, plan, comm::Backend::kFake, mode, {});
      TrainAlike(f, *cpu, *cuda, false);
      // Between steps the device holds what the CPU engine's does (host masters not counted).
      const int first = c.devices[0][0];
      CHECK(cuda->DeviceBytes(first) == cpu->DeviceBytes(first));
      CHECK(cuda->PeakDeviceBytes(first) > cuda->DeviceBytes(first));
    }
  }
}

TEST_CASE("Streamed offload on CUDA devices trains as on the CPU, prefetching on a side stream",
          "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  // One byte: every atomic node that reads a parameter starts a block. One stage over two
  // micro-batches; two stages of one replica each (the first holds two micro-batches in flight
  // under 1F1B, and the tied embedding whole); one stage keeping half of its parameters' bytes
  // on the device (stepped there on the worker while the host's thread steps the rest).
  const Mode streamed{"offload, streamed", false, true, {}, 1};
  struct KeepCase {
    Case c;
    bool keep;
  };
  const std::vector<KeepCase> cases = {{{"tiny_gpt", {{0}}, 2}, false},
                                       {{"tiny_gpt", {{0}, {1}}, 2}, false},
                                       {{"tiny_gpt", {{0}}, 2}, true}};
  for (const auto& [c, keep] : cases) {
    INFO(c.model << ", " << c.devices.size() << " stage(s) on " << gpus << " GPU(s)"
                 << (keep ? ", half kept" : ""));
    FixtureIr f = BuildFixtureIr(c.model);
    REQUIRE(f.ir.ok());
    int n = 0;
    for (const auto& stage : c.devices) n += static_cast<int>(stage.size());
    v1::Deployment plan = MakePlan(*f.ir, c.devices, c.m, v1::SCHEDULE_1F1B, n);
    if (keep) {
      int64_t bytes = 0;
      for (int li : ParamIndices(*f.ir)) bytes += f.tensors[li].nbytes();
      plan.mutable_stages(0)->set_kept_on_device_bytes(bytes / 2);
    }
    std::unique_ptr<PipelineEngine> cuda =
        MakeEngine(f, plan, comm::Backend::kFake, streamed, RoundRobin(n, gpus));
    std::unique_ptr<PipelineEngine> cpu = MakeEngine(f, plan, comm::Backend::kFake, streamed, {});
    TrainAlike(f, *cpu, *cuda, false);
    int most_blocks = 0;
    for (int dev = 0; dev < n; ++dev) {
      INFO("device " << dev);
      CHECK(cuda->StreamedBlocks(dev) == cpu->StreamedBlocks(dev));
      CHECK(cuda->StreamedPeakBytes(dev) == cpu->StreamedPeakBytes(dev));
      CHECK(cuda->DeviceBytes(dev) == cpu->DeviceBytes(dev));
      CHECK(cuda->KeptOnDeviceBytes(dev) == cpu->KeptOnDeviceBytes(dev));
      if (keep) CHECK(cuda->KeptOnDeviceBytes(dev) > 0);
      most_blocks = std::max(most_blocks, cuda->StreamedBlocks(dev));
    }
    CHECK(most_blocks > 1);  // a stage streamed: the side stream's prefetches ran
  }
}

// A low-precision case's IR, built as a job on CUDA devices builds it: on the host under the
// CPU's autocast, the values' dtypes from one more run on the GPU under CUDA's
// (IrOptions::dtype_device), whose op lists differ, so that stages send each other what they
// compute, uncast, as the one-device run does.
FixtureIr LowPrecisionIr(const Case& c, const Mode& mode) {
  AutocastGuard amp(mode.amp);
  AutocastGuard cuda_amp(mode.amp, /*cuda=*/true);
  IrOptions options;
  options.dtype_device = c10::Device(c10::kCUDA, 0);
  return BuildFixtureIr(c.model, options);
}

// The case's plan over 4 plan devices on the GPUs (staged), and the whole model on one device of
// GPU 0, both in `mode` with `scaling`. They read `f`, which must outlive them.
struct LowPrecisionEngines {
  std::unique_ptr<PipelineEngine> staged, one;
};

LowPrecisionEngines MakeLowPrecisionEngines(const FixtureIr& f, const Case& c, const Mode& mode,
                                            int gpus, const LossScaleOptions& scaling = {}) {
  const v1::Deployment plan = MakePlan(*f.ir, c.devices, c.m, v1::SCHEDULE_1F1B);
  const v1::Deployment whole = MakePlan(*f.ir, {{0}}, 1, v1::SCHEDULE_1F1B, 1);
  return {MakeEngine(f, plan, comm::Backend::kFake, mode, RoundRobin(4, gpus), scaling),
          MakeEngine(f, whole, comm::Backend::kFake, mode, {c10::Device(c10::kCUDA, 0)},
                     scaling)};
}

TEST_CASE("bf16 on CUDA devices trains as the same model on one device of the GPU", "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  const Mode bf16{"bf16", false, false, at::kBFloat16};
  for (const Case& c : StagedCases()) {
    INFO(c.model << ", bf16, 4 plan devices on " << gpus << " GPU(s), staged");
    const FixtureIr f = LowPrecisionIr(c, bf16);
    REQUIRE(f.ir.ok());
    LowPrecisionEngines e = MakeLowPrecisionEngines(f, c, bf16, gpus);
    TrainAlike(f, *e.one, *e.staged, true);
  }
}

TEST_CASE("fp16 with loss scaling on CUDA devices: an overflow skips the step everywhere, then "
          "it trains as the same model on one device of the GPU", "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  const Mode fp16{"fp16", false, false, at::kHalf};
  LossScaleOptions scaling;
  scaling.enabled = true;
  scaling.init = std::ldexp(1.0, 56);      // overflows fp16's backward at once
  scaling.backoff = std::ldexp(1.0, -44);  // then 2^12, which does not
  for (const Case& c : StagedCases()) {
    INFO(c.model << ", fp16, 4 plan devices on " << gpus << " GPU(s), staged");
    const FixtureIr f = LowPrecisionIr(c, fp16);
    REQUIRE(f.ir.ok());
    LowPrecisionEngines engines = MakeLowPrecisionEngines(f, c, fp16, gpus, scaling);
    PipelineEngine& cuda = *engines.staged;
    PipelineEngine& one = *engines.one;
    const std::vector<int> params = ParamIndices(*f.ir);
    HyperParams adam;
    adam.lr = 0.01;
    for (PipelineEngine* e : {&one, &cuda}) {
      INFO("the overflowing step");
      REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
      std::vector<at::Tensor> before;
      for (int li : params) before.push_back(e->ParamAt(li));
      absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
      INFO(out.status().ToString());
      REQUIRE(out.ok());
      const at::Tensor seed = at::ones({}, at::TensorOptions().dtype((*out)[0].scalar_type()));
      REQUIRE(e->Backward({{0, seed}}, false).ok());
      absl::Status stepped = e->Step({adam});
      INFO(stepped.ToString());
      REQUIRE(stepped.ok());
      CHECK(e->loss_scaler().skipped_steps() == 1);
      CHECK(e->loss_scaler().scale() == std::ldexp(1.0, 12));
      for (size_t k = 0; k < params.size(); ++k) {
        INFO(f.ir->tensor_names[params[k]]);
        CHECK(at::equal(e->ParamAt(params[k]), before[k]));
      }
      e->ZeroGrad(/*set_to_none=*/true);
    }
    TrainAlike(f, one, cuda, true);
    CHECK(one.loss_scaler().skipped_steps() == 1);
    CHECK(cuda.loss_scaler().skipped_steps() == 1);
  }
}

TEST_CASE("A checkpoint's reads from CUDA devices hold the step they were taken at while the "
          "next step runs", "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  const Case c = StagedCases()[0];
  for (const Mode& mode : {Mode{"plain", false, false, {}}, Mode{"zero", true, false, {}}}) {
    INFO(c.model << ", " << mode.name);
    FixtureIr f = BuildFixtureIr(c.model);
    REQUIRE(f.ir.ok());
    const v1::Deployment plan = MakePlan(*f.ir, c.devices, c.m, v1::SCHEDULE_1F1B);
    std::unique_ptr<PipelineEngine> e =
        MakeEngine(f, plan, comm::Backend::kFake, mode, RoundRobin(4, gpus));
    const std::vector<int> params = ParamIndices(*f.ir);
    HyperParams adam;
    adam.lr = 0.01;
    REQUIRE(e->SetOptimizer(OptimizerKind::kAdamW, {params}).ok());
    auto step = [&] {
      absl::StatusOr<std::vector<at::Tensor>> out = e->Forward(f.fixture.inputs, true);
      REQUIRE(out.ok());
      const at::Tensor seed = at::ones({}, at::TensorOptions().dtype((*out)[0].scalar_type()));
      REQUIRE(e->Backward({{0, seed}}, false).ok());
      REQUIRE(e->Step({adam}).ok());
      e->ZeroGrad(/*set_to_none=*/true);
    };
    step();
    std::vector<at::Tensor> want;
    for (int li : params) want.push_back(e->ParamAt(li));
    std::vector<PipelineEngine::StatePiece> want_state = e->OptimizerStatePieces();

    e->BeginAsyncReads();
    std::vector<at::Tensor> got;
    for (int li : params) got.push_back(e->ParamAt(li));
    std::vector<PipelineEngine::StatePiece> got_state = e->OptimizerStatePieces();
    std::function<void()> ready = e->EndAsyncReads();
    step();  // writes every parameter and its state: after the copies, on the device
    ready();
    for (size_t k = 0; k < params.size(); ++k) {
      INFO(f.ir->tensor_names[params[k]]);
      CHECK(got[k].is_pinned());
      CHECK(at::equal(got[k], want[k]));
      CHECK(!at::equal(e->ParamAt(params[k]), want[k]));  // the second step moved it
    }
    REQUIRE(got_state.size() == want_state.size());
    for (size_t k = 0; k < want_state.size(); ++k) {
      INFO(f.ir->tensor_names[want_state[k].lifted] << " " << want_state[k].key);
      CHECK(got_state[k].lifted == want_state[k].lifted);
      CHECK(got_state[k].offset == want_state[k].offset);
      CHECK(at::equal(got_state[k].value, want_state[k].value));
    }
    // After EndAsyncReads, reads are synchronous again.
    const at::Tensor after = e->ParamAt(params[0]);
    CHECK(!at::equal(after, want[0]));
  }
}

TEST_CASE("Over NCCL, one plan device per GPU, the engine trains as on the CPU", "[gpu]") {
  const int gpus = GpuCount();
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(gpus > 0);
  if (!comm::BackendBuiltIn(comm::Backend::kNccl)) {
    FAIL("this build has no NCCL backend; a GPU build has (CMake -DRANNC_WITH_NCCL=ON)");
  }
  std::vector<Case> cases = {{"tiny_gpt", {{0}}, 2}};
  if (gpus >= 2) {
    cases = {{"tiny_gpt", {{0}, {1}}, 2}, {"mlp", {{0, 1}}, 1}, {"tiny_gpt", {{0, 1}}, 2}};
  }
  for (const Case& c : cases) {
    int n = 0;
    for (const auto& stage : c.devices) n += static_cast<int>(stage.size());
    std::vector<c10::Device> placement;
    for (int d = 0; d < n; ++d) placement.emplace_back(c10::kCUDA, d);
    for (const Mode& mode : {Mode{"plain", false, false, {}}, Mode{"zero", true, false, {}},
                             Mode{"offload", false, true, {}},
                             Mode{"zero+offload", true, true, {}}}) {
      INFO(c.model << ", " << mode.name << ", " << c.devices.size() << " stage(s) over " << n
                   << " GPU(s), NCCL");
      FixtureIr f = BuildFixtureIr(c.model);
      REQUIRE(f.ir.ok());
      const v1::Deployment plan = MakePlan(*f.ir, c.devices, c.m, v1::SCHEDULE_1F1B, n);
      std::unique_ptr<PipelineEngine> cpu = MakeEngine(f, plan, comm::Backend::kFake, mode, {});
      std::unique_ptr<PipelineEngine> cuda =
          MakeEngine(f, plan, comm::Backend::kNccl, mode, placement);
      TrainAlike(f, *cpu, *cuda, false);
    }
  }
}

}  // namespace
}  // namespace rannc
