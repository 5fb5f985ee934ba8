// Adam and AdamW through the fused kernels (adam.h): on CUDA parameters, and on pinned host
// parameters (an offloaded job's masters; PyTorch's CPU kernel, LibTorch 2.4+), each against the
// same optimizer on plain CPU copies (the single-tensor algorithm, itself held to torch.optim by
// optimizer_test): same grads, several steps, params that skip steps, amsgrad, maximize, weight
// decay, and a state reload half-way. Needs a CUDA LibTorch 2.4+ and a GPU (tag gpu; fails, not
// skips, without).
// Tolerance: every element within 1e-5 relative + 1e-6 absolute of the CPU result; the fused
// kernel computes the same formulas in another order, so they differ by fp32 round-off only.
#include "daemon/optim/optimizer.h"

#include <torch/version.h>

#include "daemon/optim/adam.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

namespace rannc {
namespace {

const std::vector<std::vector<int64_t>> kShapes = {{64, 32}, {32}, {7, 3, 5}, {1000}};
constexpr int kSteps = 6;
constexpr int kReloadAt = 3;  // after this step, both optimizers reload their own state

bool HasGradAt(size_t i, int step) { return i != 1 || step % 2 == 0; }  // param 1 skips steps

// `pinned`: in page-locked host memory (device must be the CPU).
std::vector<at::Tensor> Leaves(const std::vector<at::Tensor>& values, at::Device device,
                               bool pinned = false) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& v : values) {
    at::Tensor t = v.detach().to(device, v.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    if (pinned) t = t.pin_memory();
    out.push_back(t.requires_grad_(true));
  }
  return out;
}

std::unique_ptr<Optimizer> Make(OptimizerKind kind, const std::vector<at::Tensor>& params,
                                const HyperParams& hyper) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = MakeOptimizer(kind, {{params, hyper}});
  INFO(opt.status().ToString());
  REQUIRE(opt.ok());
  return std::move(*opt);
}

void Reload(Optimizer& opt) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (auto& [name, t] : opt.NamedState()) state.emplace_back(name, t.clone());
  REQUIRE(opt.LoadNamedState(state).ok());
}

// The fused side's parameters: on the GPU, or pinned on the host.
void CompareFused(bool pinned_host) {
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(at::hasCUDA());
  const at::Device fused_on = pinned_host ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0);
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (bool amsgrad : {false, true}) {
      for (bool maximize : {false, true}) {
        INFO(OptimizerKindName(kind) << " amsgrad " << amsgrad << " maximize " << maximize);
        at::manual_seed(7);
        std::vector<at::Tensor> init;
        for (const auto& shape : kShapes) init.push_back(at::randn(shape));
        HyperParams hyper;
        hyper.lr = 1e-2;
        hyper.beta1 = 0.9;
        hyper.beta2 = 0.95;
        hyper.eps = 1e-8;
        hyper.weight_decay = 0.1;
        hyper.amsgrad = amsgrad;
        hyper.maximize = maximize;
        std::vector<at::Tensor> on_fused = Leaves(init, fused_on, pinned_host);
        std::vector<at::Tensor> on_cpu = Leaves(init, at::kCPU);
        std::unique_ptr<Optimizer> fused = Make(kind, on_fused, hyper);
        std::unique_ptr<Optimizer> cpu = Make(kind, on_cpu, hyper);
        for (int step = 0; step < kSteps; ++step) {
          for (size_t i = 0; i < init.size(); ++i) {
            if (!HasGradAt(i, step)) {
              on_fused[i].mutable_grad() = at::Tensor();
              on_cpu[i].mutable_grad() = at::Tensor();
              continue;
            }
            at::Tensor grad = at::randn(kShapes[i]);
            on_fused[i].mutable_grad() = grad.to(fused_on, /*non_blocking=*/false, /*copy=*/true);
            on_cpu[i].mutable_grad() = grad.clone();
          }
          for (size_t i = 0; i < init.size(); ++i) {
            if (on_fused[i].grad().defined()) REQUIRE(Adam::Fused(on_fused[i]));
            if (on_cpu[i].grad().defined()) REQUIRE_FALSE(Adam::Fused(on_cpu[i]));
          }
          REQUIRE(fused->Step({hyper}).ok());
          REQUIRE(cpu->Step({hyper}).ok());
          if (step == kReloadAt) {
            Reload(*fused);
            Reload(*cpu);
          }
          for (size_t i = 0; i < init.size(); ++i) {
            INFO("step " << step << " param " << i);
            CHECK(at::allclose(on_fused[i].detach().cpu(), on_cpu[i].detach(), 1e-5, 1e-6));
          }
        }
        const auto fused_state = fused->NamedState();
        const auto cpu_state = cpu->NamedState();
        REQUIRE(fused_state.size() == cpu_state.size());
        for (size_t k = 0; k < fused_state.size(); ++k) {
          INFO(fused_state[k].first);
          CHECK(fused_state[k].first == cpu_state[k].first);
          CHECK(at::allclose(fused_state[k].second.cpu(), cpu_state[k].second, 1e-5, 1e-6));
        }
        CHECK(fused->StateBytes() == cpu->StateBytes());
      }
    }
  }
}

TEST_CASE("Adam and AdamW on CUDA (fused) equal the CPU's single-tensor steps", "[gpu]") {
  CompareFused(/*pinned_host=*/false);
}

TEST_CASE("Adam and AdamW on pinned host masters (fused CPU kernel) equal the single-tensor steps",
          "[gpu]") {
  INFO("PyTorch's fused CPU Adam kernels are in LibTorch 2.4 and later");
  REQUIRE((TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)));
  CompareFused(/*pinned_host=*/true);
}

}  // namespace
}  // namespace rannc
