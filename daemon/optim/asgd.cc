#include "daemon/optim/asgd.h"

#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>

namespace rannc {

// State creation as torch/optim/asgd.py's step(), then _single_tensor_asgd line by line; keep
// it that way, since results are compared against PyTorch's to round-off.
void Asgd::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                     optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kEta] = optim_internal::ScalarState(hyper.lr);
    state.slots[kMu] = optim_internal::ScalarState(1.);
    state.slots[kAx] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  // 0-dim float32 tensors, as in PyTorch: their values are float32-rounded as there.
  at::Tensor& mu = state.slots[kMu];
  at::Tensor& eta = state.slots[kEta];
  at::Tensor& ax = state.slots[kAx];

  state.step += 1;
  // PyTorch keeps the step as a float tensor and computes with its value as a Python float.
  const double step = static_cast<double>(state.step);

  if (hyper.weight_decay != 0) {
    grad = grad.add(param, hyper.weight_decay);
  }
  // decay term
  param.mul_(1 - hyper.lambd * eta.item<double>());
  // update parameter
  param.add_(grad, -eta.item<double>());
  // averaging
  if (mu.item<double>() != 1) {
    ax.add_(param.sub(ax).mul(mu));
  } else {
    ax.copy_(param);
  }
  const double new_eta = hyper.lr / std::pow(1 + hyper.lambd * hyper.lr * step, hyper.alpha);
  eta.fill_(new_eta);
  const double new_mu = 1 / std::max(1., step - hyper.t0);
  mu.fill_(new_mu);
}

}  // namespace rannc
