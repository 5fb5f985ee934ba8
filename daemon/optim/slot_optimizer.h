// SlotOptimizer: what the kinds ported from torch.optim after SGD and Adam share (RMSprop,
// Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop). torch.optim keeps, for each param, a
// dict of state (`self.state[p]`): a step count and a few named tensors, per-element or scalar
// (IsScalarOptimizerState). Here that dict is a ParamState with one slot per key; the base class
// validates and runs Step(), and implements the state accessors from the kind's slot names, so
// each kind writes only its per-param update, StepParam, mirroring its _single_tensor_<kind>.
// Private to //daemon/optim:optimizer; callers use MakeOptimizer. Thread-safety and lifetimes as
// Optimizer's. ScriptedOptimizer (scripted.h) is a SlotOptimizer too, with the user's keys.
#ifndef RANNC_DAEMON_OPTIM_SLOT_OPTIMIZER_H_
#define RANNC_DAEMON_OPTIM_SLOT_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "daemon/optim/optimizer.h"

namespace rannc {
namespace optim_internal {

// One state key after "step", in torch.optim's order. `optional` keys exist only under some
// hyper-parameters (RMSprop's momentum_buffer and grad_avg); the others exist whenever the
// param has state.
struct SlotSpec {
  const char* key;
  bool optional;
};

// torch.optim's state[p] for one param.
struct ParamState {
  bool present = false;  // state[p] is not empty
  int64_t step = 0;      // state['step'] (counted even where the kind does not keep the key)
  // By the kind's SlotSpec index; undefined where state[p] lacks the key. Scalar slots are
  // 0-dim float32 CPU tensors, as PyTorch 1.13 keeps them; per-element ones are like the param.
  std::vector<at::Tensor> slots;
};

class SlotOptimizer : public Optimizer {
 public:
  absl::Status Step(const std::vector<HyperParams>& hypers) final;
  int64_t StateBytes() const final;
  OptimizerKind kind() const final { return kind_; }
  std::vector<std::pair<std::string, at::Tensor>> NamedState() const final;
  absl::Status LoadNamedState(const std::vector<std::pair<std::string, at::Tensor>>& state) final;

  // Creates the state of the params that have none and that the kind creates before their first
  // step (Adagrad, as torch.optim does in its constructor). The factory calls it once.
  absl::Status CreateEagerState();

 protected:
  // `groups` must have passed the factory's checks; `slots` are the kind's keys after "step",
  // whose `key` strings must outlive the optimizer. `keeps_step`: state_dict() has "step" (every
  // torch.optim kind; a scripted update only if it lists it).
  SlotOptimizer(OptimizerKind kind, std::vector<ParamGroup> groups, std::vector<SlotSpec> slots,
                bool keeps_step = true);

  // One param's update, for a param whose grad is defined: creates its state if it has none
  // (state.present false), advances state.step and updates the param in place, op for op as
  // PyTorch's single-tensor algorithm. `grad` is param.grad(). Runs under NoGradGuard; may
  // throw (c10::Error, std::exception), which Step turns into a Status: INTERNAL, or
  // INVALID_ARGUMENT for kScripted, whose update is the user's code.
  virtual void StepParam(at::Tensor& param, const at::Tensor& grad, ParamState& state,
                         const HyperParams& hyper) = 0;

  // For a param without state: gives it the state it has before its first step, if the kind
  // creates it eagerly (Adagrad); the default creates none. `hyper` is the group's hyper at
  // construction.
  virtual void InitEagerState(const at::Tensor& param, ParamState& state,
                              const HyperParams& hyper) {}

  // The kind's keys after "step" (ParamState::slots' order), and whether "step" is a key.
  const std::vector<SlotSpec>& slots() const { return slots_; }
  bool keeps_step() const { return keeps_step_; }

 private:
  OptimizerKind kind_;
  std::vector<ParamGroup> groups_;
  std::vector<SlotSpec> slots_;
  bool keeps_step_;
  std::vector<std::string> keys_;  // "step" if kept, then the slots' keys
  std::vector<std::vector<ParamState>> states_;  // [group][param]
};

// A 0-dim float32 CPU tensor holding `value`: PyTorch's torch.tensor(value) for scalar state.
at::Tensor ScalarState(double value);

}  // namespace optim_internal
}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_SLOT_OPTIMIZER_H_
