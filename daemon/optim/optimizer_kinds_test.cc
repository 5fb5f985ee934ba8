// Holds RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD and Rprop to what torch.optim
// (PyTorch 1.13) itself computed: testdata/optimizer_golden.pt, written by
// tools/gen_optimizer_golden.py, which describes its contents. Every config there runs here
// from the same initial params, grads and per-step hyper-parameters (two param groups, params
// without a grad on some steps, hyper-parameters changed part-way), and after every step every
// param and every state tensor of NamedState must match, with the same keys.
//
// Tolerance: |ours - torch| <= kAtol + kRtol * |torch| for every element (kRtol 1e-6, kAtol
// 1e-7, fp32 values). Both run the same LibTorch ops in the same order, so in practice they are
// bit-identical; the tolerance leaves room for another LibTorch build's kernels.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "daemon/optim/optimizer.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <catch2/catch.hpp>

namespace rannc {
namespace {

constexpr double kRtol = 1e-6;
constexpr double kAtol = 1e-7;
constexpr int kReloadAfter = 7;  // the reload run saves and reloads the state after this step

const std::vector<OptimizerKind> kKinds = {
    OptimizerKind::kRmsprop, OptimizerKind::kAdagrad, OptimizerKind::kAdamax,
    OptimizerKind::kNAdam,   OptimizerKind::kRAdam,   OptimizerKind::kAdadelta,
    OptimizerKind::kAsgd,    OptimizerKind::kRprop,
};

using Golden = std::map<std::string, at::Tensor>;

std::string GoldenPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir != nullptr ? srcdir : ".") + "/" +
         (workspace != nullptr ? workspace : "rannc") +
         "/daemon/optim/testdata/optimizer_golden.pt";
}

const Golden& LoadGolden() {
  static const Golden* const golden = [] {
    auto* g = new Golden;
    std::ifstream in(GoldenPath(), std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    if (bytes.empty()) return g;
    for (const auto& entry : torch::jit::pickle_load(bytes).toGenericDict()) {
      (*g)[entry.key().toStringRef()] = entry.value().toTensor();
    }
    return g;
  }();
  INFO("golden file " << GoldenPath());
  REQUIRE_FALSE(golden->empty());
  return *golden;
}

bool Has(const std::string& key) { return LoadGolden().count(key) != 0; }

const at::Tensor& At(const std::string& key) {
  const Golden& golden = LoadGolden();
  auto it = golden.find(key);
  INFO("golden key " << key);
  REQUIRE(it != golden.end());
  return it->second;
}

// The golden keys under `prefix`, without it.
std::vector<std::string> KeysUnder(const std::string& prefix) {
  std::vector<std::string> keys;
  const Golden& golden = LoadGolden();
  for (auto it = golden.lower_bound(prefix);
       it != golden.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    keys.push_back(it->first.substr(prefix.size()));
  }
  return keys;
}

// The configs the golden file has for `kind`.
std::vector<std::string> ConfigsOf(OptimizerKind kind) {
  std::vector<std::string> configs;
  const std::string suffix = "/group_sizes";
  for (const std::string& key : KeysUnder(std::string(OptimizerKindName(kind)) + "/")) {
    if (key.size() > suffix.size() &&
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0) {
      configs.push_back(key.substr(0, key.size() - suffix.size()));
    }
  }
  return configs;
}

// The HyperParams fields behind torch.optim's param-group field `name`: one real, two for a
// pair (betas, etas, step_sizes), or one flag. None for a name this test does not know.
struct FieldRefs {
  std::vector<double*> reals;
  bool* flag = nullptr;
};

FieldRefs Fields(HyperParams& h, const std::string& name) {
  if (name == "lr") return {{&h.lr}};
  if (name == "weight_decay") return {{&h.weight_decay}};
  if (name == "momentum") return {{&h.momentum}};
  if (name == "dampening") return {{&h.dampening}};
  if (name == "betas") return {{&h.beta1, &h.beta2}};
  if (name == "eps") return {{&h.eps}};
  if (name == "alpha") return {{&h.alpha}};
  if (name == "lr_decay") return {{&h.lr_decay}};
  if (name == "initial_accumulator_value") return {{&h.initial_accumulator_value}};
  if (name == "momentum_decay") return {{&h.momentum_decay}};
  if (name == "rho") return {{&h.rho}};
  if (name == "lambd") return {{&h.lambd}};
  if (name == "t0") return {{&h.t0}};
  if (name == "etas") return {{&h.etaminus, &h.etaplus}};
  if (name == "step_sizes") return {{&h.step_size_min, &h.step_size_max}};
  if (name == "nesterov") return {{}, &h.nesterov};
  if (name == "amsgrad") return {{}, &h.amsgrad};
  if (name == "centered") return {{}, &h.centered};
  if (name == "decoupled_weight_decay") return {{}, &h.decoupled_weight_decay};
  if (name == "maximize") return {{}, &h.maximize};
  return {};
}

// Sets the field `name` of `h` from `value` (float64: a scalar, or [2] for a pair).
void SetField(HyperParams& h, const std::string& name, const at::Tensor& value) {
  FieldRefs refs = Fields(h, name);
  INFO("hyper field " << name);
  REQUIRE((refs.flag != nullptr || !refs.reals.empty()));
  const at::Tensor flat = value.reshape({-1});
  if (refs.flag != nullptr) {
    *refs.flag = flat[0].item<double>() != 0;
    return;
  }
  REQUIRE(flat.numel() == static_cast<int64_t>(refs.reals.size()));
  for (size_t i = 0; i < refs.reals.size(); ++i) {
    *refs.reals[i] = flat[static_cast<int64_t>(i)].item<double>();
  }
}

// Group g's hyper-parameters at `step`: every field torch.optim's group had (none is left to
// HyperParams' defaults).
HyperParams HyperAt(const std::string& prefix, int g, int64_t step) {
  HyperParams h;
  const std::string under = prefix + "hyper/" + std::to_string(g) + "/";
  const std::vector<std::string> fields = KeysUnder(under);
  REQUIRE_FALSE(fields.empty());
  for (const std::string& field : fields) SetField(h, field, At(under + field)[step]);
  return h;
}

// How far the worst element of `ours` is from `ref`, in units of the tolerance (<= 1 passes).
double ErrorRatio(const at::Tensor& ours, const at::Tensor& ref) {
  const at::Tensor a = ours.detach().to(at::kDouble), b = ref.detach().to(at::kDouble);
  if (a.numel() == 0) return 0;
  return ((a - b).abs() / (b.abs() * kRtol + kAtol)).max().item<double>();
}

struct RunResult {
  double worst = 0;   // the largest ErrorRatio over every param and state entry and step
  std::string where;  // where it was
  int64_t compared = 0;
};

// Runs `config` of `kind` from the golden file and compares after every step. With
// `reload`, the state is saved after step kReloadAfter and loaded into a fresh optimizer over
// copies of the params, which takes over. `perturb` changes the hypers ours gets.
RunResult RunConfig(OptimizerKind kind, const std::string& config, bool reload,
                    const std::function<void(HyperParams&)>& perturb = nullptr) {
  const std::string prefix = std::string(OptimizerKindName(kind)) + "/" + config + "/";
  INFO(prefix << (reload ? " with a reload" : ""));
  const int64_t steps = At("steps").item<int64_t>();
  const at::Tensor group_sizes = At(prefix + "group_sizes");
  std::vector<int> group_of;
  for (int g = 0; g < group_sizes.size(0); ++g) {
    for (int64_t i = 0; i < group_sizes[g].item<int64_t>(); ++i) group_of.push_back(g);
  }
  const size_t n = group_of.size();
  std::vector<at::Tensor> params;
  for (size_t p = 0; p < n; ++p) {
    params.push_back(At(prefix + "init/" + std::to_string(p)).clone().requires_grad_(true));
  }
  auto hypers_at = [&](int64_t step) {
    std::vector<HyperParams> hypers;
    for (int g = 0; g < group_sizes.size(0); ++g) {
      hypers.push_back(HyperAt(prefix, g, step));
      if (perturb) perturb(hypers.back());
    }
    return hypers;
  };
  auto make = [&](const std::vector<at::Tensor>& ps, const std::vector<HyperParams>& hypers) {
    std::vector<ParamGroup> groups(hypers.size());
    for (size_t g = 0; g < hypers.size(); ++g) groups[g].hyper = hypers[g];
    for (size_t p = 0; p < n; ++p) groups[group_of[p]].params.push_back(ps[p]);
    auto made = MakeOptimizer(kind, groups);
    INFO(made.status().ToString());
    REQUIRE(made.ok());
    REQUIRE(made.value()->kind() == kind);
    return std::move(made).value();
  };
  std::unique_ptr<Optimizer> opt = make(params, hypers_at(0));

  RunResult result;
  auto compare = [&](const at::Tensor& ours, const at::Tensor& ref, const std::string& what) {
    double ratio = ErrorRatio(ours, ref);
    if (std::isnan(ratio)) ratio = INFINITY;
    result.compared += ref.numel();
    if (result.where.empty() || ratio > result.worst) {
      result.worst = ratio;
      result.where = what;
    }
  };
  for (int64_t s = 0; s < steps; ++s) {
    const std::string at_step = prefix + "step " + std::to_string(s) + ": ";
    const std::vector<HyperParams> hypers = hypers_at(s);
    for (size_t p = 0; p < n; ++p) {
      const std::string ps = std::to_string(p);
      at::Tensor grad;
      if (At(prefix + "has_grad/" + ps)[s].item<int64_t>() != 0) {
        const std::string sparse = std::to_string(s) + "/" + ps;
        if (Has(prefix + "grad_indices/" + sparse)) {
          grad = at::sparse_coo_tensor(At(prefix + "grad_indices/" + sparse),
                                       At(prefix + "grad_values/" + sparse), params[p].sizes());
        } else {
          grad = At(prefix + "grad/" + ps)[s].clone();
        }
      }
      params[p].mutable_grad() = grad;
    }
    const absl::Status stepped = opt->Step(hypers);
    INFO(at_step << stepped.ToString());
    REQUIRE(stepped.ok());

    for (size_t p = 0; p < n; ++p) {
      const std::string ps = std::to_string(p);
      compare(params[p], At(prefix + "param/" + ps)[s], at_step + "param " + ps);
    }
    std::map<std::string, at::Tensor> ours;
    for (const auto& [name, tensor] : opt->NamedState()) ours[name] = tensor;
    std::set<std::string> expected;
    for (size_t p = 0; p < n; ++p) {
      const std::string ps = std::to_string(p);
      if (s < At(prefix + "first/" + ps).item<int64_t>()) continue;
      for (const std::string& key : OptimizerStateKeys(kind)) {
        if (Has(prefix + "state/" + ps + "/" + key)) expected.insert(ps + "." + key);
      }
    }
    std::set<std::string> got;
    for (const auto& entry : ours) got.insert(entry.first);
    {
      INFO(at_step << "state keys");
      CHECK(got == expected);
    }
    for (const std::string& name : expected) {
      if (!ours.count(name)) continue;
      const size_t dot = name.find('.');
      const std::string ps = name.substr(0, dot), key = name.substr(dot + 1);
      const at::Tensor& value = ours[name];
      INFO(at_step << name);
      if (IsScalarOptimizerState(key)) {
        CHECK(value.dim() == 0);
        CHECK(value.scalar_type() == at::kFloat);
        CHECK(value.device().is_cpu());
      } else {
        CHECK(value.sizes() == params[std::stoul(ps)].sizes());
      }
      compare(value, At(prefix + "state/" + ps + "/" + key)[s], at_step + name);
    }

    if (reload && s == kReloadAfter) {
      std::vector<std::pair<std::string, at::Tensor>> saved = opt->NamedState();
      for (auto& entry : saved) entry.second = entry.second.clone();
      std::vector<at::Tensor> copies;
      for (const at::Tensor& p : params) copies.push_back(p.detach().clone().requires_grad_(true));
      opt = make(copies, hypers);
      const absl::Status loaded = opt->LoadNamedState(saved);
      INFO(loaded.ToString());
      REQUIRE(loaded.ok());
      params = copies;
    }
  }
  return result;
}

TEST_CASE("Each kind matches torch.optim step by step, params and state", "[optim]") {
  for (OptimizerKind kind : kKinds) {
    const std::vector<std::string> configs = ConfigsOf(kind);
    INFO(OptimizerKindName(kind));
    CHECK(configs.size() >= 2);
    for (const std::string& config : configs) {
      for (bool reload : {false, true}) {
        const RunResult r = RunConfig(kind, config, reload);
        INFO(config << (reload ? " (reloaded)" : "") << ": worst " << r.worst
                    << " of the tolerance at " << r.where << ", " << r.compared << " values");
        CHECK(r.compared > 500);
        CHECK(r.worst <= 1);
      }
    }
  }
}

TEST_CASE("The comparison with torch.optim fails when a hyper-parameter differs", "[optim]") {
  // Guards the test above against comparing nothing that the hyper-parameters reach.
  struct Perturbation {
    OptimizerKind kind;
    const char* config;
    std::function<void(HyperParams&)> change;
  };
  const std::vector<Perturbation> perturbations = {
      {OptimizerKind::kRmsprop, "plain_and_centered_momentum",
       [](HyperParams& h) { h.alpha -= 0.01; }},
      {OptimizerKind::kAdagrad, "lr_decay_and_accumulator",
       [](HyperParams& h) { h.lr_decay += 0.01; }},
      {OptimizerKind::kAdamax, "defaults_and_betas", [](HyperParams& h) { h.eps += 1e-3; }},
      {OptimizerKind::kNAdam, "defaults_and_momentum_decay",
       [](HyperParams& h) { h.momentum_decay += 0.01; }},
      {OptimizerKind::kRAdam, "defaults_and_betas", [](HyperParams& h) { h.beta2 -= 0.01; }},
      {OptimizerKind::kAdadelta, "defaults_and_rho", [](HyperParams& h) { h.rho -= 0.01; }},
      {OptimizerKind::kAsgd, "averaging", [](HyperParams& h) { h.t0 += 1; }},
      {OptimizerKind::kRprop, "etas_and_step_sizes", [](HyperParams& h) { h.etaplus += 0.05; }},
  };
  for (const Perturbation& p : perturbations) {
    INFO(OptimizerKindName(p.kind) << "/" << p.config);
    CHECK(RunConfig(p.kind, p.config, false).worst <= 1);
    CHECK(RunConfig(p.kind, p.config, false, p.change).worst > 1);
  }
}

TEST_CASE("DefaultHyperParams are torch.optim's constructor defaults", "[optim]") {
  std::vector<OptimizerKind> kinds = kKinds;
  kinds.push_back(OptimizerKind::kAdam);
  kinds.push_back(OptimizerKind::kAdamW);
  for (OptimizerKind kind : kinds) {
    const std::string prefix = std::string("defaults/") + OptimizerKindName(kind) + "/";
    const std::vector<std::string> fields = KeysUnder(prefix);
    INFO(prefix);
    CHECK(fields.size() >= 3);
    for (const std::string& field : fields) {
      HyperParams expected = DefaultHyperParams(kind);
      SetField(expected, field, At(prefix + field));
      HyperParams ours = DefaultHyperParams(kind);
      FieldRefs want = Fields(expected, field), got = Fields(ours, field);
      INFO(field);
      if (got.flag != nullptr) CHECK(*got.flag == *want.flag);
      for (size_t i = 0; i < got.reals.size(); ++i) CHECK(*got.reals[i] == *want.reals[i]);
    }
  }
}

// Returns the error message if `status` has `code`, else a marker that fails the caller's check.
std::string MessageIf(const absl::Status& status, absl::StatusCode code) {
  if (status.code() != code) return "<wrong code: " + status.ToString() + ">";
  return std::string(status.message());
}

TEST_CASE("ValidateHyperParams applies PyTorch's checks to the new kinds", "[optim]") {
  using K = OptimizerKind;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const double nan = std::nan("");
  for (OptimizerKind kind : kKinds) {
    INFO(OptimizerKindName(kind));
    CHECK(ValidateHyperParams(kind, DefaultHyperParams(kind)).ok());
    HyperParams h = DefaultHyperParams(kind);
    h.lr = -1;
    CHECK_THAT(MessageIf(ValidateHyperParams(kind, h), kInvalid),
               Catch::Contains("lr") && Catch::Contains("-1"));
    h.lr = nan;
    CHECK_THAT(MessageIf(ValidateHyperParams(kind, h), kInvalid), Catch::Contains("nan"));
  }
  // Each field a kind checks fails at a bad value and at NaN.
  struct Case {
    OptimizerKind kind;
    std::function<void(HyperParams&, double)> set;
    double bad;
    const char* field;
  };
  const std::vector<Case> cases = {
      {K::kRmsprop, [](HyperParams& h, double v) { h.alpha = v; }, -0.5, "alpha"},
      {K::kRmsprop, [](HyperParams& h, double v) { h.momentum = v; }, -0.5, "momentum"},
      {K::kRmsprop, [](HyperParams& h, double v) { h.eps = v; }, -1e-8, "eps"},
      {K::kRmsprop, [](HyperParams& h, double v) { h.weight_decay = v; }, -0.5, "weight_decay"},
      {K::kAdagrad, [](HyperParams& h, double v) { h.lr_decay = v; }, -0.5, "lr_decay"},
      {K::kAdagrad, [](HyperParams& h, double v) { h.initial_accumulator_value = v; }, -0.5,
       "initial_accumulator_value"},
      {K::kAdagrad, [](HyperParams& h, double v) { h.eps = v; }, -0.5, "eps"},
      {K::kAdagrad, [](HyperParams& h, double v) { h.weight_decay = v; }, -0.5, "weight_decay"},
      {K::kAdamax, [](HyperParams& h, double v) { h.beta1 = v; }, 1.0, "beta1"},
      {K::kAdamax, [](HyperParams& h, double v) { h.beta2 = v; }, -0.5, "beta2"},
      {K::kAdamax, [](HyperParams& h, double v) { h.eps = v; }, -0.5, "eps"},
      {K::kNAdam, [](HyperParams& h, double v) { h.momentum_decay = v; }, -0.5, "momentum_decay"},
      {K::kNAdam, [](HyperParams& h, double v) { h.beta2 = v; }, 1.5, "beta2"},
      {K::kNAdam, [](HyperParams& h, double v) { h.weight_decay = v; }, -0.5, "weight_decay"},
      {K::kRAdam, [](HyperParams& h, double v) { h.beta1 = v; }, -0.5, "beta1"},
      {K::kRAdam, [](HyperParams& h, double v) { h.eps = v; }, -0.5, "eps"},
      {K::kAdadelta, [](HyperParams& h, double v) { h.rho = v; }, 1.5, "rho"},
      {K::kAdadelta, [](HyperParams& h, double v) { h.rho = v; }, -0.5, "rho"},
      {K::kAdadelta, [](HyperParams& h, double v) { h.eps = v; }, -0.5, "eps"},
      {K::kAsgd, [](HyperParams& h, double v) { h.weight_decay = v; }, -0.5, "weight_decay"},
      {K::kRprop, [](HyperParams& h, double v) { h.etaminus = v; }, 1.0, "etas"},
      {K::kRprop, [](HyperParams& h, double v) { h.etaminus = v; }, 0.0, "etas"},
      {K::kRprop, [](HyperParams& h, double v) { h.etaplus = v; }, 1.0, "etas"},
  };
  for (const Case& c : cases) {
    INFO(OptimizerKindName(c.kind) << " " << c.field << " " << c.bad);
    HyperParams h = DefaultHyperParams(c.kind);
    c.set(h, c.bad);
    CHECK_THAT(MessageIf(ValidateHyperParams(c.kind, h), kInvalid), Catch::Contains(c.field));
    c.set(h, nan);
    CHECK_THAT(MessageIf(ValidateHyperParams(c.kind, h), kInvalid),
               Catch::Contains(c.field) && Catch::Contains("nan"));
  }
  // The edges PyTorch allows, and what it does not check.
  HyperParams h = DefaultHyperParams(K::kAdadelta);
  h.rho = 1;
  CHECK(ValidateHyperParams(K::kAdadelta, h).ok());
  h = DefaultHyperParams(K::kAsgd);
  h.lambd = -1;
  h.alpha = -1;
  h.t0 = -1;
  h.eps = -1;
  CHECK(ValidateHyperParams(K::kAsgd, h).ok());
  h = DefaultHyperParams(K::kRprop);
  h.weight_decay = -1;  // Rprop has none
  h.step_size_min = 10;
  h.step_size_max = 1;
  CHECK(ValidateHyperParams(K::kRprop, h).ok());
  h = DefaultHyperParams(K::kRmsprop);
  h.beta1 = 2;  // not RMSprop's
  CHECK(ValidateHyperParams(K::kRmsprop, h).ok());
}

TEST_CASE("State keys: which are scalar, and what StateBytes counts", "[optim]") {
  CHECK(IsScalarOptimizerState("step"));
  CHECK(IsScalarOptimizerState("mu_product"));
  CHECK(IsScalarOptimizerState("eta"));
  CHECK(IsScalarOptimizerState("mu"));
  for (const char* key :
       {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
        "sum", "exp_inf", "acc_delta", "ax", "prev", "step_size"}) {
    CHECK_FALSE(IsScalarOptimizerState(key));
  }
  // StateBytes counts the per-element state, StateTensorsPerElement tensors of each param's
  // size; the scalars are not counted.
  for (OptimizerKind kind : kKinds) {
    for (bool options : {false, true}) {
      INFO(OptimizerKindName(kind) << (options ? " with momentum and centered" : ""));
      HyperParams h = DefaultHyperParams(kind);
      h.momentum = options ? 0.9 : 0;
      h.centered = options;
      at::Tensor a = at::zeros({10}).requires_grad_(true);  // float32: 40 bytes
      at::Tensor b = at::zeros({5}).requires_grad_(true);   // never a grad
      a.mutable_grad() = at::ones({10});
      auto opt = MakeOptimizer(kind, {{{a, b}, h}});
      REQUIRE(opt.ok());
      const int per_element = StateTensorsPerElement(kind, h);
      // Adagrad's state exists from construction, for every param, as in PyTorch.
      const bool eager = kind == OptimizerKind::kAdagrad;
      CHECK((*opt)->StateBytes() == (eager ? per_element * 60 : 0));
      REQUIRE((*opt)->Step({h}).ok());
      CHECK((*opt)->StateBytes() == per_element * (eager ? 60 : 40));
      std::set<std::string> keys;
      for (const auto& entry : (*opt)->NamedState()) keys.insert(entry.first);
      int per_element_keys = 0;
      for (const std::string& key : keys) {
        if (key.rfind("0.", 0) == 0 && !IsScalarOptimizerState(key.substr(2))) ++per_element_keys;
      }
      CHECK(per_element_keys == per_element);
      CHECK(keys.count("0.step"));
      CHECK(keys.count("1.step") == (eager ? 1 : 0));
    }
  }
}

TEST_CASE("Sparse grads: Adagrad takes them, the other new kinds refuse them", "[optim]") {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  auto sparse = [](std::vector<int64_t> rows) {
    const int64_t nnz = static_cast<int64_t>(rows.size());
    at::Tensor indices = at::tensor(rows, at::kLong).reshape({1, nnz});
    return at::sparse_coo_tensor(indices, at::ones({nnz, 3}), {6, 3});
  };
  for (OptimizerKind kind : kKinds) {
    if (kind == OptimizerKind::kAdagrad) continue;
    INFO(OptimizerKindName(kind));
    at::Tensor p = at::randn({6, 3}).requires_grad_(true);
    const at::Tensor p0 = p.detach().clone();
    p.mutable_grad() = sparse({1, 4});
    auto opt = MakeOptimizer(kind, {{{p}, DefaultHyperParams(kind)}});
    REQUIRE(opt.ok());
    CHECK_THAT(
        MessageIf((*opt)->Step({DefaultHyperParams(kind)}), absl::StatusCode::kUnimplemented),
        Catch::Contains("does not support sparse gradients"));
    CHECK(p.equal(p0));
    CHECK((*opt)->NamedState().empty());
  }
  at::Tensor p = at::randn({6, 3}).requires_grad_(true);
  HyperParams h = DefaultHyperParams(OptimizerKind::kAdagrad);
  auto opt = MakeOptimizer(OptimizerKind::kAdagrad, {{{p}, h}});
  REQUIRE(opt.ok());
  h.weight_decay = 0.1;
  p.mutable_grad() = sparse({1, 4});
  const at::Tensor p0 = p.detach().clone();
  CHECK_THAT(MessageIf((*opt)->Step({h}), kInvalid), Catch::Contains("weight_decay"));
  CHECK(p.equal(p0));
  // A sparse grad without entries (a batch that used no row of an embedding) changes nothing
  // but the step count. (PyTorch 1.13 fails on it when the grad has dense dimensions.)
  h.weight_decay = 0;
  p.mutable_grad() = sparse({});
  REQUIRE((*opt)->Step({h}).ok());
  CHECK(p.equal(p0));
  p.mutable_grad() = sparse({1, 1, 4});
  REQUIRE((*opt)->Step({h}).ok());
  CHECK_FALSE(p.equal(p0));
  CHECK(p[0].equal(p0[0]));
  for (const auto& [name, value] : (*opt)->NamedState()) {
    if (name == "0.step") CHECK(value.item<double>() == 2);
  }
}

TEST_CASE("RMSprop creates a buffer that an option switched on mid-training needs", "[optim]") {
  // PyTorch fails here (KeyError); rannc starts the buffers at zeros.
  at::Tensor p = at::randn({4}).requires_grad_(true);
  p.mutable_grad() = at::randn({4});
  HyperParams h = DefaultHyperParams(OptimizerKind::kRmsprop);
  auto opt = MakeOptimizer(OptimizerKind::kRmsprop, {{{p}, h}});
  REQUIRE(opt.ok());
  REQUIRE((*opt)->Step({h}).ok());
  CHECK((*opt)->NamedState().size() == 2);  // step, square_avg
  h.momentum = 0.9;
  h.centered = true;
  REQUIRE((*opt)->Step({h}).ok());
  std::set<std::string> keys;
  for (const auto& entry : (*opt)->NamedState()) keys.insert(entry.first);
  CHECK(keys == std::set<std::string>{"0.step", "0.square_avg", "0.momentum_buffer", "0.grad_avg"});
}

TEST_CASE("LoadNamedState of the new kinds rejects incomplete state and changes nothing",
          "[optim]") {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  at::Tensor a = at::randn({4}).requires_grad_(true);
  at::Tensor b = at::randn({2}).requires_grad_(true);
  auto opt =
      MakeOptimizer(OptimizerKind::kAdamax, {{{a, b}, DefaultHyperParams(OptimizerKind::kAdamax)}});
  REQUIRE(opt.ok());
  Optimizer& o = **opt;
  const at::Tensor zeros = at::zeros({4});
  CHECK_THAT(MessageIf(o.LoadNamedState({{"0.step", at::scalar_tensor(3.)}, {"0.exp_avg", zeros}}),
                       kInvalid),
             Catch::Contains("param 0") && Catch::Contains("lacks exp_inf"));
  CHECK_THAT(MessageIf(o.LoadNamedState({{"0.exp_avg", zeros}, {"0.exp_inf", zeros}}), kInvalid),
             Catch::Contains("lacks step"));
  CHECK_THAT(MessageIf(o.LoadNamedState({{"0.step", at::ones({2})}}), kInvalid),
             Catch::Contains("one value per param"));
  CHECK_THAT(MessageIf(o.LoadNamedState({{"0.exp_avg_sq", zeros}}), kInvalid),
             Catch::Contains("unknown optimizer state key 'exp_avg_sq'"));
  CHECK_THAT(MessageIf(o.LoadNamedState({{"1.exp_avg", zeros}}), kInvalid),
             Catch::Contains("[4]") && Catch::Contains("[2]"));
  CHECK(o.NamedState().empty());
  CHECK(o.StateBytes() == 0);
  // A 1-element step is accepted as PyTorch's 0-dim one; RMSprop's optional keys may be absent.
  REQUIRE(
      o.LoadNamedState({{"0.step", at::ones({1}) * 3}, {"0.exp_avg", zeros}, {"0.exp_inf", zeros}})
          .ok());
  CHECK(o.NamedState().size() == 3);
  auto rms =
      MakeOptimizer(OptimizerKind::kRmsprop, {{{a}, DefaultHyperParams(OptimizerKind::kRmsprop)}});
  REQUIRE(rms.ok());
  CHECK((*rms)->LoadNamedState({{"0.step", at::scalar_tensor(1.)}, {"0.square_avg", zeros}}).ok());
  // Adagrad's params without entries get fresh state (step 0, sum = initial_accumulator_value).
  HyperParams h = DefaultHyperParams(OptimizerKind::kAdagrad);
  h.initial_accumulator_value = 0.25;
  auto adagrad = MakeOptimizer(OptimizerKind::kAdagrad, {{{a, b}, h}});
  REQUIRE(adagrad.ok());
  REQUIRE((*adagrad)->LoadNamedState({{"0.step", at::scalar_tensor(5.)}, {"0.sum", zeros}}).ok());
  std::map<std::string, at::Tensor> state;
  for (const auto& [name, value] : (*adagrad)->NamedState()) state[name] = value;
  REQUIRE(state.size() == 4);
  CHECK(state["0.step"].item<double>() == 5);
  CHECK(state["1.step"].item<double>() == 0);
  CHECK(state["1.sum"].equal(at::full({2}, 0.25)));
}

}  // namespace
}  // namespace rannc
