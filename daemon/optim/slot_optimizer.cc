#include "daemon/optim/slot_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/scalar_tensor.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status.h"
#include "daemon/optim/optimizer_internal.h"

namespace rannc {
namespace optim_internal {

at::Tensor ScalarState(double value) { return at::scalar_tensor(value, at::kFloat); }

SlotOptimizer::SlotOptimizer(OptimizerKind kind, std::vector<ParamGroup> groups,
                             std::vector<SlotSpec> slots, bool keeps_step)
    : kind_(kind), groups_(std::move(groups)), slots_(std::move(slots)), keeps_step_(keeps_step) {
  if (keeps_step_) keys_.push_back("step");
  for (const SlotSpec& slot : slots_) keys_.push_back(slot.key);
  for (const ParamGroup& group : groups_) {
    states_.emplace_back(group.params.size());
    for (ParamState& state : states_.back()) state.slots.resize(slots_.size());
  }
}

absl::Status SlotOptimizer::Step(const std::vector<HyperParams>& hypers) {
  absl::Status checked = CheckStepArgs(kind_, groups_, hypers);
  if (!checked.ok()) return checked;
  // A scripted update's failure (a missing group entry, a shape error) is the user's code.
  const absl::StatusCode code = kind_ == OptimizerKind::kScripted
                                    ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kInternal;
  return TorchCall(code, absl::StrCat(OptimizerKindName(kind_), " step"),
                   [&]() -> absl::Status {
                     // Params are autograd leaves that require grad: in-place updates must not be
                     // recorded.
                     at::NoGradGuard no_grad;
                     for (size_t g = 0; g < groups_.size(); ++g) {
                       for (size_t i = 0; i < groups_[g].params.size(); ++i) {
                         at::Tensor& param = groups_[g].params[i];
                         const at::Tensor& grad = param.grad();
                         if (grad.defined()) StepParam(param, grad, states_[g][i], hypers[g]);
                       }
                     }
                     return absl::OkStatus();
                   });
}

absl::Status SlotOptimizer::CreateEagerState() {
  return TorchCall(absl::StatusCode::kInternal,
                   absl::StrCat("creating ", OptimizerKindName(kind_), " state"),
                   [&]() -> absl::Status {
                     at::NoGradGuard no_grad;
                     for (size_t g = 0; g < groups_.size(); ++g) {
                       for (size_t i = 0; i < groups_[g].params.size(); ++i) {
                         if (states_[g][i].present) continue;
                         InitEagerState(groups_[g].params[i], states_[g][i], groups_[g].hyper);
                       }
                     }
                     return absl::OkStatus();
                   });
}

int64_t SlotOptimizer::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& group : states_) {
    for (const ParamState& state : group) {
      for (size_t s = 0; s < slots_.size(); ++s) {
        if (state.slots[s].defined() && !IsScalarOptimizerState(slots_[s].key)) {
          bytes += static_cast<int64_t>(state.slots[s].nbytes());
        }
      }
    }
  }
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> SlotOptimizer::NamedState() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  int64_t index = 0;
  for (const auto& group : states_) {
    for (const ParamState& state : group) {
      const std::string prefix = std::to_string(index++) + ".";
      if (!state.present) continue;
      if (keeps_step_) {
        named.emplace_back(prefix + "step", ScalarState(static_cast<double>(state.step)));
      }
      for (size_t s = 0; s < slots_.size(); ++s) {
        if (state.slots[s].defined()) named.emplace_back(prefix + slots_[s].key, state.slots[s]);
      }
    }
  }
  return named;
}

absl::Status SlotOptimizer::LoadNamedState(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  const std::vector<std::string>& keys = keys_;
  return TorchCall(
      absl::StatusCode::kInternal, absl::StrCat("loading ", OptimizerKindName(kind_), " state"),
      [&]() -> absl::Status {
        std::vector<std::vector<ParamState>> states;
        std::vector<std::vector<bool>> has_step;
        for (const ParamGroup& group : groups_) {
          states.emplace_back(group.params.size());
          for (ParamState& s : states.back()) s.slots.resize(slots_.size());
          has_step.emplace_back(group.params.size(), false);
        }
        for (const auto& [name, value] : state) {
          absl::StatusOr<StateEntryRef> ref = ParseStateEntry(groups_, name, value, keys);
          if (!ref.ok()) return ref.status();
          ParamState& s = states[ref->group][ref->param];
          s.present = true;
          if (ref->key == "step") {
            s.step = static_cast<int64_t>(value.item<double>());
            has_step[ref->group][ref->param] = true;
            continue;
          }
          size_t slot = 0;
          while (ref->key != slots_[slot].key) ++slot;  // ParseStateEntry checked the key
          if (IsScalarOptimizerState(ref->key)) {
            s.slots[slot] = ScalarState(value.item<double>());
          } else {
            const at::Tensor& param = groups_[ref->group].params[ref->param];
            s.slots[slot] = value.detach().to(param.options()).clone();
          }
        }
        int64_t index = 0;
        for (size_t g = 0; g < states.size(); ++g) {
          for (size_t i = 0; i < states[g].size(); ++i, ++index) {
            const ParamState& s = states[g][i];
            if (!s.present) continue;
            std::vector<std::string> required, missing;
            if (keeps_step_) {
              required.push_back("step");
              if (!has_step[g][i]) missing.push_back("step");
            }
            for (size_t slot = 0; slot < slots_.size(); ++slot) {
              if (slots_[slot].optional) continue;
              required.push_back(slots_[slot].key);
              if (!s.slots[slot].defined()) missing.push_back(slots_[slot].key);
            }
            if (!missing.empty()) {
              return absl::InvalidArgumentError(absl::StrCat(
                  OptimizerKindName(kind_), " optimizer state of param ", index, " lacks ",
                  absl::StrJoin(missing, ", "), " (a param's state has all of ",
                  absl::StrJoin(required, ", "), ", or none)"));
            }
          }
        }
        at::NoGradGuard no_grad;
        for (size_t g = 0; g < states.size(); ++g) {
          for (size_t i = 0; i < states[g].size(); ++i) {
            if (!states[g][i].present) {
              InitEagerState(groups_[g].params[i], states[g][i], groups_[g].hyper);
            }
          }
        }
        states_ = std::move(states);
        return absl::OkStatus();
      });
}

}  // namespace optim_internal
}  // namespace rannc
