// Adamax: PyTorch's torch.optim.Adamax, single-tensor algorithm (betas, eps, weight decay,
// maximize): Adam with the infinity norm in place of the second moment.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kAdamax, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_ADAMAX_H_
#define RANNC_DAEMON_OPTIM_ADAMAX_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Adamax final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {{"exp_avg", false}, {"exp_inf", false}};

  // `groups` must have passed the factory's checks.
  explicit Adamax(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kAdamax, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kExpAvg, kExpInf };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_ADAMAX_H_
