// Compares rannc's SGD, Adam, AdamW, RMSprop and Adagrad against LibTorch's torch::optim (C++
// ports of torch.optim's single-tensor algorithms) step by step; optimizer_kinds_test holds the
// kinds LibTorch lacks to torch.optim's own results. Tolerance: every element of every param within 1e-6
// relative of the reference (|ours - ref| <= 1e-6 * |ref|); since both run the same ATen ops in
// the same order, they are in practice bit-identical.
#include "daemon/optim/optimizer.h"

#include <torch/optim.h>

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

namespace rannc {
namespace {

constexpr double kRtol = 1e-6;

// Group 0 holds three params; group 1 holds two, the last of which never gets a grad.
// Param (0, 1) gets a grad on even steps only, so step counts differ between params.
const std::vector<std::vector<std::vector<int64_t>>> kShapes = {
    {{3, 4}, {5}, {2, 3, 2}},
    {{4, 4}, {6}},
};
constexpr int kSteps = 7;
constexpr int kLrChangeStep = 3;  // from this step on, each group's lr is halved

bool NeverHasGrad(size_t g, size_t i) { return g == 1 && i == 1; }
bool HasGradAt(size_t g, size_t i, int step) {
  if (NeverHasGrad(g, i)) return false;
  if (g == 0 && i == 1) return step % 2 == 0;
  return true;
}

std::vector<std::vector<at::Tensor>> MakeParams() {
  std::vector<std::vector<at::Tensor>> params;
  for (const auto& group : kShapes) {
    params.emplace_back();
    for (const auto& shape : group) {
      params.back().push_back(torch::randn(shape).requires_grad_(true));
    }
  }
  return params;
}

std::vector<std::vector<at::Tensor>> CloneParams(const std::vector<std::vector<at::Tensor>>& p) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& group : p) {
    out.emplace_back();
    for (const auto& t : group) out.back().push_back(t.detach().clone().requires_grad_(true));
  }
  return out;
}

std::unique_ptr<torch::optim::Optimizer> MakeReference(
    OptimizerKind kind, const std::vector<std::vector<at::Tensor>>& params,
    const std::vector<HyperParams>& hypers) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < params.size(); ++g) {
    const HyperParams& h = hypers[g];
    std::unique_ptr<torch::optim::OptimizerOptions> options;
    switch (kind) {
      case OptimizerKind::kSgd:
        options = std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(h.lr)
                                                                 .momentum(h.momentum)
                                                                 .dampening(h.dampening)
                                                                 .weight_decay(h.weight_decay)
                                                                 .nesterov(h.nesterov));
        break;
      case OptimizerKind::kAdam:
        options = std::make_unique<torch::optim::AdamOptions>(
            torch::optim::AdamOptions(h.lr)
                .betas(std::make_tuple(h.beta1, h.beta2))
                .eps(h.eps)
                .weight_decay(h.weight_decay)
                .amsgrad(h.amsgrad));
        break;
      case OptimizerKind::kAdamW:
        options = std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(h.lr)
                .betas(std::make_tuple(h.beta1, h.beta2))
                .eps(h.eps)
                .weight_decay(h.weight_decay)
                .amsgrad(h.amsgrad));
        break;
      case OptimizerKind::kRmsprop:
        options = std::make_unique<torch::optim::RMSpropOptions>(
            torch::optim::RMSpropOptions(h.lr)
                .alpha(h.alpha)
                .eps(h.eps)
                .weight_decay(h.weight_decay)
                .momentum(h.momentum)
                .centered(h.centered));
        break;
      case OptimizerKind::kAdagrad:
        options = std::make_unique<torch::optim::AdagradOptions>(
            torch::optim::AdagradOptions(h.lr)
                .lr_decay(h.lr_decay)
                .weight_decay(h.weight_decay)
                .initial_accumulator_value(h.initial_accumulator_value)
                .eps(h.eps));
        break;
      default:
        FAIL("torch::optim has no " << OptimizerKindName(kind));
    }
    groups.emplace_back(params[g], std::move(options));
  }
  switch (kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(1));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(std::move(groups));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(std::move(groups));
    case OptimizerKind::kRmsprop:
      return std::make_unique<torch::optim::RMSprop>(std::move(groups));
    case OptimizerKind::kAdagrad:
      // LibTorch (like PyTorch 1.13) fills every `sum` from the constructor's defaults.
      return std::make_unique<torch::optim::Adagrad>(
          std::move(groups), torch::optim::AdagradOptions().initial_accumulator_value(
                                 hypers[0].initial_accumulator_value));
    default:
      FAIL("torch::optim has no " << OptimizerKindName(kind));
  }
  return nullptr;
}

void SetReferenceLr(torch::optim::Optimizer& ref, OptimizerKind kind, size_t g, double lr) {
  auto& options = ref.param_groups()[g].options();
  switch (kind) {
    case OptimizerKind::kSgd:
      static_cast<torch::optim::SGDOptions&>(options).lr(lr);
      break;
    case OptimizerKind::kAdam:
      static_cast<torch::optim::AdamOptions&>(options).lr(lr);
      break;
    case OptimizerKind::kAdamW:
      static_cast<torch::optim::AdamWOptions&>(options).lr(lr);
      break;
    case OptimizerKind::kRmsprop:
      static_cast<torch::optim::RMSpropOptions&>(options).lr(lr);
      break;
    case OptimizerKind::kAdagrad:
      static_cast<torch::optim::AdagradOptions&>(options).lr(lr);
      break;
    default:
      FAIL("torch::optim has no " << OptimizerKindName(kind));
  }
}

// Largest |ours - ref| / |ref| over the elements (0 where both are equal, inf if ref is 0 and
// ours is not).
double MaxRelativeError(const at::Tensor& ours, const at::Tensor& ref) {
  at::Tensor diff = (ours.detach() - ref.detach()).abs();
  at::Tensor rel = diff / ref.detach().abs();
  rel.masked_fill_(diff == 0, 0);
  return rel.max().item<double>();
}

// Runs ours and the reference side by side over kSteps steps with the same grads. `maximize`
// is not in torch::optim's C++ options; maximizing with grad g is, in PyTorch, the same
// arithmetic as minimizing with grad -g, so the reference gets -g for maximize groups.
void CompareWithReference(OptimizerKind kind, std::vector<HyperParams> hypers) {
  torch::manual_seed(1234);
  auto ours_params = MakeParams();
  auto ref_params = CloneParams(ours_params);
  auto initial = CloneParams(ours_params);

  std::vector<ParamGroup> groups;
  for (size_t g = 0; g < ours_params.size(); ++g) groups.push_back({ours_params[g], hypers[g]});
  auto made = MakeOptimizer(kind, groups);
  REQUIRE(made.ok());
  std::unique_ptr<Optimizer> ours = std::move(made).value();
  CHECK(ours->kind() == kind);
  auto ref = MakeReference(kind, ref_params, hypers);

  for (int step = 0; step < kSteps; ++step) {
    if (step == kLrChangeStep) {
      for (size_t g = 0; g < hypers.size(); ++g) {
        hypers[g].lr *= 0.5;
        SetReferenceLr(*ref, kind, g, hypers[g].lr);
      }
    }
    for (size_t g = 0; g < ours_params.size(); ++g) {
      for (size_t i = 0; i < ours_params[g].size(); ++i) {
        if (!HasGradAt(g, i, step)) {
          ours_params[g][i].mutable_grad() = at::Tensor();
          ref_params[g][i].mutable_grad() = at::Tensor();
          continue;
        }
        at::Tensor grad = torch::randn(ours_params[g][i].sizes());
        ours_params[g][i].mutable_grad() = grad.clone();
        ref_params[g][i].mutable_grad() = hypers[g].maximize ? grad.neg() : grad.clone();
      }
    }
    REQUIRE(ours->Step(hypers).ok());
    ref->step();

    for (size_t g = 0; g < ours_params.size(); ++g) {
      for (size_t i = 0; i < ours_params[g].size(); ++i) {
        INFO("step " << step << ", group " << g << ", param " << i);
        if (NeverHasGrad(g, i)) {
          CHECK(ours_params[g][i].equal(initial[g][i]));
        } else {
          // Guards against a vacuous comparison: the param must have moved.
          CHECK_FALSE(ours_params[g][i].equal(initial[g][i]));
          CHECK(MaxRelativeError(ours_params[g][i], ref_params[g][i]) <= kRtol);
        }
      }
    }
  }

  // The param that never had a grad has no state, as in PyTorch (Adagrad's exists from
  // construction, and stays at step 0).
  std::map<std::string, at::Tensor> state;
  for (auto& [name, tensor] : ours->NamedState()) state[name] = tensor;
  for (const auto& [name, tensor] : state) {
    INFO(name);
    if (kind == OptimizerKind::kAdagrad) {
      if (name == "4.step") CHECK(tensor.item<double>() == 0);
    } else {
      CHECK(name.rfind("4.", 0) != 0);
    }
  }
  if (kind != OptimizerKind::kSgd) {
    // Param 1 had a grad on even steps only: 0, 2, 4, 6.
    REQUIRE(state.count("1.step"));
    CHECK(state["1.step"].item<double>() == 4);
    REQUIRE(state.count("0.step"));
    CHECK(state["0.step"].item<double>() == kSteps);
  }
}

HyperParams Sgd(double lr, double momentum = 0, double dampening = 0, double weight_decay = 0,
                bool nesterov = false, bool maximize = false) {
  HyperParams h;
  h.lr = lr;
  h.momentum = momentum;
  h.dampening = dampening;
  h.weight_decay = weight_decay;
  h.nesterov = nesterov;
  h.maximize = maximize;
  return h;
}

HyperParams AdamHyper(double lr, double weight_decay = 0, bool amsgrad = false,
                      bool maximize = false, double beta1 = 0.9, double beta2 = 0.999,
                      double eps = 1e-8) {
  HyperParams h;
  h.lr = lr;
  h.weight_decay = weight_decay;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  return h;
}

TEST_CASE("Sgd matches torch::optim::SGD", "[optim]") {
  SECTION("plain and momentum with dampening and weight decay") {
    CompareWithReference(OptimizerKind::kSgd, {Sgd(0.1), Sgd(0.05, 0.9, 0.1, 1e-2)});
  }
  SECTION("nesterov, and maximize with momentum") {
    CompareWithReference(OptimizerKind::kSgd, {Sgd(0.1, 0.9, 0, 1e-3, /*nesterov=*/true),
                                               Sgd(0.02, 0.5, 0, 0.1, false, /*maximize=*/true)});
  }
}

TEST_CASE("Adam matches torch::optim::Adam", "[optim]") {
  SECTION("defaults and amsgrad with weight decay and other betas") {
    CompareWithReference(
        OptimizerKind::kAdam,
        {AdamHyper(1e-2), AdamHyper(3e-2, 0.1, /*amsgrad=*/true, false, 0.8, 0.99, 1e-6)});
  }
  SECTION("maximize") {
    CompareWithReference(OptimizerKind::kAdam, {AdamHyper(1e-2, 1e-2, false, /*maximize=*/true),
                                                AdamHyper(1e-3, 0, true, /*maximize=*/true)});
  }
}

TEST_CASE("AdamW matches torch::optim::AdamW", "[optim]") {
  SECTION("decoupled weight decay and amsgrad") {
    CompareWithReference(OptimizerKind::kAdamW,
                         {AdamHyper(1e-2, 1e-2), AdamHyper(3e-3, 0.1, /*amsgrad=*/true)});
  }
  SECTION("maximize and no weight decay") {
    CompareWithReference(OptimizerKind::kAdamW, {AdamHyper(1e-2, 0.05, false, /*maximize=*/true),
                                                 AdamHyper(1e-2, 0, true, false, 0.5, 0.9, 1e-3)});
  }
}

HyperParams RmspropHyper(double lr, double alpha = 0.99, double eps = 1e-8,
                         double weight_decay = 0, double momentum = 0, bool centered = false,
                         bool maximize = false) {
  HyperParams h = DefaultHyperParams(OptimizerKind::kRmsprop);
  h.lr = lr;
  h.alpha = alpha;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.momentum = momentum;
  h.centered = centered;
  h.maximize = maximize;
  return h;
}

HyperParams AdagradHyper(double lr, double lr_decay = 0, double weight_decay = 0,
                         double initial_accumulator_value = 0, double eps = 1e-10,
                         bool maximize = false) {
  HyperParams h = DefaultHyperParams(OptimizerKind::kAdagrad);
  h.lr = lr;
  h.lr_decay = lr_decay;
  h.weight_decay = weight_decay;
  h.initial_accumulator_value = initial_accumulator_value;
  h.eps = eps;
  h.maximize = maximize;
  return h;
}

// LibTorch's RMSprop and Adagrad, as a second reference beside optimizer_kinds_test's golden
// results from torch.optim (which also compare the state).
TEST_CASE("RMSprop matches torch::optim::RMSprop", "[optim]") {
  SECTION("plain, and centered with momentum, weight decay and other alpha and eps") {
    CompareWithReference(OptimizerKind::kRmsprop,
                         {RmspropHyper(1e-2), RmspropHyper(5e-3, 0.9, 1e-6, 0.1, 0.9, true)});
  }
  SECTION("maximize with momentum, and centered") {
    CompareWithReference(OptimizerKind::kRmsprop,
                         {RmspropHyper(1e-2, 0.99, 1e-8, 0, 0.8, false, /*maximize=*/true),
                          RmspropHyper(2e-2, 0.95, 1e-8, 0.01, 0, true, /*maximize=*/true)});
  }
}

TEST_CASE("Adagrad matches torch::optim::Adagrad", "[optim]") {
  SECTION("lr decay, weight decay, accumulator start and eps") {
    CompareWithReference(OptimizerKind::kAdagrad,
                         {AdagradHyper(0.1, 0.1, 0, 0.5), AdagradHyper(0.05, 0, 0.1, 0.5, 1e-6)});
  }
  SECTION("maximize") {
    CompareWithReference(OptimizerKind::kAdagrad,
                         {AdagradHyper(0.01, 0, 0, 0, 1e-10, /*maximize=*/true),
                          AdagradHyper(0.02, 0.01, 0.05, 0, 1e-10, /*maximize=*/true)});
  }
}

TEST_CASE("Adagrad with sparse grads matches torch::optim::Adagrad", "[optim]") {
  // Embedding-style grads: rows of a [6, 3] param, uncoalesced (rows repeat).
  torch::manual_seed(99);
  at::Tensor ours_param = torch::randn({6, 3}).requires_grad_(true);
  at::Tensor ref_param = ours_param.detach().clone().requires_grad_(true);
  for (bool maximize : {false, true}) {
    HyperParams h = AdagradHyper(0.1, 0.05, 0, 0, 1e-8, maximize);
    auto ours = MakeOptimizer(OptimizerKind::kAdagrad, {{{ours_param}, h}});
    REQUIRE(ours.ok());
    torch::optim::Adagrad ref({ref_param}, torch::optim::AdagradOptions(0.1).lr_decay(0.05).eps(1e-8));
    for (int step = 0; step < 8; ++step) {
      const int64_t nnz = 1 + step % 4;
      at::Tensor indices = torch::randint(0, 6, {1, nnz}, at::kLong);
      at::Tensor values = torch::randn({nnz, 3});
      at::Tensor grad = torch::sparse_coo_tensor(indices, values, {6, 3});
      ours_param.mutable_grad() = grad;
      ref_param.mutable_grad() = maximize ? -grad : grad;
      REQUIRE((*ours)->Step({h}).ok());
      ref.step();
      INFO("maximize " << maximize << ", step " << step);
      CHECK(MaxRelativeError(ours_param, ref_param) <= kRtol);
    }
  }
}

TEST_CASE("Adam and AdamW differ when weight decay is set", "[optim]") {
  // Guards the comparison above against a mix-up of the two decay rules.
  auto run = [](OptimizerKind kind) {
    torch::manual_seed(7);
    at::Tensor p = torch::randn({8}).requires_grad_(true);
    p.mutable_grad() = torch::randn({8});
    auto opt = MakeOptimizer(kind, {{{p}, AdamHyper(0.1, 0.5)}});
    REQUIRE(opt.ok());
    REQUIRE((*opt)->Step({AdamHyper(0.1, 0.5)}).ok());
    return p.detach().clone();
  };
  CHECK_FALSE(run(OptimizerKind::kAdam).equal(run(OptimizerKind::kAdamW)));
}

TEST_CASE("StateBytes counts the state tensors held", "[optim]") {
  at::Tensor a = torch::zeros({10}).requires_grad_(true);  // float32: 40 bytes
  at::Tensor b = torch::zeros({5}).requires_grad_(true);   // no grad: no state
  a.mutable_grad() = torch::ones({10});
  auto check = [&](OptimizerKind kind, HyperParams h, int64_t expected) {
    auto opt = MakeOptimizer(kind, {{{a, b}, h}});
    REQUIRE(opt.ok());
    CHECK((*opt)->StateBytes() == 0);
    REQUIRE((*opt)->Step({h}).ok());
    CHECK((*opt)->StateBytes() == expected);
  };
  check(OptimizerKind::kSgd, Sgd(0.1), 0);
  check(OptimizerKind::kSgd, Sgd(0.1, 0.9), 40);
  check(OptimizerKind::kAdam, AdamHyper(0.1), 80);
  check(OptimizerKind::kAdamW, AdamHyper(0.1, 0, /*amsgrad=*/true), 120);
}

// Returns the error message if `status` has `code`, else a marker that fails the caller's check.
std::string MessageIf(const absl::Status& status, absl::StatusCode code) {
  if (status.code() != code) return "<wrong code: " + status.ToString() + ">";
  return std::string(status.message());
}

TEST_CASE("ValidateHyperParams applies PyTorch's checks", "[optim]") {
  using K = OptimizerKind;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  CHECK(ValidateHyperParams(K::kSgd, Sgd(0.1, 0.9, 0, 0, true)).ok());
  CHECK(ValidateHyperParams(K::kAdam, AdamHyper(0)).ok());

  CHECK_THAT(MessageIf(ValidateHyperParams(K::kSgd, Sgd(-1)), kInvalid),
             Catch::Contains("lr") && Catch::Contains("-1"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kAdamW, AdamHyper(std::nan(""))), kInvalid),
             Catch::Contains("lr") && Catch::Contains("nan"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kSgd, Sgd(0.1, -0.5)), kInvalid),
             Catch::Contains("momentum") && Catch::Contains("-0.5"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kSgd, Sgd(0.1, 0, 0, -0.25)), kInvalid),
             Catch::Contains("weight_decay") && Catch::Contains("-0.25"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kAdam, AdamHyper(0.1, -0.25)), kInvalid),
             Catch::Contains("weight_decay") && Catch::Contains("-0.25"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kSgd, Sgd(0.1, 0, 0, 0, true)), kInvalid),
             Catch::Contains("nesterov") && Catch::Contains("momentum: 0"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kSgd, Sgd(0.1, 0.9, 0.1, 0, true)), kInvalid),
             Catch::Contains("nesterov") && Catch::Contains("dampening: 0.1"));
  CHECK_THAT(
      MessageIf(ValidateHyperParams(K::kAdam, AdamHyper(0.1, 0, false, false, 1.0)), kInvalid),
      Catch::Contains("beta1") && Catch::Contains("1"));
  CHECK_THAT(MessageIf(ValidateHyperParams(K::kAdamW, AdamHyper(0.1, 0, false, false, 0.9, -0.1)),
                       kInvalid),
             Catch::Contains("beta2") && Catch::Contains("-0.1"));
  CHECK_THAT(
      MessageIf(ValidateHyperParams(K::kAdam, AdamHyper(0.1, 0, false, false, 0.9, 0.999, -1e-8)),
                kInvalid),
      Catch::Contains("eps") && Catch::Contains("-1e-08"));
  // Fields a kind does not use are not checked (PyTorch's Adam has no momentum).
  CHECK(ValidateHyperParams(K::kAdam, Sgd(0.1, -1)).ok());
}

TEST_CASE("MakeOptimizer rejects what PyTorch rejects", "[optim]") {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  at::Tensor leaf = torch::randn({3}).requires_grad_(true);
  at::Tensor non_leaf = leaf * 2;
  CHECK_THAT(
      MessageIf(MakeOptimizer(OptimizerKind::kSgd, {{{leaf}, Sgd(-0.1)}}).status(), kInvalid),
      Catch::Contains("group 0") && Catch::Contains("lr"));
  CHECK_THAT(MessageIf(MakeOptimizer(OptimizerKind::kAdam,
                                     {{{leaf}, AdamHyper(0.1)}, {{non_leaf}, AdamHyper(0.1)}})
                           .status(),
                       kInvalid),
             Catch::Contains("group 1, param 0") && Catch::Contains("non-leaf"));
  CHECK_THAT(
      MessageIf(
          MakeOptimizer(OptimizerKind::kSgd, {{{leaf}, Sgd(0.1)}, {{leaf}, Sgd(0.1)}}).status(),
          kInvalid),
      Catch::Contains("more than once"));
  CHECK_THAT(MessageIf(MakeOptimizer(OptimizerKind::kSgd, {{{at::Tensor()}, Sgd(0.1)}}).status(),
                       kInvalid),
             Catch::Contains("undefined"));
  // Empty groups are allowed: a pipeline stage may hold none of a group's params.
  CHECK(
      MakeOptimizer(OptimizerKind::kAdamW, {{{}, AdamHyper(0.1)}, {{leaf}, AdamHyper(0.1)}}).ok());
}

TEST_CASE("Step rejects bad arguments without changing anything", "[optim]") {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  at::Tensor a = torch::randn({4}).requires_grad_(true);
  at::Tensor b = torch::randn({2, 2}).requires_grad_(true);
  at::Tensor a0 = a.detach().clone();
  a.mutable_grad() = torch::ones({4});
  auto made = MakeOptimizer(OptimizerKind::kAdam, {{{a}, AdamHyper(0.1)}, {{b}, AdamHyper(0.1)}});
  REQUIRE(made.ok());
  Optimizer& opt = **made;

  CHECK_THAT(MessageIf(opt.Step({AdamHyper(0.1)}), kInvalid),
             Catch::Contains("1 sets") && Catch::Contains("2 param groups"));
  CHECK_THAT(MessageIf(opt.Step({AdamHyper(0.1), AdamHyper(0.1, 0, false, false, 2.0)}), kInvalid),
             Catch::Contains("param group 1") && Catch::Contains("beta1"));
  b.mutable_grad() = torch::ones({4});  // wrong shape: autograd never makes this, a bug might
  CHECK_THAT(MessageIf(opt.Step({AdamHyper(0.1), AdamHyper(0.1)}), kInvalid),
             Catch::Contains("param group 1, param 0") && Catch::Contains("[4]") &&
                 Catch::Contains("[2, 2]"));
  CHECK(a.equal(a0));
  CHECK(opt.StateBytes() == 0);

  b.mutable_grad() = at::Tensor();
  CHECK(opt.Step({AdamHyper(0.1), AdamHyper(0.1)}).ok());
  CHECK_FALSE(a.equal(a0));
}

TEST_CASE("LoadNamedState continues from saved state exactly", "[optim]") {
  // Two steps on one optimizer equal one step, save, load into a fresh optimizer over copies of
  // the params, and one step there (what a job's undeploy and redeploy do).
  for (auto [kind, hyper] : {std::pair{OptimizerKind::kSgd, Sgd(0.1, 0.9)},
                             std::pair{OptimizerKind::kAdamW, AdamHyper(0.1, 0.01, true)}}) {
    torch::manual_seed(3);
    at::Tensor a = torch::randn({4}).requires_grad_(true);
    at::Tensor b = torch::randn({2, 3}).requires_grad_(true);
    at::Tensor g1a = torch::randn({4}), g1b = torch::randn({2, 3});
    at::Tensor g2a = torch::randn({4}), g2b = torch::randn({2, 3});
    at::Tensor ra = a.detach().clone().requires_grad_(true);
    at::Tensor rb = b.detach().clone().requires_grad_(true);
    auto ref = MakeOptimizer(kind, {{{ra}, hyper}, {{rb}, hyper}});
    auto first = MakeOptimizer(kind, {{{a}, hyper}, {{b}, hyper}});
    REQUIRE(ref.ok());
    REQUIRE(first.ok());
    ra.mutable_grad() = g1a; rb.mutable_grad() = g1b;
    a.mutable_grad() = g1a; b.mutable_grad() = g1b;
    REQUIRE((*ref)->Step({hyper, hyper}).ok());
    REQUIRE((*first)->Step({hyper, hyper}).ok());
    auto saved = (*first)->NamedState();
    for (auto& [name, t] : saved) t = t.clone();
    at::Tensor a2 = a.detach().clone().requires_grad_(true);
    at::Tensor b2 = b.detach().clone().requires_grad_(true);
    auto second = MakeOptimizer(kind, {{{a2}, hyper}, {{b2}, hyper}});
    REQUIRE(second.ok());
    REQUIRE((*second)->LoadNamedState(saved).ok());
    CHECK((*second)->StateBytes() == (*first)->StateBytes());
    ra.mutable_grad() = g2a; rb.mutable_grad() = g2b;
    a2.mutable_grad() = g2a; b2.mutable_grad() = g2b;
    REQUIRE((*ref)->Step({hyper, hyper}).ok());
    REQUIRE((*second)->Step({hyper, hyper}).ok());
    CHECK(a2.equal(ra));
    CHECK(b2.equal(rb));
  }
}

TEST_CASE("LoadNamedState rejects bad entries and changes nothing", "[optim]") {
  at::Tensor a = torch::randn({4}).requires_grad_(true);
  auto opt = MakeOptimizer(OptimizerKind::kAdam, {{{a}, AdamHyper(0.1)}});
  REQUIRE(opt.ok());
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  CHECK_THAT(MessageIf((*opt)->LoadNamedState({{"0.momentum_buffer", torch::zeros({4})}}),
                       kInvalid),
             Catch::Contains("unknown optimizer state key"));
  CHECK_THAT(MessageIf((*opt)->LoadNamedState({{"1.exp_avg", torch::zeros({4})}}), kInvalid),
             Catch::Contains("param 1"));
  CHECK_THAT(MessageIf((*opt)->LoadNamedState({{"0.exp_avg", torch::zeros({3})}}), kInvalid),
             Catch::Contains("[3]") && Catch::Contains("[4]"));
  CHECK_THAT(MessageIf((*opt)->LoadNamedState({{"x.exp_avg", torch::zeros({4})}}), kInvalid),
             Catch::Contains("<param index>.<key>"));
  CHECK((*opt)->StateBytes() == 0);
}

}  // namespace
}  // namespace rannc
