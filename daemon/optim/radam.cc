#include "daemon/optim/radam.h"

#include <ATen/ops/zeros_like.h>

#include <cmath>

namespace rannc {

// State creation as torch/optim/radam.py's step(), then 1.13's _single_tensor_radam line by
// line, with 2.x's maximize (negating the grad first) and decoupled weight decay (in place of
// the L2 term); keep it that way, since results are compared against PyTorch's to round-off.
void RAdam::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                      optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kExpAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.slots[kExpAvgSq] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& exp_avg = state.slots[kExpAvg];
  at::Tensor& exp_avg_sq = state.slots[kExpAvgSq];

  state.step += 1;
  // PyTorch keeps the step as a float tensor and computes with its value as a Python float.
  const double step = static_cast<double>(state.step);
  const double beta1 = hyper.beta1, beta2 = hyper.beta2, lr = hyper.lr;

  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);

  if (hyper.weight_decay != 0) {
    if (hyper.decoupled_weight_decay) {
      param.mul_(1 - lr * hyper.weight_decay);
    } else {
      grad = grad.add(param, hyper.weight_decay);
    }
  }

  // Decay the first and second moment running average coefficient
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);

  // correcting bias for the first moving moment
  const at::Tensor bias_corrected_exp_avg = exp_avg.div(bias_correction1);

  // maximum length of the approximated SMA
  const double rho_inf = 2 / (1 - beta2) - 1;
  // compute the length of the approximated SMA
  const double rho_t = rho_inf - 2 * step * std::pow(beta2, step) / bias_correction2;

  if (rho_t > 5.) {
    // Compute the variance rectification term and update parameters accordingly
    const double rect =
        std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t));
    // PyTorch's `math.sqrt(bias_correction2) / tensor` is Tensor.__rtruediv__, which takes the
    // reciprocal and multiplies (rounding differently from a division).
    const at::Tensor adaptive_lr =
        exp_avg_sq.sqrt().add_(hyper.eps).reciprocal().mul(std::sqrt(bias_correction2));
    param.add_(bias_corrected_exp_avg.mul(lr).mul(adaptive_lr).mul(rect), -1.0);
  } else {
    param.add_(bias_corrected_exp_avg.mul(lr), -1.0);
  }
}

}  // namespace rannc
