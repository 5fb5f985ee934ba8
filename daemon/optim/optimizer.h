// Optimizers that the daemon runs itself: SGD, Adam and AdamW with PyTorch's exact semantics.
//
// Owns: per-parameter optimizer state (momentum buffers, Adam moments, step counts). The
// optimizer holds handles to the parameter tensors it was given and updates them in place, so
// the model that owns the same tensors sees the new values; the state lives as long as the
// Optimizer. Nothing here talks to the network or to other devices: ZeRO sharding, offload and
// mixed precision wrap an Optimizer rather than change it.
//
// Semantics: each implementation follows PyTorch's single-tensor (non-foreach) algorithm of
// torch/optim/{sgd,adam,adamw}.py op for op, so results equal torch.optim's to fp32 round-off
// (the tests compare against LibTorch's torch::optim, which ports the same algorithms). The
// hyper-parameters of a step are passed to Step(), not stored: an lr schedule or a manual
// `group['lr'] = x` on the client becomes a different `hypers` on the next Step.
//
// Thread-safety: an Optimizer is not thread-safe. One thread at a time may call its methods,
// and no other thread may read or write its parameters or their grads during Step(). Different
// Optimizer objects (e.g. one per pipeline stage) may step concurrently on different threads.
//
// Usage:
//   std::vector<rannc::ParamGroup> groups = {{stage_params, hyper}};
//   ASSIGN_OR_RETURN(auto opt, rannc::MakeOptimizer(rannc::OptimizerKind::kAdamW, groups));
//   ... forward/backward fills each param's grad() ...
//   hyper.lr = scheduler_lr;
//   RETURN_IF_ERROR(opt->Step({hyper}));
#ifndef RANNC_DAEMON_OPTIM_OPTIMIZER_H_
#define RANNC_DAEMON_OPTIM_OPTIMIZER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {

// Hyper-parameters of one param group, with PyTorch's names, meanings and defaults (those of
// torch.optim.Adam where SGD has none). Fields a kind does not use are ignored; the proto's
// rannc.v1.HyperParams carries the same fields.
struct HyperParams {
  double lr = 1e-3;         // learning rate (unitless); >= 0
  double weight_decay = 0;  // L2 penalty (SGD, Adam) or decoupled decay rate (AdamW); >= 0
  // SGD
  double momentum = 0;    // momentum factor; >= 0; 0 = no momentum buffer
  double dampening = 0;   // dampening of the momentum update
  bool nesterov = false;  // Nesterov momentum; needs momentum > 0 and dampening == 0
  // Adam / AdamW
  double beta1 = 0.9;    // decay of the first-moment average; in [0, 1)
  double beta2 = 0.999;  // decay of the second-moment average; in [0, 1)
  double eps = 1e-8;     // added to the denominator; >= 0
  bool amsgrad = false;  // use the running maximum of the second moment
  // All
  bool maximize = false;  // ascend instead of descend
};

enum class OptimizerKind { kSgd, kAdam, kAdamW };

// "sgd", "adam", "adamw": for messages and logs.
const char* OptimizerKindName(OptimizerKind kind);

// Parameters that share hyper-parameters (PyTorch's param_groups entry). A group may be empty
// (unlike in PyTorch): a pipeline stage may hold none of a group's params.
struct ParamGroup {
  std::vector<at::Tensor> params;
  HyperParams hyper;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // One step over every param whose grad() is defined, using `hypers[i]` for group i; params
  // with an undefined grad are skipped and their state is neither created nor advanced, as
  // PyTorch skips grad=None. The step count is per parameter (PyTorch's state['step']).
  // INVALID_ARGUMENT, before anything is updated, if hypers.size() differs from the number of
  // groups, a hyper-parameter fails ValidateHyperParams, or a grad's shape or dtype differs
  // from its param's. UNIMPLEMENTED for grads that the kind cannot handle (sparse or complex for
  // Adam/AdamW, as PyTorch). An error raised by LibTorch mid-step (e.g. out of memory) comes
  // back as a Status and may leave the step partly applied.
  virtual absl::Status Step(const std::vector<HyperParams>& hypers) = 0;

  // Bytes of the state tensors held now (not counting the params, their grads, or the step
  // counters). Grows as params get their first grad.
  virtual int64_t StateBytes() const = 0;

  virtual OptimizerKind kind() const = 0;

  // The state held now, for checkpoints: one entry per (param, key) with PyTorch's
  // state_dict naming, "<index>.<key>", where <index> numbers params across all groups in order
  // (as PyTorch's optimizer.state_dict()['state']) and <key> is one of momentum_buffer (SGD),
  // step, exp_avg, exp_avg_sq, max_exp_avg_sq (Adam/AdamW). `step` is a 0-dim float32 CPU tensor
  // as in PyTorch 1.13. The tensors are the live state, not copies: clone them before the next
  // Step if they must not change.
  virtual std::vector<std::pair<std::string, at::Tensor>> NamedState() const = 0;

  // Replaces the state with `state`, in NamedState's naming (params without entries start
  // afresh). The tensors are copied. INVALID_ARGUMENT, before anything changes, for an unknown
  // key, an index past the params, or a shape that differs from its param's.
  virtual absl::Status LoadNamedState(
      const std::vector<std::pair<std::string, at::Tensor>>& state) = 0;
};

// Creates an optimizer over `groups`. INVALID_ARGUMENT, naming the group and param index, if a
// group's hyper-parameters fail ValidateHyperParams, a param is undefined or not an autograd
// leaf (PyTorch: "can't optimize a non-leaf Tensor"), or a param appears twice. UNIMPLEMENTED
// for complex params with Adam/AdamW.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(OptimizerKind kind,
                                                         std::vector<ParamGroup> groups);

// PyTorch's constructor checks for `kind`: lr >= 0, weight_decay >= 0; SGD: momentum >= 0,
// nesterov needs momentum > 0 and dampening == 0; Adam/AdamW: 0 <= beta1, beta2 < 1, eps >= 0.
// NaN fails every range check, as in PyTorch. INVALID_ARGUMENT naming the field and its value.
absl::Status ValidateHyperParams(OptimizerKind kind, const HyperParams& hyper);

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_OPTIMIZER_H_
