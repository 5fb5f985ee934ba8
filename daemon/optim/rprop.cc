#include "daemon/optim/rprop.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

namespace rannc {

// State creation as torch/optim/rprop.py's step(), then _single_tensor_rprop line by line;
// keep it that way, since results are compared against PyTorch's to round-off.
void Rprop::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                      optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kPrev] = at::zeros_like(param, at::MemoryFormat::Preserve);
    // PyTorch: grad.new().resize_as_(grad).fill_(group['lr']).
    state.slots[kStepSize] = at::empty(grad_in.sizes(), grad_in.options()).fill_(hyper.lr);
  }
  state.step += 1;

  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& prev = state.slots[kPrev];
  at::Tensor& step_size = state.slots[kStepSize];

  // PyTorch's `sign[mask] = value` stores value in sign's dtype, as masked_fill_ does.
  const at::Tensor sign = grad.mul(prev).sign();
  sign.masked_fill_(sign.gt(0), hyper.etaplus);
  sign.masked_fill_(sign.lt(0), hyper.etaminus);
  sign.masked_fill_(sign.eq(0), 1);

  // update stepsizes with step size updates
  step_size.mul_(sign).clamp_(hyper.step_size_min, hyper.step_size_max);

  // for dir<0, dfdx=0
  // for dir>=0 dfdx=dfdx
  grad = grad.clone(at::MemoryFormat::Preserve);
  grad.masked_fill_(sign.eq(hyper.etaminus), 0);

  // update parameters
  param.addcmul_(grad.sign(), step_size, -1);
  prev.copy_(grad);
}

}  // namespace rannc
