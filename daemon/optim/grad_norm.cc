#include "daemon/optim/grad_norm.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace rannc {

at::Tensor GradNorm(const at::Tensor& grad, double norm_type) {
  at::NoGradGuard no_grad;
  if (std::isinf(norm_type)) return grad.detach().abs().max();
  return at::norm(grad.detach(), norm_type);
}

at::Tensor CombineNorms(const std::vector<at::Tensor>& norms, double norm_type) {
  at::NoGradGuard no_grad;
  if (std::isinf(norm_type)) return norms.size() == 1 ? norms[0] : at::stack(norms).max();
  return at::norm(at::stack(norms), norm_type);
}

at::Tensor TotalGradNorm(const std::vector<at::Tensor>& grads, double norm_type) {
  std::vector<at::Tensor> norms;
  for (const at::Tensor& g : grads) norms.push_back(GradNorm(g, norm_type));
  return CombineNorms(norms, norm_type);
}

at::Tensor ClipCoefficient(const at::Tensor& total_norm, double max_norm) {
  at::NoGradGuard no_grad;
  return at::clamp_max(max_norm / (total_norm + 1e-6), 1.0);
}

}  // namespace rannc
