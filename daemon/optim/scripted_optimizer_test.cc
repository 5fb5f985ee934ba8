// The scripted path (OptimizerKind::kScripted): Lion written as a TorchScript module, as
// pyrannc sends one, against Lion written here with LibTorch ops (the algorithm of Chen et al.,
// "Symbolic Discovery of Optimization Algorithms", 2023, as lucidrains/lion-pytorch writes it).
// Both run the same ops in the same order, so the results must be equal to fp32 round-off
// (|ours - reference| <= 1e-7 + 1e-6 |reference|); the Python suite checks the same against a
// plain-PyTorch Lion through ranncd.
#include <ATen/ATen.h>
#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "daemon/optim/optimizer.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <catch2/catch.hpp>

namespace rannc {
namespace {

// torch.jit.save's bytes of a module whose forward is `forward_source` (a def of forward).
std::string SavedModule(const std::string& forward_source) {
  torch::jit::Module module("Update");
  module.define(forward_source);
  std::ostringstream out;
  module.save(out);
  return out.str();
}

const char* const kLion = R"(
def forward(self, param: Tensor, grad: Tensor, state: Dict[str, Tensor],
            group: Dict[str, float]) -> None:
    exp_avg = state["exp_avg"]
    beta1 = group["betas_0"]
    beta2 = group["betas_1"]
    param.mul_(1.0 - group["lr"] * group["weight_decay"])
    update = exp_avg.mul(beta1).add(grad, alpha=1.0 - beta1).sign_()
    param.add_(update, alpha=-group["lr"])
    exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
)";

std::shared_ptr<const ScriptedUpdate> Lion(std::vector<std::string> keys = {"exp_avg"}) {
  auto update = std::make_shared<ScriptedUpdate>();
  update->name = "Lion";
  update->module = SavedModule(kLion);
  update->state_keys = std::move(keys);
  return update;
}

HyperParams LionHyper(double lr, double weight_decay) {
  HyperParams h;
  h.named = {{"lr", lr}, {"weight_decay", weight_decay}, {"betas_0", 0.9}, {"betas_1", 0.99}};
  return h;
}

void ReferenceLion(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                   const HyperParams& h) {
  const double lr = h.named.at("lr"), beta1 = h.named.at("betas_0"),
               beta2 = h.named.at("betas_1");
  param.mul_(1.0 - lr * h.named.at("weight_decay"));
  at::Tensor update = exp_avg.mul(beta1).add(grad, 1.0 - beta1).sign_();
  param.add_(update, -lr);
  exp_avg.mul_(beta2).add_(grad, 1.0 - beta2);
}

void RequireClose(const at::Tensor& ours, const at::Tensor& reference) {
  INFO("max |diff| " << (ours - reference).abs().max().item<double>());
  REQUIRE(ours.sizes() == reference.sizes());
  REQUIRE(at::allclose(ours, reference, /*rtol=*/1e-6, /*atol=*/1e-7));
}

at::Tensor Leaf(at::IntArrayRef shape, int seed) {
  at::manual_seed(seed);
  return at::randn(shape).set_requires_grad(true);
}

TEST_CASE("a scripted Lion steps as Lion, per group, skipping params without a grad") {
  std::vector<at::Tensor> params = {Leaf({4, 3}, 1), Leaf({5}, 2), Leaf({2, 2}, 3)};
  std::vector<at::Tensor> reference, exp_avg;
  for (const at::Tensor& p : params) {
    reference.push_back(p.detach().clone());
    exp_avg.push_back(at::zeros_like(p));
  }
  std::vector<HyperParams> hypers = {LionHyper(1e-2, 0.1), LionHyper(3e-3, 0.0)};
  std::vector<ParamGroup> groups = {{{params[0], params[1]}, hypers[0]}, {{params[2]}, hypers[1]}};
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      MakeOptimizer(OptimizerKind::kScripted, groups, Lion());
  REQUIRE(opt.ok());
  REQUIRE((*opt)->kind() == OptimizerKind::kScripted);
  for (int step = 1; step <= 6; ++step) {
    if (step == 4) hypers[0].named["lr"] = 5e-3;  // a schedule
    at::manual_seed(100 + step);
    for (size_t i = 0; i < params.size(); ++i) {
      const bool skipped = i == 1 && step % 3 == 0;  // grad None on some steps
      params[i].mutable_grad() = skipped ? at::Tensor() : at::randn(params[i].sizes());
      if (skipped) continue;
      at::NoGradGuard no_grad;
      ReferenceLion(reference[i], params[i].grad(), exp_avg[i], hypers[i < 2 ? 0 : 1]);
    }
    REQUIRE((*opt)->Step(hypers).ok());
    for (size_t i = 0; i < params.size(); ++i) RequireClose(params[i].detach(), reference[i]);
  }
  std::vector<std::pair<std::string, at::Tensor>> state = (*opt)->NamedState();
  REQUIRE(state.size() == 3);  // no "step": Lion does not list it
  REQUIRE(state[0].first == "0.exp_avg");
  REQUIRE(state[2].first == "2.exp_avg");
  for (size_t i = 0; i < params.size(); ++i) RequireClose(state[i].second, exp_avg[i]);
  REQUIRE((*opt)->StateBytes() == (12 + 5 + 4) * 4);
}

TEST_CASE("a scripted optimizer's state reloads, and continues exactly") {
  std::vector<at::Tensor> params = {Leaf({6}, 4)};
  const std::vector<HyperParams> hypers = {LionHyper(1e-2, 0.01)};
  auto first = MakeOptimizer(OptimizerKind::kScripted, {{params, hypers[0]}},
                             Lion({"step", "exp_avg"}));
  REQUIRE(first.ok());
  for (int step = 0; step < 3; ++step) {
    params[0].mutable_grad() = at::randn({6});
    REQUIRE((*first)->Step(hypers).ok());
  }
  std::vector<std::pair<std::string, at::Tensor>> state = (*first)->NamedState();
  REQUIRE(state.size() == 2);
  REQUIRE(state[0].first == "0.step");
  REQUIRE(state[0].second.item<double>() == 3);
  REQUIRE(state[1].first == "0.exp_avg");

  at::Tensor copy = params[0].detach().clone().set_requires_grad(true);
  auto second = MakeOptimizer(OptimizerKind::kScripted, {{{copy}, hypers[0]}},
                              Lion({"step", "exp_avg"}));
  REQUIRE(second.ok());
  REQUIRE((*second)->LoadNamedState(state).ok());
  at::Tensor grad = at::randn({6});
  params[0].mutable_grad() = grad;
  copy.mutable_grad() = grad.clone();
  REQUIRE((*first)->Step(hypers).ok());
  REQUIRE((*second)->Step(hypers).ok());
  RequireClose(copy.detach(), params[0].detach());
  REQUIRE((*second)->NamedState()[0].second.item<double>() == 4);

  // A state without the listed "step" is incomplete, as for torch.optim's kinds.
  absl::Status partial = (*second)->LoadNamedState({state[1]});
  REQUIRE(partial.code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(std::string(partial.message()).find("lacks step") != std::string::npos);
}

TEST_CASE("a scripted update may replace its state entries, and sees the step") {
  auto update = std::make_shared<ScriptedUpdate>();
  update->name = "Counting";
  update->module = SavedModule(R"(
def forward(self, param: Tensor, grad: Tensor, state: Dict[str, Tensor],
            group: Dict[str, float]) -> None:
    state["total"] = state["total"] + grad
    param.sub_(state["total"] * group["lr"] / state["step"])
)");
  update->state_keys = {"step", "total"};
  at::Tensor param = at::ones({3}).set_requires_grad(true);
  HyperParams h;
  h.named = {{"lr", 0.5}};
  auto opt = MakeOptimizer(OptimizerKind::kScripted, {{{param}, h}}, update);
  REQUIRE(opt.ok());
  param.mutable_grad() = at::full({3}, 2.0);
  REQUIRE((*opt)->Step({h}).ok());  // total 2, param 1 - 2 * 0.5 / 1 = 0
  REQUIRE((*opt)->Step({h}).ok());  // total 4, param 0 - 4 * 0.5 / 2 = -1
  RequireClose(param.detach(), at::full({3}, -1.0));
  RequireClose((*opt)->NamedState()[1].second, at::full({3}, 4.0));
}

TEST_CASE("a scripted optimizer's errors name the optimizer and what is wrong") {
  at::Tensor param = at::ones({3}).set_requires_grad(true);
  const HyperParams h = LionHyper(1e-2, 0);

  SECTION("no update") {
    auto opt = MakeOptimizer(OptimizerKind::kScripted, {{{param}, h}});
    REQUIRE(opt.status().code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("bytes that are not a module") {
    auto update = std::make_shared<ScriptedUpdate>(*Lion());
    update->module = "not a zip";
    absl::Status s = ValidateScriptedUpdate(*update);
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(std::string(s.message()).find("optimizer Lion") != std::string::npos);
  }
  SECTION("a forward of another signature") {
    auto update = std::make_shared<ScriptedUpdate>(*Lion());
    update->module = SavedModule(R"(
def forward(self, param: Tensor, grad: Tensor) -> None:
    param.sub_(grad)
)");
    absl::Status s = ValidateScriptedUpdate(*update);
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(std::string(s.message()).find("expected forward(param: Tensor") !=
            std::string::npos);
  }
  SECTION("state keys that checkpoints would misread, or listed twice") {
    REQUIRE(ValidateScriptedUpdate(*Lion({"eta"})).code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(ValidateScriptedUpdate(*Lion({"exp_avg", "exp_avg"})).code() ==
            absl::StatusCode::kInvalidArgument);
    REQUIRE(ValidateScriptedUpdate(*Lion({"a.b"})).code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("a group without an entry the update reads") {
    auto opt = MakeOptimizer(OptimizerKind::kScripted, {{{param}, h}}, Lion());
    REQUIRE(opt.ok());
    param.mutable_grad() = at::ones({3});
    HyperParams missing = h;
    missing.named.erase("betas_1");
    absl::Status s = (*opt)->Step({missing});
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    INFO(s.message());
    REQUIRE(std::string(s.message()).find("betas_1") != std::string::npos);
  }
}

}  // namespace
}  // namespace rannc
