// The pipeline engine's gradients and optimizers against PyTorch: per-device optimizers and
// their state moved between engines, clipping, delayed gradient reduction, loss scaling, and
// zero_grad(set_to_none=False).
#include "daemon/runtime/pipeline_engine.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
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

using testing::kAtol;
using testing::kRtol;

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
