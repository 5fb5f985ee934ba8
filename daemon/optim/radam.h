// RAdam: PyTorch 1.13's torch.optim.RAdam, single-tensor algorithm (betas, eps, weight decay),
// with PyTorch 2.x's maximize and decoupled_weight_decay (RAdamW: the param is multiplied by
// 1 - lr * weight_decay where 1.13 adds the L2 term).
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kRAdam, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_RADAM_H_
#define RANNC_DAEMON_OPTIM_RADAM_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class RAdam final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {{"exp_avg", false}, {"exp_avg_sq", false}};

  // `groups` must have passed the factory's checks.
  explicit RAdam(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kRAdam, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kExpAvg, kExpAvgSq };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_RADAM_H_
