// The two halves of torch.nn.utils.clip_grad_norm_ (PyTorch 1.13), op for op so results equal
// PyTorch's to round-off: the total norm of a set of gradients, and the factor that clips them.
// Shared by a job's host copy and the pipeline engine, which takes each parameter's gradient
// once wherever it lives and scales every copy. Free functions, safe from any thread.
#ifndef RANNC_DAEMON_OPTIM_GRAD_NORM_H_
#define RANNC_DAEMON_OPTIM_GRAD_NORM_H_

#include <vector>

#include <ATen/core/Tensor.h>

namespace rannc {

// The `norm_type` norm (inf: the largest absolute value) of `grads` taken together: each
// gradient's norm, then the norm of those. `grads` must not be empty.
at::Tensor TotalGradNorm(const std::vector<at::Tensor>& grads, double norm_type);

// The two steps of TotalGradNorm, for gradients spread over processes: one gradient's norm (a
// scalar), and the total norm of gradients whose norms these are (`norms` not empty).
at::Tensor GradNorm(const at::Tensor& grad, double norm_type);
at::Tensor CombineNorms(const std::vector<at::Tensor>& norms, double norm_type);

// min(1, max_norm / (total_norm + 1e-6)): what the gradients are multiplied by.
at::Tensor ClipCoefficient(const at::Tensor& total_norm, double max_norm);

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_GRAD_NORM_H_
