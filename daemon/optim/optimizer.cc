#include "daemon/optim/optimizer.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/optim/adam.h"
#include "daemon/optim/optimizer_internal.h"
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
  }
  return "unknown";
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

}  // namespace

absl::Status ValidateHyperParams(OptimizerKind kind, const HyperParams& hyper) {
  absl::Status status = CheckAtLeastZero("lr", hyper.lr);
  if (!status.ok()) return status;
  status = CheckAtLeastZero("weight_decay", hyper.weight_decay);
  if (!status.ok()) return status;
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
      status = CheckAtLeastZero("eps", hyper.eps);
      if (!status.ok()) return status;
      status = CheckBeta("beta1", hyper.beta1);
      if (!status.ok()) return status;
      return CheckBeta("beta2", hyper.beta2);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer kind ", static_cast<int>(kind)));
}

namespace optim_internal {
namespace {

// "Float[2, 3] on cpu", for mismatch messages.
std::string Describe(const at::Tensor& t) {
  return absl::StrCat(c10::toString(t.scalar_type()), "[", absl::StrJoin(t.sizes(), ", "), "] on ",
                      t.device().str());
}

}  // namespace

absl::Status CheckStepArgs(OptimizerKind kind, const std::vector<ParamGroup>& groups,
                           const std::vector<HyperParams>& hypers) {
  if (hypers.size() != groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat(OptimizerKindName(kind), " step got ",
                                                   hypers.size(), " sets of hyper-parameters for ",
                                                   groups.size(), " param groups"));
  }
  const bool adam = kind != OptimizerKind::kSgd;
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
      if (adam && grad.is_sparse()) {
        return absl::UnimplementedError(
            absl::StrCat(where, "Adam does not support sparse gradients"));
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

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(OptimizerKind kind,
                                                         std::vector<ParamGroup> groups) {
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
  switch (kind) {
    case OptimizerKind::kSgd:
      return std::unique_ptr<Optimizer>(new Sgd(std::move(groups)));
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return std::unique_ptr<Optimizer>(new Adam(kind, std::move(groups)));
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
  if (ref.key != "step" && !value.sizes().equals(param.sizes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state '", name, "' has shape [", absl::StrJoin(value.sizes(), ", "),
        "], its param [", absl::StrJoin(param.sizes(), ", "), "]"));
  }
  return ref;
}

}  // namespace optim_internal
}  // namespace rannc
