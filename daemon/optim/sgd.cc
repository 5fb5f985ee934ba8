#include "daemon/optim/sgd.h"

#include <ATen/core/grad_mode.h>

#include "daemon/common/status.h"
#include "daemon/optim/optimizer_internal.h"

namespace rannc {

Sgd::Sgd(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
  for (const ParamGroup& group : groups_) {
    momentum_buffers_.emplace_back(group.params.size());
  }
}

absl::Status Sgd::Step(const std::vector<HyperParams>& hypers) {
  absl::Status checked = optim_internal::CheckStepArgs(kind(), groups_, hypers);
  if (!checked.ok()) return checked;
  return TorchCall(absl::StatusCode::kInternal, "SGD step", [&]() -> absl::Status {
    // Params are autograd leaves that require grad: in-place updates must not be recorded.
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < groups_.size(); ++g) {
      absl::Status status = StepGroup(groups_[g], momentum_buffers_[g], hypers[g]);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  });
}

// Mirrors torch/optim/sgd.py:_single_tensor_sgd line by line; keep it that way, since results
// are compared against PyTorch's to round-off.
absl::Status Sgd::StepGroup(ParamGroup& group, std::vector<at::Tensor>& buffers,
                            const HyperParams& hyper) {
  for (size_t i = 0; i < group.params.size(); ++i) {
    at::Tensor& param = group.params[i];
    const at::Tensor& grad = param.grad();
    if (!grad.defined()) continue;

    at::Tensor d_p = hyper.maximize ? grad.neg() : grad;
    if (hyper.weight_decay != 0) {
      d_p = d_p.add(param, hyper.weight_decay);
    }
    if (hyper.momentum != 0) {
      at::Tensor& buf = buffers[i];
      if (!buf.defined()) {
        buf = d_p.clone().detach();
      } else {
        buf.mul_(hyper.momentum).add_(d_p, 1 - hyper.dampening);
      }
      if (hyper.nesterov) {
        d_p = d_p.add(buf, hyper.momentum);
      } else {
        d_p = buf;
      }
    }
    param.add_(d_p, -hyper.lr);
  }
  return absl::OkStatus();
}

int64_t Sgd::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& group : momentum_buffers_) {
    for (const at::Tensor& buf : group) {
      if (buf.defined()) bytes += static_cast<int64_t>(buf.nbytes());
    }
  }
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> Sgd::NamedState() const {
  std::vector<std::pair<std::string, at::Tensor>> state;
  int64_t index = 0;
  for (const auto& group : momentum_buffers_) {
    for (const at::Tensor& buf : group) {
      if (buf.defined()) {
        state.emplace_back(std::to_string(index) + ".momentum_buffer", buf);
      }
      ++index;
    }
  }
  return state;
}

absl::Status Sgd::LoadNamedState(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::vector<std::vector<at::Tensor>> buffers;
  for (const ParamGroup& group : groups_) buffers.emplace_back(group.params.size());
  for (const auto& [name, value] : state) {
    absl::StatusOr<optim_internal::StateEntryRef> ref =
        optim_internal::ParseStateEntry(groups_, name, value, OptimizerStateKeys(kind()));
    if (!ref.ok()) return ref.status();
    const at::Tensor& param = groups_[ref->group].params[ref->param];
    buffers[ref->group][ref->param] = value.detach().to(param.options()).clone();
  }
  momentum_buffers_ = std::move(buffers);
  return absl::OkStatus();
}

}  // namespace rannc
