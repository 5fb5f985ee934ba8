#include "daemon/optim/optimizer.h"

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/optim/adadelta.h"
#include "daemon/optim/adagrad.h"
#include "daemon/optim/adam.h"
#include "daemon/optim/adamax.h"
#include "daemon/optim/asgd.h"
#include "daemon/optim/nadam.h"
#include "daemon/optim/optimizer_internal.h"
#include "daemon/optim/radam.h"
#include "daemon/optim/rmsprop.h"
#include "daemon/optim/rprop.h"
#include "daemon/optim/scripted.h"
#include "daemon/optim/sgd.h"

namespace rannc {

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kRmsprop:
      return "rmsprop";
    case OptimizerKind::kAdagrad:
      return "adagrad";
    case OptimizerKind::kAdamax:
      return "adamax";
    case OptimizerKind::kNAdam:
      return "nadam";
    case OptimizerKind::kRAdam:
      return "radam";
    case OptimizerKind::kAdadelta:
      return "adadelta";
    case OptimizerKind::kAsgd:
      return "asgd";
    case OptimizerKind::kRprop:
      return "rprop";
    case OptimizerKind::kScripted:
      return "scripted";
  }
  return "unknown";
}

HyperParams DefaultHyperParams(OptimizerKind kind) {
  HyperParams h;
  switch (kind) {
    case OptimizerKind::kSgd:
    case OptimizerKind::kAdam:
    case OptimizerKind::kRAdam:
    case OptimizerKind::kScripted:
      break;
    case OptimizerKind::kAdamW:
      h.weight_decay = 1e-2;
      break;
    case OptimizerKind::kRmsprop:
      h.lr = 1e-2;
      break;
    case OptimizerKind::kAdagrad:
      h.lr = 1e-2;
      h.eps = 1e-10;
      break;
    case OptimizerKind::kAdamax:
    case OptimizerKind::kNAdam:
      h.lr = 2e-3;
      break;
    case OptimizerKind::kAdadelta:
      h.lr = 1.0;
      h.eps = 1e-6;
      break;
    case OptimizerKind::kAsgd:
      h.lr = 1e-2;
      h.alpha = 0.75;
      break;
    case OptimizerKind::kRprop:
      h.lr = 1e-2;
      break;
  }
  return h;
}

namespace {

template <size_t N>
std::vector<std::string> StepAnd(const optim_internal::SlotSpec (&slots)[N]) {
  std::vector<std::string> keys = {"step"};
  for (const optim_internal::SlotSpec& slot : slots) keys.push_back(slot.key);
  return keys;
}

}  // namespace

const std::vector<std::string>& OptimizerStateKeys(OptimizerKind kind) {
  static const auto* const kSgdKeys = new std::vector<std::string>{"momentum_buffer"};
  static const auto* const kAdamKeys =
      new std::vector<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const auto* const kRmspropKeys = new std::vector<std::string>(StepAnd(Rmsprop::kSlots));
  static const auto* const kAdagradKeys = new std::vector<std::string>(StepAnd(Adagrad::kSlots));
  static const auto* const kAdamaxKeys = new std::vector<std::string>(StepAnd(Adamax::kSlots));
  static const auto* const kNAdamKeys = new std::vector<std::string>(StepAnd(NAdam::kSlots));
  static const auto* const kRAdamKeys = new std::vector<std::string>(StepAnd(RAdam::kSlots));
  static const auto* const kAdadeltaKeys =
      new std::vector<std::string>(StepAnd(Adadelta::kSlots));
  static const auto* const kAsgdKeys = new std::vector<std::string>(StepAnd(Asgd::kSlots));
  static const auto* const kRpropKeys = new std::vector<std::string>(StepAnd(Rprop::kSlots));
  static const auto* const kNone = new std::vector<std::string>();
  switch (kind) {
    case OptimizerKind::kSgd:
      return *kSgdKeys;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return *kAdamKeys;
    case OptimizerKind::kRmsprop:
      return *kRmspropKeys;
    case OptimizerKind::kAdagrad:
      return *kAdagradKeys;
    case OptimizerKind::kAdamax:
      return *kAdamaxKeys;
    case OptimizerKind::kNAdam:
      return *kNAdamKeys;
    case OptimizerKind::kRAdam:
      return *kRAdamKeys;
    case OptimizerKind::kAdadelta:
      return *kAdadeltaKeys;
    case OptimizerKind::kAsgd:
      return *kAsgdKeys;
    case OptimizerKind::kRprop:
      return *kRpropKeys;
    case OptimizerKind::kScripted:
      return *kNone;
  }
  return *kNone;
}

bool IsScalarOptimizerState(const std::string& key) {
  return key == "step" || key == "mu_product" || key == "eta" || key == "mu";
}

int StateTensorsPerElement(OptimizerKind kind, const HyperParams& hyper) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return hyper.momentum != 0 ? 1 : 0;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return hyper.amsgrad ? 3 : 2;
    case OptimizerKind::kRmsprop:
      return 1 + (hyper.momentum > 0 ? 1 : 0) + (hyper.centered ? 1 : 0);
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kAsgd:
      return 1;
    case OptimizerKind::kAdamax:
    case OptimizerKind::kNAdam:
    case OptimizerKind::kRAdam:
    case OptimizerKind::kAdadelta:
    case OptimizerKind::kRprop:
      return 2;
    case OptimizerKind::kScripted:
      return 0;
  }
  return 0;
}

namespace {

// Written as !(x >= 0) rather than x < 0 so that NaN fails, as `not 0.0 <= x` does in PyTorch.
absl::Status CheckAtLeastZero(const char* field, double value) {
  if (!(value >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid ", field, ": ", value, " (must be >= 0)"));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(const char* field, double value) {
  if (!(value >= 0 && value < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid ", field, ": ", value, " (must be in [0, 1))"));
  }
  return absl::OkStatus();
}

// The first failing check's status, or OK.
absl::Status FirstError(std::initializer_list<absl::Status> checks) {
  for (const absl::Status& status : checks) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateHyperParams(OptimizerKind kind, const HyperParams& hyper) {
  if (kind == OptimizerKind::kScripted) return absl::OkStatus();
  absl::Status status = CheckAtLeastZero("lr", hyper.lr);
  if (!status.ok()) return status;
  if (kind != OptimizerKind::kRprop) {  // Rprop has no weight decay
    status = CheckAtLeastZero("weight_decay", hyper.weight_decay);
    if (!status.ok()) return status;
  }
  switch (kind) {
    case OptimizerKind::kSgd:
      status = CheckAtLeastZero("momentum", hyper.momentum);
      if (!status.ok()) return status;
      if (hyper.nesterov && (hyper.momentum <= 0 || hyper.dampening != 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("nesterov momentum requires momentum > 0 and dampening == 0 (got "
                         "momentum: ",
                         hyper.momentum, ", dampening: ", hyper.dampening, ")"));
      }
      return absl::OkStatus();
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdamax:
    case OptimizerKind::kRAdam:
      return FirstError({CheckAtLeastZero("eps", hyper.eps), CheckBeta("beta1", hyper.beta1),
                         CheckBeta("beta2", hyper.beta2)});
    case OptimizerKind::kNAdam:
      return FirstError({CheckAtLeastZero("eps", hyper.eps), CheckBeta("beta1", hyper.beta1),
                         CheckBeta("beta2", hyper.beta2),
                         CheckAtLeastZero("momentum_decay", hyper.momentum_decay)});
    case OptimizerKind::kRmsprop:
      return FirstError({CheckAtLeastZero("eps", hyper.eps),
                         CheckAtLeastZero("momentum", hyper.momentum),
                         CheckAtLeastZero("alpha", hyper.alpha)});
    case OptimizerKind::kAdagrad:
      return FirstError({CheckAtLeastZero("lr_decay", hyper.lr_decay),
                         CheckAtLeastZero("initial_accumulator_value",
                                          hyper.initial_accumulator_value),
                         CheckAtLeastZero("eps", hyper.eps)});
    case OptimizerKind::kAdadelta:
      if (!(hyper.rho >= 0 && hyper.rho <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("invalid rho: ", hyper.rho, " (must be in [0, 1])"));
      }
      return CheckAtLeastZero("eps", hyper.eps);
    case OptimizerKind::kAsgd:
    case OptimizerKind::kScripted:
      return absl::OkStatus();
    case OptimizerKind::kRprop:
      if (!(0 < hyper.etaminus && hyper.etaminus < 1 && 1 < hyper.etaplus)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "invalid etas: (", hyper.etaminus, ", ", hyper.etaplus,
            ") (must be 0 < etaminus < 1 < etaplus)"));
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer kind ", static_cast<int>(kind)));
}

namespace optim_internal {
namespace {

// torch.optim's class name, for PyTorch's messages.
const char* TorchClassName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "SGD";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kRmsprop:
      return "RMSprop";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kAdamax:
      return "Adamax";
    case OptimizerKind::kNAdam:
      return "NAdam";
    case OptimizerKind::kRAdam:
      return "RAdam";
    case OptimizerKind::kAdadelta:
      return "Adadelta";
    case OptimizerKind::kAsgd:
      return "ASGD";
    case OptimizerKind::kRprop:
      return "Rprop";
    case OptimizerKind::kScripted:
      return "a scripted optimizer";
  }
  return "unknown";
}

// "Float[2, 3] on cpu", for mismatch messages.
std::string Describe(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), "[", absl::StrJoin(t.sizes(), ", "), "] on ",
                      t.device().str());
}

}  // namespace

absl::Status CheckGroups(OptimizerKind kind, const std::vector<ParamGroup>& groups) {
  std::unordered_set<const void*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::Status status = ValidateHyperParams(kind, groups[g].hyper);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(OptimizerKindName(kind), " param group ", g, ": ", status.message()));
    }
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const at::Tensor& param = groups[g].params[i];
      const std::string where =
          absl::StrCat(OptimizerKindName(kind), " param group ", g, ", param ", i, ": ");
      if (!param.defined()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "undefined tensor"));
      }
      if (!param.is_leaf()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "can't optimize a non-leaf tensor"));
      }
      if (kind != OptimizerKind::kSgd && param.is_complex()) {
        return absl::UnimplementedError(absl::StrCat(where, "complex params are not supported"));
      }
      if (!seen.insert(param.unsafeGetTensorImpl()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "appears more than once across the param groups"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStepArgs(OptimizerKind kind, const std::vector<ParamGroup>& groups,
                           const std::vector<HyperParams>& hypers) {
  if (hypers.size() != groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat(OptimizerKindName(kind), " step got ",
                                                   hypers.size(), " sets of hyper-parameters for ",
                                                   groups.size(), " param groups"));
  }
  const bool sparse_ok = kind == OptimizerKind::kSgd || kind == OptimizerKind::kAdagrad;
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::Status status = ValidateHyperParams(kind, hypers[g]);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("param group ", g, ": ", status.message()));
    }
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const at::Tensor& param = groups[g].params[i];
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      const std::string where = absl::StrCat("param group ", g, ", param ", i, ": ");
      if (!sparse_ok && grad.is_sparse()) {
        return absl::UnimplementedError(
            absl::StrCat(where, TorchClassName(kind), " does not support sparse gradients"));
      }
      if (grad.is_sparse() && kind == OptimizerKind::kAdagrad && hypers[g].weight_decay != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "weight_decay option is not compatible with sparse gradients"));
      }
      if (grad.sizes() != param.sizes() || grad.scalar_type() != param.scalar_type() ||
          grad.device() != param.device()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "grad ", Describe(grad),
                                                       " does not match param ", Describe(param)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace optim_internal

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
    OptimizerKind kind, std::vector<ParamGroup> groups,
    std::shared_ptr<const ScriptedUpdate> scripted) {
  absl::Status checked = optim_internal::CheckGroups(kind, groups);
  if (!checked.ok()) return checked;
  switch (kind) {
    case OptimizerKind::kSgd:
      return std::unique_ptr<Optimizer>(new Sgd(std::move(groups)));
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return std::unique_ptr<Optimizer>(new Adam(kind, std::move(groups)));
    case OptimizerKind::kRmsprop:
      return std::unique_ptr<Optimizer>(new Rmsprop(std::move(groups)));
    case OptimizerKind::kAdagrad: {
      auto adagrad = std::make_unique<Adagrad>(std::move(groups));
      absl::Status status = adagrad->CreateEagerState();
      if (!status.ok()) return status;
      return std::unique_ptr<Optimizer>(std::move(adagrad));
    }
    case OptimizerKind::kAdamax:
      return std::unique_ptr<Optimizer>(new Adamax(std::move(groups)));
    case OptimizerKind::kNAdam:
      return std::unique_ptr<Optimizer>(new NAdam(std::move(groups)));
    case OptimizerKind::kRAdam:
      return std::unique_ptr<Optimizer>(new RAdam(std::move(groups)));
    case OptimizerKind::kAdadelta:
      return std::unique_ptr<Optimizer>(new Adadelta(std::move(groups)));
    case OptimizerKind::kAsgd:
      return std::unique_ptr<Optimizer>(new Asgd(std::move(groups)));
    case OptimizerKind::kRprop:
      return std::unique_ptr<Optimizer>(new Rprop(std::move(groups)));
    case OptimizerKind::kScripted: {
      absl::StatusOr<std::unique_ptr<ScriptedOptimizer>> made =
          ScriptedOptimizer::Make(std::move(groups), std::move(scripted));
      if (!made.ok()) return made.status();
      return std::unique_ptr<Optimizer>(std::move(*made));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer kind ", static_cast<int>(kind)));
}

namespace optim_internal {

absl::StatusOr<StateEntryRef> ParseStateEntry(const std::vector<ParamGroup>& groups,
                                              const std::string& name, const at::Tensor& value,
                                              const std::vector<std::string>& keys) {
  const size_t dot = name.find('.');
  size_t index = 0;
  bool numeric = dot != std::string::npos && dot > 0;
  for (size_t i = 0; numeric && i < dot; ++i) {
    numeric = name[i] >= '0' && name[i] <= '9';
    index = index * 10 + (name[i] - '0');
  }
  if (!numeric) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state key '", name, "' is not <param index>.<key>"));
  }
  StateEntryRef ref;
  ref.key = name.substr(dot + 1);
  if (std::find(keys.begin(), keys.end(), ref.key) == keys.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown optimizer state key '", ref.key,
                                                   "' (expected one of ",
                                                   absl::StrJoin(keys, ", "), ")"));
  }
  size_t rest = index;
  for (ref.group = 0; ref.group < groups.size(); ++ref.group) {
    if (rest < groups[ref.group].params.size()) break;
    rest -= groups[ref.group].params.size();
  }
  if (ref.group == groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for param ", index, " of fewer params"));
  }
  ref.param = rest;
  const at::Tensor& param = groups[ref.group].params[ref.param];
  if (IsScalarOptimizerState(ref.key)) {
    if (value.numel() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state '", name, "' is one value per param, but has shape [",
          absl::StrJoin(value.sizes(), ", "), "]"));
    }
  } else if (!value.sizes().equals(param.sizes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state '", name, "' has shape [", absl::StrJoin(value.sizes(), ", "),
        "], its param [", absl::StrJoin(param.sizes(), ", "), "]"));
  }
  return ref;
}

}  // namespace optim_internal
}  // namespace rannc
