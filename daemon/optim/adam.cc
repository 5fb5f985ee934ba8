#include "daemon/optim/adam.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros_like.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#endif

#include <cmath>
#include <map>
#include <tuple>

#include "daemon/common/status.h"
#include "daemon/optim/optimizer_internal.h"

namespace rannc {

Adam::Adam(OptimizerKind kind, std::vector<ParamGroup> groups)
    : kind_(kind), groups_(std::move(groups)) {
  for (const ParamGroup& group : groups_) {
    states_.emplace_back(group.params.size());
  }
}

absl::Status Adam::Step(const std::vector<HyperParams>& hypers) {
  absl::Status checked = optim_internal::CheckStepArgs(kind_, groups_, hypers);
  if (!checked.ok()) return checked;
  const char* context = kind_ == OptimizerKind::kAdamW ? "AdamW step" : "Adam step";
  return TorchCall(absl::StatusCode::kInternal, context, [&]() -> absl::Status {
    // Params are autograd leaves that require grad: in-place updates must not be recorded.
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < groups_.size(); ++g) {
      StepFused(groups_[g], states_[g], hypers[g]);
      StepGroup(groups_[g], states_[g], hypers[g]);
    }
    return absl::OkStatus();
  });
}

namespace {

// Creates the param's moments at its first step, and amsgrad's maximum once amsgrad is on.
template <typename State>
void InitState(const at::Tensor& param, bool amsgrad, State& state) {
  if (!state.exp_avg.defined()) {
    state.exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  if (amsgrad && !state.max_exp_avg_sq.defined()) {
    state.max_exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
}

}  // namespace

bool Adam::Fused(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR >= 2
  // The kernels walk flat memory: every tensor of a call dense, of one dtype and device.
  const at::Tensor& grad = param.grad();
  bool kernel = param.is_cuda();
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 4
  // PyTorch 2.4+ has the fused kernel on the CPU too (torch.optim.AdamW(fused=True) on CPU
  // tensors: one vectorized pass over parameter, gradient and both moments instead of about ten
  // elementwise passes with temporaries). Used for the pinned host masters of an offloaded CUDA
  // job (offload_params), whose optimizer steps on the host; a CPU job keeps the single-tensor
  // loop, op for op PyTorch's default on CPU.
  kernel = kernel || (param.is_cpu() && at::hasCUDA() && param.is_pinned());
#endif
  return kernel && at::isFloatingType(param.scalar_type()) && param.is_contiguous() &&
         grad.defined() && grad.is_contiguous() && grad.scalar_type() == param.scalar_type() &&
         grad.device() == param.device();
#else
  return false;
#endif
}

// PyTorch's _fused_adamw / _fused_adam (torch/optim/adam.py with fused=True): the parameters
// of one device and dtype in one call, with the step counts as device tensors.
void Adam::StepFused(ParamGroup& group, std::vector<ParamState>& states,
                     const HyperParams& hyper) {
#if TORCH_VERSION_MAJOR >= 2
  struct Batch {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  };
  std::map<std::tuple<int, int, at::ScalarType>, Batch> batches;  // (device type, index, dtype)
  for (size_t i = 0; i < group.params.size(); ++i) {
    at::Tensor& param = group.params[i];
    if (!Fused(param)) continue;
    ParamState& state = states[i];
    InitState(param, hyper.amsgrad, state);
    if (!state.device_step.defined()) {
      state.device_step = at::scalar_tensor(static_cast<double>(state.step),
                                            param.options().dtype(at::kFloat));
    }
    state.step += 1;
    Batch& b = batches[{static_cast<int>(param.device().type()), param.device().index(),
                        param.scalar_type()}];
    b.params.push_back(param);
    b.grads.push_back(param.grad());
    b.exp_avgs.push_back(state.exp_avg);
    b.exp_avg_sqs.push_back(state.exp_avg_sq);
    if (hyper.amsgrad) b.max_exp_avg_sqs.push_back(state.max_exp_avg_sq);
    b.steps.push_back(state.device_step);
  }
  for (auto& [key, b] : batches) {
    at::_foreach_add_(b.steps, at::Scalar(1));
    if (kind_ == OptimizerKind::kAdamW) {
      at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                        hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay, hyper.eps,
                        hyper.amsgrad, hyper.maximize);
    } else {
      at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                       hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay, hyper.eps,
                       hyper.amsgrad, hyper.maximize);
    }
  }
#endif
}

// Mirrors torch/optim/adam.py:_single_tensor_adam and adamw.py:_single_tensor_adamw (the
// non-capturable branch) line by line; keep it that way, since results are compared against
// PyTorch's to round-off.
void Adam::StepGroup(ParamGroup& group, std::vector<ParamState>& states, const HyperParams& hyper) {
  const bool decoupled = kind_ == OptimizerKind::kAdamW;
  for (size_t i = 0; i < group.params.size(); ++i) {
    at::Tensor& param = group.params[i];
    if (!param.grad().defined() || Fused(param)) continue;
    ParamState& state = states[i];
    InitState(param, hyper.amsgrad, state);

    at::Tensor grad = hyper.maximize ? param.grad().neg() : param.grad();
    state.step += 1;

    if (decoupled) {
      // Multiplying by exactly 1 changes nothing, so skipping it keeps PyTorch's result.
      if (hyper.weight_decay != 0) param.mul_(1 - hyper.lr * hyper.weight_decay);
    } else if (hyper.weight_decay != 0) {
      grad = grad.add(param, hyper.weight_decay);
    }

    state.exp_avg.mul_(hyper.beta1).add_(grad, 1 - hyper.beta1);
    state.exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, 1 - hyper.beta2);

    // PyTorch keeps the step as a float tensor and computes these in Python floats (double).
    const double step = static_cast<double>(state.step);
    const double bias_correction1 = 1 - std::pow(hyper.beta1, step);
    const double bias_correction2 = 1 - std::pow(hyper.beta2, step);
    const double step_size = hyper.lr / bias_correction1;
    const double bias_correction2_sqrt = std::sqrt(bias_correction2);

    at::Tensor denom;
    if (hyper.amsgrad) {
      at::maximum_out(state.max_exp_avg_sq, state.max_exp_avg_sq, state.exp_avg_sq);
      denom = state.max_exp_avg_sq.sqrt().div(bias_correction2_sqrt).add_(hyper.eps);
    } else {
      denom = state.exp_avg_sq.sqrt().div(bias_correction2_sqrt).add_(hyper.eps);
    }
    param.addcdiv_(state.exp_avg, denom, -step_size);
  }
}

int64_t Adam::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& group : states_) {
    for (const ParamState& state : group) {
      for (const at::Tensor* t : {&state.exp_avg, &state.exp_avg_sq, &state.max_exp_avg_sq}) {
        if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> Adam::NamedState() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  int64_t index = 0;
  for (const auto& group : states_) {
    for (const ParamState& state : group) {
      const std::string prefix = std::to_string(index++) + ".";
      if (!state.exp_avg.defined()) continue;
      named.emplace_back(prefix + "step",
                         at::scalar_tensor(static_cast<double>(state.step), at::kFloat));
      named.emplace_back(prefix + "exp_avg", state.exp_avg);
      named.emplace_back(prefix + "exp_avg_sq", state.exp_avg_sq);
      if (state.max_exp_avg_sq.defined()) {
        named.emplace_back(prefix + "max_exp_avg_sq", state.max_exp_avg_sq);
      }
    }
  }
  return named;
}

absl::Status Adam::LoadNamedState(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::vector<std::vector<ParamState>> states;
  for (const ParamGroup& group : groups_) states.emplace_back(group.params.size());
  for (const auto& [name, value] : state) {
    absl::StatusOr<optim_internal::StateEntryRef> ref =
        optim_internal::ParseStateEntry(groups_, name, value, OptimizerStateKeys(kind_));
    if (!ref.ok()) return ref.status();
    ParamState& s = states[ref->group][ref->param];
    const at::Tensor& param = groups_[ref->group].params[ref->param];
    if (ref->key == "step") {
      s.step = static_cast<int64_t>(value.item<double>());
      continue;
    }
    at::Tensor copy = value.detach().to(param.options()).clone();
    if (ref->key == "exp_avg") s.exp_avg = copy;
    if (ref->key == "exp_avg_sq") s.exp_avg_sq = copy;
    if (ref->key == "max_exp_avg_sq") s.max_exp_avg_sq = copy;
  }
  for (const auto& group : states) {
    for (const ParamState& s : group) {
      if (s.exp_avg.defined() != s.exp_avg_sq.defined()) {
        return absl::InvalidArgumentError("optimizer state has exp_avg without exp_avg_sq or "
                                          "the reverse");
      }
    }
  }
  states_ = std::move(states);
  return absl::OkStatus();
}

}  // namespace rannc
