#include "daemon/optim/grad_norm.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace rannc {

at::Tensor TotalGradNorm(const std::vector<at::Tensor>& grads, double norm_type) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  if (std::isinf(norm_type)) {
    for (const at::Tensor& g : grads) norms.push_back(g.detach().abs().max());
    return norms.size() == 1 ? norms[0] : at::stack(norms).max();
  }
  for (const at::Tensor& g : grads) norms.push_back(at::norm(g.detach(), norm_type));
  return at::norm(at::stack(norms), norm_type);
}

at::Tensor ClipCoefficient(const at::Tensor& total_norm, double max_norm) {
  at::NoGradGuard no_grad;
  return at::clamp_max(max_norm / (total_norm + 1e-6), 1.0);
}

}  // namespace rannc
