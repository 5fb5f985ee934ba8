// Adadelta: PyTorch's torch.optim.Adadelta, single-tensor algorithm (lr, rho, eps, weight decay,
// maximize).
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kAdadelta, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_ADADELTA_H_
#define RANNC_DAEMON_OPTIM_ADADELTA_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Adadelta final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {{"square_avg", false},
                                                        {"acc_delta", false}};

  // `groups` must have passed the factory's checks.
  explicit Adadelta(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kAdadelta, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kSquareAvg, kAccDelta };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_ADADELTA_H_
