// Adam and AdamW: PyTorch's torch.optim.Adam and torch.optim.AdamW, single-tensor algorithm
// (bias corrections, amsgrad, maximize). They differ only in weight decay: Adam adds
// weight_decay * param to the grad (L2), AdamW multiplies the param by 1 - lr * weight_decay
// (decoupled). Private to //daemon/optim:optimizer; callers use MakeOptimizer. Thread-safety and
// lifetimes as Optimizer's.
//
// On CUDA (LibTorch 2.x) the parameters of a group step through PyTorch's fused kernels
// (torch.optim.AdamW(fused=True): at::_fused_adamw_ / _fused_adam_), one launch per device and
// dtype instead of ten per parameter. Results equal the single-tensor algorithm's to fp32
// round-off; the unfused loop made a 1.34B-parameter step ~25 ms slower on an H200. With
// LibTorch 2.4+ the same holds for pinned CPU parameters on a machine with CUDA: the host masters
// of an offloaded job, stepped by PyTorch's fused CPU kernel.
//
// One departure: if amsgrad is switched on after a param's first step, PyTorch fails (its
// max_exp_avg_sq was never created); here max_exp_avg_sq starts at zeros then, which makes the
// first amsgrad step equal to a plain Adam step.
#ifndef RANNC_DAEMON_OPTIM_ADAM_H_
#define RANNC_DAEMON_OPTIM_ADAM_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "daemon/optim/optimizer.h"

namespace rannc {

class Adam final : public Optimizer {
 public:
  // `kind` is kAdam or kAdamW; `groups` must have passed the factory's checks.
  Adam(OptimizerKind kind, std::vector<ParamGroup> groups);

  absl::Status Step(const std::vector<HyperParams>& hypers) override;
  int64_t StateBytes() const override;
  OptimizerKind kind() const override { return kind_; }
  std::vector<std::pair<std::string, at::Tensor>> NamedState() const override;
  absl::Status LoadNamedState(
      const std::vector<std::pair<std::string, at::Tensor>>& state) override;

  // True when `param` (which has a gradient) steps through the fused kernels. Public for
  // optimizer_cuda_test, which checks the kernel it compares is the one taken.
  static bool Fused(const at::Tensor& param);

 private:
  // PyTorch's per-param state dict. Empty (exp_avg undefined) until the param's first grad.
  struct ParamState {
    int64_t step = 0;
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
    at::Tensor max_exp_avg_sq;  // only once amsgrad has been on
    at::Tensor device_step;     // the fused kernels' copy of `step`: 0-dim fp32 on the device
  };

  void StepFused(ParamGroup& group, std::vector<ParamState>& states, const HyperParams& hyper);

  void StepGroup(ParamGroup& group, std::vector<ParamState>& states, const HyperParams& hyper);

  OptimizerKind kind_;
  std::vector<ParamGroup> groups_;
  std::vector<std::vector<ParamState>> states_;  // [group][param]
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_ADAM_H_
