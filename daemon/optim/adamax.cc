#include "daemon/optim/adamax.h"

#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>

namespace rannc {

// State creation as torch/optim/adamax.py's step(), then _single_tensor_adamax line by line;
// keep it that way, since results are compared against PyTorch's to round-off.
void Adamax::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                       optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kExpAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.slots[kExpInf] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& exp_avg = state.slots[kExpAvg];
  at::Tensor& exp_inf = state.slots[kExpInf];

  state.step += 1;
  // PyTorch keeps the step as a float tensor and computes with its value as a Python float.
  const double step = static_cast<double>(state.step);

  if (hyper.weight_decay != 0) {
    grad = grad.add(param, hyper.weight_decay);
  }
  // Update biased first moment estimate.
  exp_avg.mul_(hyper.beta1).add_(grad, 1 - hyper.beta1);
  // Update the exponentially weighted infinity norm.
  const std::vector<at::Tensor> norm_parts = {exp_inf.mul_(hyper.beta2).unsqueeze(0),
                                              grad.abs().add_(hyper.eps).unsqueeze_(0)};
  const at::Tensor norm_buf = at::cat(norm_parts, 0);
  at::amax_out(exp_inf, norm_buf, {0}, /*keepdim=*/false);

  const double bias_correction = 1 - std::pow(hyper.beta1, step);
  const double clr = hyper.lr / bias_correction;
  param.addcdiv_(exp_avg, exp_inf, -clr);
}

}  // namespace rannc
