// ScriptedOptimizer: an optimizer whose per-param update is the user's TorchScript function
// (OptimizerKind::kScripted; ScriptedUpdate in optimizer.h), with torch.optim's bookkeeping
// around it: state created at a param's first step, "step" advanced before each update, params
// without a grad skipped. Private to //daemon/optim:optimizer; callers use MakeOptimizer.
// Thread-safety and lifetimes as Optimizer's; each ScriptedOptimizer runs its own copy of the
// module, so optimizers of different stages may step concurrently.
#ifndef RANNC_DAEMON_OPTIM_SCRIPTED_H_
#define RANNC_DAEMON_OPTIM_SCRIPTED_H_

#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class ScriptedOptimizer final : public optim_internal::SlotOptimizer {
 public:
  // `groups` must have passed the factory's checks. INVALID_ARGUMENT as ValidateScriptedUpdate.
  static absl::StatusOr<std::unique_ptr<ScriptedOptimizer>> Make(
      std::vector<ParamGroup> groups, std::shared_ptr<const ScriptedUpdate> update);

 private:
  ScriptedOptimizer(std::vector<ParamGroup> groups, std::shared_ptr<const ScriptedUpdate> update,
                    std::vector<optim_internal::SlotSpec> slots, bool keeps_step,
                    torch::jit::Module module);

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;

  std::shared_ptr<const ScriptedUpdate> update_;  // owns the strings the slots point into
  torch::jit::Module module_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_SCRIPTED_H_
