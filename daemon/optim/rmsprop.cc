#include "daemon/optim/rmsprop.h"

#include <ATen/ops/zeros_like.h>

namespace rannc {

// State creation as torch/optim/rmsprop.py's step(), then _single_tensor_rmsprop line by line;
// keep it that way, since results are compared against PyTorch's to round-off.
void Rmsprop::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                        optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) {
    state.present = true;
    state.step = 0;
    state.slots[kSquareAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  // PyTorch creates these only at the first step (and fails later without them).
  if (hyper.momentum > 0 && !state.slots[kMomentumBuffer].defined()) {
    state.slots[kMomentumBuffer] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  if (hyper.centered && !state.slots[kGradAvg].defined()) {
    state.slots[kGradAvg] = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  state.step += 1;

  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  at::Tensor& square_avg = state.slots[kSquareAvg];
  if (hyper.weight_decay != 0) {
    grad = grad.add(param, hyper.weight_decay);
  }
  square_avg.mul_(hyper.alpha).addcmul_(grad, grad, 1 - hyper.alpha);

  at::Tensor avg;
  if (hyper.centered) {
    at::Tensor& grad_avg = state.slots[kGradAvg];
    grad_avg.mul_(hyper.alpha).add_(grad, 1 - hyper.alpha);
    avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_();
  } else {
    avg = square_avg.sqrt();
  }
  avg = avg.add_(hyper.eps);

  if (hyper.momentum > 0) {
    at::Tensor& buf = state.slots[kMomentumBuffer];
    buf.mul_(hyper.momentum).addcdiv_(grad, avg);
    param.add_(buf, -hyper.lr);
  } else {
    param.addcdiv_(grad, avg, -hyper.lr);
  }
}

}  // namespace rannc
