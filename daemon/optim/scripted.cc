#include "daemon/optim/scripted.h"

#include <ATen/ops/zeros_like.h>
#include <ATen/core/Dict.h>
#include <torch/csrc/jit/serialization/import.h>

#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/torch_archive.h"

namespace rannc {
namespace {

// The module, loaded onto the CPU (the update runs on whatever device its tensors are on), with
// its forward checked against the contract.
absl::StatusOr<torch::jit::Module> LoadUpdate(const ScriptedUpdate& update) {
  const std::string what = absl::StrCat("optimizer ", update.name, ": ");
  // Sizes the archive states, checked before LibTorch allocates them.
  absl::Status checked = CheckTorchArchive(update.module, absl::StrCat(what, "its update"));
  if (!checked.ok()) return checked;
  torch::jit::Module module;
  absl::Status loaded = TorchCall(
      absl::StatusCode::kInvalidArgument,
      absl::StrCat(what, "its update is not a loadable TorchScript module"), [&] {
        std::istringstream stream(update.module);
        module = torch::jit::load(stream, c10::Device(c10::kCPU));
        return absl::OkStatus();
      });
  if (!loaded.ok()) return loaded;
  auto forward = module.find_method("forward");
  const char* kContract =
      "forward(param: Tensor, grad: Tensor, state: Dict[str, Tensor], group: Dict[str, float])";
  if (!forward) {
    return absl::InvalidArgumentError(absl::StrCat(what, "its update has no ", kContract));
  }
  const std::vector<c10::Argument>& args = forward->function().getSchema().arguments();
  // args[0] is self.
  const c10::TypePtr tensor = c10::TensorType::get();
  const c10::TypePtr str = c10::StringType::get();
  const bool ok = args.size() == 5 && args[1].type()->isSubtypeOf(*tensor) &&
                  args[2].type()->isSubtypeOf(*tensor) &&
                  *args[3].type() == *c10::DictType::create(str, tensor) &&
                  *args[4].type() == *c10::DictType::create(str, c10::FloatType::get());
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(what, "its update is ",
                                                   c10::str(forward->function().getSchema()),
                                                   "; expected ", kContract));
  }
  return module;
}

absl::Status CheckStateKeys(const ScriptedUpdate& update) {
  std::set<std::string> seen;
  for (const std::string& key : update.state_keys) {
    const std::string what = absl::StrCat("optimizer ", update.name, ": state key '", key, "'");
    if (key.empty() || key.find('.') != std::string::npos || key.find('@') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be a non-empty name without '.' or '@'"));
    }
    if (key != "step" && IsScalarOptimizerState(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is taken: checkpoints keep it as a scalar (ASGD's and NAdam's); rename it"));
    }
    if (!seen.insert(key).second) return absl::InvalidArgumentError(what + " is listed twice");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateScriptedUpdate(const ScriptedUpdate& update) {
  absl::Status keys = CheckStateKeys(update);
  if (!keys.ok()) return keys;
  return LoadUpdate(update).status();
}

absl::StatusOr<std::unique_ptr<ScriptedOptimizer>> ScriptedOptimizer::Make(
    std::vector<ParamGroup> groups, std::shared_ptr<const ScriptedUpdate> update) {
  if (update == nullptr) {
    return absl::InvalidArgumentError("a scripted optimizer needs its update");
  }
  absl::Status keys = CheckStateKeys(*update);
  if (!keys.ok()) return keys;
  absl::StatusOr<torch::jit::Module> module = LoadUpdate(*update);
  if (!module.ok()) return module.status();
  std::vector<optim_internal::SlotSpec> slots;
  bool keeps_step = false;
  for (const std::string& key : update->state_keys) {
    if (key == "step") {
      keeps_step = true;
    } else {
      slots.push_back({key.c_str(), /*optional=*/false});
    }
  }
  return std::unique_ptr<ScriptedOptimizer>(new ScriptedOptimizer(
      std::move(groups), std::move(update), std::move(slots), keeps_step, std::move(*module)));
}

ScriptedOptimizer::ScriptedOptimizer(std::vector<ParamGroup> groups,
                                     std::shared_ptr<const ScriptedUpdate> update,
                                     std::vector<optim_internal::SlotSpec> slots, bool keeps_step,
                                     torch::jit::Module module)
    : SlotOptimizer(OptimizerKind::kScripted, std::move(groups), std::move(slots), keeps_step),
      update_(std::move(update)),
      module_(std::move(module)) {}

void ScriptedOptimizer::StepParam(at::Tensor& param, const at::Tensor& grad,
                                  optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    for (size_t s = 0; s < slots().size(); ++s) {
      state.slots[s] = at::zeros_like(param, at::MemoryFormat::Preserve);
    }
  }
  state.step += 1;
  c10::Dict<std::string, at::Tensor> named_state;
  if (keeps_step()) {
    named_state.insert("step", optim_internal::ScalarState(static_cast<double>(state.step)));
  }
  for (size_t s = 0; s < slots().size(); ++s) {
    named_state.insert(slots()[s].key, state.slots[s]);
  }
  c10::Dict<std::string, double> group;
  for (const auto& [name, value] : hyper.named) group.insert(name, value);
  module_.forward({param, grad, named_state, group});
  // The update may have replaced an entry (state["m"] = new) rather than written into it.
  for (size_t s = 0; s < slots().size(); ++s) {
    const char* key = slots()[s].key;
    auto it = named_state.find(key);
    TORCH_CHECK(it != named_state.end(), "the update removed state '", key, "'");
    const at::Tensor& value = it->value();
    TORCH_CHECK(value.sizes() == param.sizes() && value.device() == param.device(),
                "the update left state '", key, "' of shape ", value.sizes(), " on ",
                value.device(), " for a param of shape ", param.sizes(), " on ", param.device());
    state.slots[s] = value;
  }
}

}  // namespace rannc
