#include "daemon/optim/adadelta.h"

#include <ATen/ops/zeros_like.h>

namespace rannc {

// State creation as torch/optim/adadelta.py's step(), then _single_tensor_adadelta line by
// line; keep it that way, since results are compared against PyTorch's to round-off.
void Adadelta::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                         optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kSquareAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.slots[kAccDelta] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  state.step += 1;

  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& square_avg = state.slots[kSquareAvg];
  at::Tensor& acc_delta = state.slots[kAccDelta];
  if (hyper.weight_decay != 0) {
    grad = grad.add(param, hyper.weight_decay);
  }
  square_avg.mul_(hyper.rho).addcmul_(grad, grad, 1 - hyper.rho);
  const at::Tensor std = square_avg.add(hyper.eps).sqrt_();
  const at::Tensor delta = acc_delta.add(hyper.eps).sqrt_().div_(std).mul_(grad);
  acc_delta.mul_(hyper.rho).addcmul_(delta, delta, 1 - hyper.rho);
  param.add_(delta, -hyper.lr);
}

}  // namespace rannc
