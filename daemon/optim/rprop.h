// Rprop: PyTorch's torch.optim.Rprop, single-tensor algorithm (etas, step sizes, maximize).
// lr only starts a param's step_size, at its first step, as in PyTorch.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kRprop, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_RPROP_H_
#define RANNC_DAEMON_OPTIM_RPROP_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Rprop final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {{"prev", false}, {"step_size", false}};

  // `groups` must have passed the factory's checks.
  explicit Rprop(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kRprop, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kPrev, kStepSize };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_RPROP_H_
