// NAdam: PyTorch 1.13's torch.optim.NAdam, single-tensor algorithm (betas, eps, weight decay,
// momentum decay), with PyTorch 2.x's maximize and decoupled_weight_decay (NAdamW: the param is
// multiplied by 1 - lr * weight_decay where 1.13 adds the L2 term). Built against LibTorch 2.x
// it is 2.x's instead (the client's PyTorch has the daemon's major version): 1.13's
// mu_product_next = mu_product * mu * mu_next multiplies by mu twice, which 2.0 fixed, and 2.x
// moves exp_avg with lerp_.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kNAdam, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_NADAM_H_
#define RANNC_DAEMON_OPTIM_NADAM_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class NAdam final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {
      {"mu_product", false}, {"exp_avg", false}, {"exp_avg_sq", false}};

  // `groups` must have passed the factory's checks.
  explicit NAdam(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kNAdam, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kMuProduct, kExpAvg, kExpAvgSq };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_NADAM_H_
