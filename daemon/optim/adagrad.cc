#include "daemon/optim/adagrad.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/sparse_coo_tensor.h>

namespace rannc {

// torch/optim/adagrad.py's constructor, per param.
void Adagrad::InitEagerState(const at::Tensor& param, optim_internal::ParamState& state,
                             const HyperParams& hyper) {
  state.present = true;
  state.step = 0;
  state.slots[kSum] =
      at::full_like(param, hyper.initial_accumulator_value, at::MemoryFormat::Preserve);
}

// Mirrors torch/optim/adagrad.py:_single_tensor_adagrad line by line, sparse branch included;
// keep it that way, since results are compared against PyTorch's to round-off. Sparse grads
// with weight decay were rejected by CheckStepArgs, as PyTorch raises for them.
void Adagrad::StepParam(at::Tensor& param, const at::Tensor& grad_in,
                        optim_internal::ParamState& state, const HyperParams& hyper) {
  if (!state.present) InitEagerState(param, state, hyper);  // the factory created it already
  at::Tensor& state_sum = state.slots[kSum];

  state.step += 1;
  // PyTorch keeps the step as a float tensor and computes with its value as a Python float.
  const double step = static_cast<double>(state.step);

  at::Tensor grad = hyper.maximize ? grad_in.neg() : grad_in;
  if (hyper.weight_decay != 0) {
    grad = grad.add(param, hyper.weight_decay);
  }
  const double clr = hyper.lr / (1 + (step - 1) * hyper.lr_decay);

  if (grad.is_sparse()) {
    grad = grad.coalesce();  // the update is non-linear so indices must be unique
    const at::Tensor grad_indices = grad._indices();
    const at::Tensor grad_values = grad._values();
    // A grad without entries changes nothing. (PyTorch 1.13 fails on one with dense dimensions:
    // sparse_mask then returns values without them.)
    if (grad_values.numel() == 0) return;
    auto make_sparse = [&](const at::Tensor& values) {
      if (grad_indices.numel() == 0 || values.numel() == 0) return at::empty_like(grad);
      return at::sparse_coo_tensor(grad_indices, values, grad.sizes());
    };
    state_sum.add_(make_sparse(grad_values.pow(2)));
    const at::Tensor std = state_sum.sparse_mask(grad);
    const at::Tensor std_values = std._values().sqrt_().add_(hyper.eps);
    param.add_(make_sparse(grad_values.div(std_values)), -clr);
  } else {
    state_sum.addcmul_(grad, grad, 1);
    const at::Tensor std = state_sum.sqrt().add_(hyper.eps);
    param.addcdiv_(grad, std, -clr);
  }
}

}  // namespace rannc
