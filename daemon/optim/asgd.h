// ASGD: PyTorch's torch.optim.ASGD (averaged SGD), single-tensor algorithm (lambd, alpha, t0,
// weight decay, maximize). `ax` is the running average of the param from step t0 on; `eta` and
// `mu` are per-param scalars recomputed after every step from lr, lambd, alpha and t0.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kAsgd, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_ASGD_H_
#define RANNC_DAEMON_OPTIM_ASGD_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Asgd final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {
      {"eta", false}, {"mu", false}, {"ax", false}};

  // `groups` must have passed the factory's checks.
  explicit Asgd(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kAsgd, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kEta, kMu, kAx };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_ASGD_H_
