// SGD: PyTorch's torch.optim.SGD, single-tensor algorithm (weight decay, momentum with
// dampening, Nesterov, maximize). Private to //daemon/optim:optimizer; callers use
// MakeOptimizer(OptimizerKind::kSgd, ...). Thread-safety and lifetimes as Optimizer's.
#ifndef RANNC_DAEMON_OPTIM_SGD_H_
#define RANNC_DAEMON_OPTIM_SGD_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "daemon/optim/optimizer.h"

namespace rannc {

class Sgd final : public Optimizer {
 public:
  // `groups` must have passed the factory's checks.
  explicit Sgd(std::vector<ParamGroup> groups);

  absl::Status Step(const std::vector<HyperParams>& hypers) override;
  int64_t StateBytes() const override;
  OptimizerKind kind() const override { return OptimizerKind::kSgd; }
  std::vector<std::pair<std::string, at::Tensor>> NamedState() const override;
  absl::Status LoadNamedState(
      const std::vector<std::pair<std::string, at::Tensor>>& state) override;

 private:
  absl::Status StepGroup(ParamGroup& group, std::vector<at::Tensor>& buffers,
                         const HyperParams& hyper);

  std::vector<ParamGroup> groups_;
  // [group][param]; undefined until the param's first step with momentum != 0, as PyTorch's
  // momentum_buffer is None until then (so momentum switched on mid-training starts afresh).
  std::vector<std::vector<at::Tensor>> momentum_buffers_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_SGD_H_
