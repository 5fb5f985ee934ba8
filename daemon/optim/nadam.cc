#include "daemon/optim/nadam.h"

#include <ATen/ops/zeros_like.h>
#include <torch/version.h>

#include <cmath>

namespace rannc {

// State creation as torch/optim/nadam.py's step(), then _single_tensor_nadam line by line
// (1.13's, or 2.x's where they differ), with 2.x's maximize (negating the grad first) and
// decoupled weight decay (in place of the L2 term); keep it that way, since results are compared
// against PyTorch's to round-off.
void NAdam::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                      optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kMuProduct] = optim_internal::ScalarState(1.);
    state.slots[kExpAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.slots[kExpAvgSq] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& exp_avg = state.slots[kExpAvg];
  at::Tensor& exp_avg_sq = state.slots[kExpAvgSq];
  // A 0-dim float32 tensor, as in PyTorch: its products round to float32 as there.
  at::Tensor& mu_product = state.slots[kMuProduct];

  state.step += 1;
  // PyTorch keeps the step as a float tensor and computes with its value as a Python float.
  const double step = static_cast<double>(state.step);
  const double beta1 = hyper.beta1, beta2 = hyper.beta2, lr = hyper.lr;

  const double bias_correction2 = 1 - std::pow(beta2, step);

  if (hyper.weight_decay != 0) {
    if (hyper.decoupled_weight_decay) {
      param.mul_(1 - lr * hyper.weight_decay);
    } else {
      grad = grad.add(param, hyper.weight_decay);
    }
  }

  // calculate the momentum cache \mu^{t} and \mu^{t+1}
  const double mu = beta1 * (1. - 0.5 * std::pow(0.96, step * hyper.momentum_decay));
  const double mu_next = beta1 * (1. - 0.5 * std::pow(0.96, (step + 1) * hyper.momentum_decay));

  // update mu_product
  mu_product.mul_(mu);
#if TORCH_VERSION_MAJOR >= 2
  // PyTorch 2.x: mu_product_next = _get_value(mu_product) * mu_next, a Python float.
  const double mu_product_next = mu_product.item<double>() * mu_next;

  // decay the first and second moment running average coefficient
  exp_avg.lerp_(grad, 1 - beta1);
#else
  // PyTorch 1.13 multiplies by mu twice (fixed in 2.0).
  const double mu_product_next = mu_product.mul(mu).mul(mu_next).item<double>();

  // decay the first and second moment running average coefficient
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
#endif
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);

  const at::Tensor denom = exp_avg_sq.div(bias_correction2).sqrt().add_(hyper.eps);
  param.addcdiv_(grad, denom, -lr * (1. - mu) / (1. - mu_product.item<double>()));
  param.addcdiv_(exp_avg, denom, -lr * mu_next / (1. - mu_product_next));
}

}  // namespace rannc
