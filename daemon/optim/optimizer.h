// Optimizers that the daemon runs itself, with PyTorch's exact semantics: SGD, Adam, AdamW,
// RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD and Rprop; and optimizers torch.optim
// lacks, whose per-param update the user writes as a TorchScript function (ScriptedUpdate).
//
// Owns: per-parameter optimizer state (momentum buffers, moments, accumulators, step counts).
// The optimizer holds handles to the parameter tensors it was given and updates them in place,
// so the model that owns the same tensors sees the new values; the state lives as long as the
// Optimizer. Nothing here talks to the network or to other devices: ZeRO sharding, offload and
// mixed precision wrap an Optimizer rather than change it. Every kind updates each element of a
// param from that element's own state and the param's scalar state only (no norms across
// elements), which is what lets ZeRO step a shard of a param on its own (see
// IsScalarOptimizerState).
//
// Semantics: each implementation follows PyTorch 1.13's single-tensor (non-foreach) algorithm of
// torch/optim/<kind>.py op for op, so results equal torch.optim's to fp32 round-off (the tests
// compare against LibTorch's torch::optim where it has the kind, and against torch.optim's own
// results recorded in testdata/optimizer_golden.pt by tools/gen_optimizer_golden.py). The
// hyper-parameters of a step are passed to Step(), not stored: an lr schedule or a manual
// `group['lr'] = x` on the client becomes a different `hypers` on the next Step. Departures from
// 1.13, each documented at its kind: options that PyTorch 2.x added (NAdam/RAdam `maximize` and
// `decoupled_weight_decay`); state that an option switched on mid-training needs is created
// afresh instead of failing (Adam amsgrad, RMSprop momentum/centered); Adagrad's accumulator
// starts from each group's initial_accumulator_value (1.13 uses the constructor's for all).
//
// Thread-safety: an Optimizer is not thread-safe. One thread at a time may call its methods,
// and no other thread may read or write its parameters or their grads during Step(). Different
// Optimizer objects (e.g. one per pipeline stage) may step concurrently on different threads.
// The free functions below are safe from any thread.
//
// Usage:
//   rannc::HyperParams hyper = rannc::DefaultHyperParams(rannc::OptimizerKind::kAdamW);
//   std::vector<rannc::ParamGroup> groups = {{stage_params, hyper}};
//   ASSIGN_OR_RETURN(auto opt, rannc::MakeOptimizer(rannc::OptimizerKind::kAdamW, groups));
//   ... forward/backward fills each param's grad() ...
//   hyper.lr = scheduler_lr;
//   RETURN_IF_ERROR(opt->Step({hyper}));
#ifndef RANNC_DAEMON_OPTIM_OPTIMIZER_H_
#define RANNC_DAEMON_OPTIM_OPTIMIZER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {

// Hyper-parameters of one param group, with PyTorch's names and meanings. A field's default is
// PyTorch's for the kinds that use it, except where kinds differ (lr, eps, alpha, and AdamW's
// weight_decay of 1e-2): there it is torch.optim.Adam's or the first kind listed, and
// DefaultHyperParams(kind) gives the kind's own. Fields a kind does not use are ignored and not
// checked; the proto's rannc.v1.HyperParams carries the same fields. PyTorch's pairs are split:
// betas = (beta1, beta2), etas = (etaminus, etaplus), step_sizes = (step_size_min, step_size_max).
struct HyperParams {
  // Learning rate (unitless); >= 0; all kinds. Rprop reads it only at a param's first step, to
  // start its step_size; ASGD starts a param's eta from it then, and recomputes eta from it
  // after every step, as PyTorch does.
  double lr = 1e-3;
  // >= 0; every kind but Rprop. An L2 penalty added to the grad, except for AdamW and for
  // NAdam/RAdam with decoupled_weight_decay, where the param is multiplied by 1 - lr * it.
  double weight_decay = 0;
  // SGD and RMSprop: momentum factor; >= 0; 0 = no momentum buffer.
  double momentum = 0;
  // SGD
  double dampening = 0;   // dampening of the momentum update
  bool nesterov = false;  // Nesterov momentum; needs momentum > 0 and dampening == 0
  // Adam, AdamW, Adamax, NAdam, RAdam: betas; each in [0, 1).
  double beta1 = 0.9;    // decay of the first-moment average
  double beta2 = 0.999;  // decay of the second-moment average (Adamax: of the infinity norm)
  // Added to the denominator; >= 0; every kind but SGD, ASGD and Rprop. PyTorch's default is
  // 1e-8 except Adagrad's 1e-10 and Adadelta's 1e-6.
  double eps = 1e-8;
  // Adam / AdamW
  bool amsgrad = false;  // use the running maximum of the second moment
  // RMSprop: smoothing constant (>= 0; default 0.99). ASGD: power of the eta decay (unchecked,
  // as in PyTorch; its default is 0.75).
  double alpha = 0.99;
  // RMSprop: normalize by the gradient's estimated variance (keeps grad_avg).
  bool centered = false;
  // Adagrad
  double lr_decay = 0;                   // lr / (1 + (step - 1) * lr_decay); >= 0
  double initial_accumulator_value = 0;  // start of `sum`; >= 0; read at construction
  // NAdam: decay of the momentum schedule mu_t; >= 0.
  double momentum_decay = 4e-3;
  // NAdam, RAdam (PyTorch 2.x): decay the param as AdamW does instead of adding an L2 penalty.
  bool decoupled_weight_decay = false;
  // Adadelta: decay of the running averages; in [0, 1].
  double rho = 0.9;
  // ASGD (none checked, as in PyTorch)
  double lambd = 1e-4;  // decay term
  double t0 = 1e6;      // step at which averaging starts
  // Rprop: step-size factors on a sign change and on no change; 0 < etaminus < 1 < etaplus.
  double etaminus = 0.5;
  double etaplus = 1.2;
  // Rprop: bounds of the per-element step size (unchecked, as in PyTorch).
  double step_size_min = 1e-6;
  double step_size_max = 50;
  // Every kind (NAdam and RAdam as in PyTorch 2.x): ascend instead of descend.
  bool maximize = false;
  // kScripted: the group's numeric entries, by the client's names, which the update gets as its
  // `group` dict; the fields above are not read.
  std::map<std::string, double> named;
};

enum class OptimizerKind {
  kSgd,
  kAdam,
  kAdamW,
  kRmsprop,
  kAdagrad,
  kAdamax,
  kNAdam,
  kRAdam,
  kAdadelta,
  kAsgd,
  kRprop,
  kScripted,  // a ScriptedUpdate
};

// A per-param update that torch.optim lacks (Lion, Adafactor-like ones), written by the user as
// a TorchScript function and run by the daemon on each param, or each ZeRO shard of one. The
// update must be elementwise, as every kind here is: each element of the param from that
// element's own state and the param's scalar state; otherwise a ZeRO shard steps differently
// from the whole param.
struct ScriptedUpdate {
  std::string name;  // the client's optimizer class ("Lion"), for messages
  // torch.jit.save's bytes of a module whose forward(param: Tensor, grad: Tensor,
  // state: Dict[str, Tensor], group: Dict[str, float]) -> None updates `param` and `state` in
  // place (or replaces state entries with tensors of the same shape), under no_grad. `group`
  // is HyperParams::named.
  std::string module;
  // The keys of a param's state, in state_dict() order. "step", if listed, is a count that the
  // optimizer advances before each update and passes as a 0-dim float32 CPU tensor; every other
  // key is per element, zeros like the param before its first update. Neither ASGD's/NAdam's
  // scalar keys ("eta", "mu", "mu_product") nor a key twice (see IsScalarOptimizerState).
  std::vector<std::string> state_keys;
};

// INVALID_ARGUMENT, naming the update, for state keys that break ScriptedUpdate's rules or a
// module that does not load or whose forward does not take (param, grad, state, group).
absl::Status ValidateScriptedUpdate(const ScriptedUpdate& update);

// "sgd", "adam", "adamw", "rmsprop", "adagrad", "adamax", "nadam", "radam", "adadelta", "asgd",
// "rprop", "scripted": for messages and logs.
const char* OptimizerKindName(OptimizerKind kind);

// The defaults of torch.optim's constructor for `kind` (torch.optim.SGD has no lr default: the
// struct's 1e-3 stands there).
HyperParams DefaultHyperParams(OptimizerKind kind);

// The keys of the per-param state that `kind` keeps, in torch.optim's order (that of
// state_dict()['state'][i]); NamedState and LoadNamedState use them:
//   sgd       momentum_buffer
//   adam(w)   step, exp_avg, exp_avg_sq, max_exp_avg_sq (once amsgrad has been on)
//   rmsprop   step, square_avg, momentum_buffer (if momentum > 0), grad_avg (if centered)
//   adagrad   step, sum
//   adamax    step, exp_avg, exp_inf
//   nadam     step, mu_product, exp_avg, exp_avg_sq
//   radam     step, exp_avg, exp_avg_sq
//   adadelta  step, square_avg, acc_delta
//   asgd      step, eta, mu, ax
//   rprop     step, prev, step_size
//   scripted  none here: its ScriptedUpdate's state_keys
const std::vector<std::string>& OptimizerStateKeys(OptimizerKind kind);

// True for the state keys that hold one value per param ("step"; NAdam's "mu_product"; ASGD's
// "eta" and "mu"), false for those that hold one value per element of the param (all others, of
// the param's shape, dtype and device). The scalar ones are 0-dim float32 CPU tensors in
// NamedState, as PyTorch 1.13 keeps them, except the step of RMSprop, Adadelta and Rprop, which
// 1.13 keeps as a Python int. A shard of a param (ZeRO) keeps its scalar state whole and the
// per-element state sliced like the param. A key means the same for every kind.
bool IsScalarOptimizerState(const std::string& key);

// How many per-element state tensors, each the size of its param, `kind` keeps for a param that
// has stepped with `hyper` (SGD: 1 with momentum, else 0; Adam: 2, 3 with amsgrad; RMSprop: 1,
// +1 with momentum, +1 centered; Adagrad and ASGD: 1; scripted: 0, its per-element state_keys
// are the caller's to count; others 2): for memory estimates.
int StateTensorsPerElement(OptimizerKind kind, const HyperParams& hyper);

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
  // PyTorch skips grad=None (Adagrad creates every param's state at construction, as PyTorch).
  // The step count is per parameter (PyTorch's state['step']).
  // INVALID_ARGUMENT, before anything is updated, if hypers.size() differs from the number of
  // groups, a hyper-parameter fails ValidateHyperParams, a grad's shape or dtype differs from
  // its param's, or a grad is sparse and weight_decay is set (Adagrad). UNIMPLEMENTED for sparse
  // grads with a kind other than SGD and Adagrad, as PyTorch. An error raised by LibTorch
  // mid-step (e.g. out of memory) comes back as a Status and may leave the step partly applied.
  virtual absl::Status Step(const std::vector<HyperParams>& hypers) = 0;

  // Bytes of the per-element state tensors held now (not counting the params, their grads, or
  // scalar state such as the step counters). Grows as params get their first grad (Adagrad's is
  // all there from construction).
  virtual int64_t StateBytes() const = 0;

  virtual OptimizerKind kind() const = 0;

  // The state held now, for checkpoints: one entry per (param, key) with PyTorch's
  // state_dict naming, "<index>.<key>", where <index> numbers params across all groups in order
  // (as PyTorch's optimizer.state_dict()['state']) and <key> is one of OptimizerStateKeys(kind()),
  // for the params that have state. Per-element state has its param's shape, dtype and device;
  // scalar state (IsScalarOptimizerState) is a 0-dim float32 CPU tensor. The per-element tensors
  // and NAdam's/ASGD's scalars are the live state, not copies: clone them before the next Step if
  // they must not change.
  virtual std::vector<std::pair<std::string, at::Tensor>> NamedState() const = 0;

  // Replaces the state with `state`, in NamedState's naming (params without entries start
  // afresh). The tensors are copied. INVALID_ARGUMENT, before anything changes, for an unknown
  // key, an index past the params, per-element state whose shape differs from its param's,
  // scalar state with more than one value, or (kinds other than SGD and Adam) a param whose
  // entries lack one that the kind always keeps.
  virtual absl::Status LoadNamedState(
      const std::vector<std::pair<std::string, at::Tensor>>& state) = 0;
};

// Creates an optimizer over `groups`. INVALID_ARGUMENT, naming the group and param index, if a
// group's hyper-parameters fail ValidateHyperParams, a param is undefined or not an autograd
// leaf (PyTorch: "can't optimize a non-leaf Tensor"), or a param appears twice. UNIMPLEMENTED
// for complex params with any kind but SGD. Adagrad allocates its state here, filled with each
// group's hyper.initial_accumulator_value: for Adagrad, `groups` must carry the real hypers.
// kScripted takes its update in `scripted` (INVALID_ARGUMENT without one, or as
// ValidateScriptedUpdate), and loads its own copy of the module; other kinds ignore it.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
    OptimizerKind kind, std::vector<ParamGroup> groups,
    std::shared_ptr<const ScriptedUpdate> scripted = nullptr);

// PyTorch's constructor checks for `kind`: lr >= 0 (all); weight_decay >= 0 (all but Rprop);
// eps >= 0 (all but SGD, ASGD, Rprop); SGD: momentum >= 0, nesterov needs momentum > 0 and
// dampening == 0; Adam/AdamW/Adamax/NAdam/RAdam: 0 <= beta1, beta2 < 1; RMSprop: momentum >= 0,
// alpha >= 0; Adagrad: lr_decay >= 0, initial_accumulator_value >= 0; NAdam: momentum_decay >= 0;
// Adadelta: 0 <= rho <= 1; Rprop: 0 < etaminus < 1 < etaplus. ASGD checks only lr and
// weight_decay, as PyTorch. NaN fails every range check, as in PyTorch. INVALID_ARGUMENT naming
// the field and its value. kScripted checks nothing: its hyper-parameters are the client's.
absl::Status ValidateHyperParams(OptimizerKind kind, const HyperParams& hyper);

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_OPTIMIZER_H_
