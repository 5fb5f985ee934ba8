// Adagrad: PyTorch's torch.optim.Adagrad, single-tensor algorithm (lr decay, weight decay,
// initial accumulator value, eps, maximize), for dense and sparse grads. As in PyTorch, every
// param's state (step 0, `sum` filled with initial_accumulator_value) exists from construction,
// whether or not it ever gets a grad. One departure: `sum` starts from its own group's
// initial_accumulator_value; PyTorch 1.13 fills every group's from the constructor's argument,
// ignoring a group's own (the same when no group sets its own). And a sparse grad without
// entries only advances the step; 1.13 fails on one that has dense dimensions.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer(OptimizerKind::kAdagrad, ...).
// Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_ADAGRAD_H_
#define RANNC_DAEMON_OPTIM_ADAGRAD_H_

#include <iterator>
#include <utility>
#include <vector>

#include "daemon/optim/slot_optimizer.h"

namespace rannc {

class Adagrad final : public optim_internal::SlotOptimizer {
 public:
  // The state keys after "step", in torch.optim's order; Slot indexes them.
  static constexpr optim_internal::SlotSpec kSlots[] = {{"sum", false}};

  // `groups` must have passed the factory's checks.
  explicit Adagrad(std::vector<ParamGroup> groups)
      : SlotOptimizer(OptimizerKind::kAdagrad, std::move(groups),
                      {std::begin(kSlots), std::end(kSlots)}) {}

 private:
  enum Slot { kSum };

  void StepParam(at::Tensor& param, const at::Tensor& grad, optim_internal::ParamState& state,
                 const HyperParams& hyper) override;
  void InitEagerState(const at::Tensor& param, optim_internal::ParamState& state,
                      const HyperParams& hyper) override;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_ADAGRAD_H_
