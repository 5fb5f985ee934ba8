// RMSprop: PyTorch's torch.optim.RMSprop, single-tensor algorithm (alpha, eps, weight decay,
// momentum, centered, maximize). One departure: if momentum or centered is switched on after a
// param's first step, PyTorch fails (the buffer was never created); here the buffer starts at
// zeros then.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kRmsprop, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_RMSPROP_H_
#define RANNC_DAEMON_OPTIM_RMSPROP_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Rmsprop final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {
      {"square_avg", false}, {"momentum_buffer", true}, {"grad_avg", true}};

  // `groups` must have passed the factory's checks.
  explicit Rmsprop(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kRmsprop, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kSquareAvg, kMomentumBuffer, kGradAvg };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_RMSPROP_H_
