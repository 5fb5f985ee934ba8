// An optimizer whose params are split into parts that step apart: one Optimizer of the same
// kind per part, over that part's params in the same groups (a part's group may be empty). A
// part's step reads and writes only its own params, gradients and state, so two threads may
// step two parts at once, each part keeping Optimizer's thread-safety rule. Offload uses it to
// step the parameters kept on a device on the device's worker while a thread steps the host's
// masters (runtime/pipeline_engine_host_step.cc).
//
// As an Optimizer it is the one optimizer over all of `groups`, part or not: Step steps every
// part, StateBytes sums them, and NamedState and LoadNamedState number the params across all
// groups in the order `groups` lists them (PyTorch's state_dict numbering), whichever part holds
// them; errors name params by that numbering too. Those methods, unlike StepPart, must not run
// while a part steps.
//
// Usage:
//   // part_of[g][i]: the part of groups[g].params[i]
//   ASSIGN_OR_RETURN(auto opt, SplitOptimizer::Make(OptimizerKind::kAdamW, groups, part_of, 2));
//   std::thread other([&] { status1 = opt->StepPart(1, hypers); });
//   RETURN_IF_ERROR(opt->StepPart(0, hypers));
#ifndef RANNC_DAEMON_OPTIM_SPLIT_OPTIMIZER_H_
#define RANNC_DAEMON_OPTIM_SPLIT_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/optim/optimizer.h"

namespace rannc {

class SplitOptimizer final : public Optimizer {
 public:
  // `part_of` has `groups`' shape, each entry in [0, parts). The checks and errors of
  // MakeOptimizer (params named by their place in `groups`), and INVALID_ARGUMENT for a
  // `part_of` of another shape or out of range.
  static absl::StatusOr<std::unique_ptr<SplitOptimizer>> Make(
      OptimizerKind kind, std::vector<ParamGroup> groups,
      const std::vector<std::vector<int>>& part_of, int parts,
      std::shared_ptr<const ScriptedUpdate> scripted = nullptr);

  int parts() const { return static_cast<int>(parts_.size()); }
  // One step of part `part`'s params: Optimizer::Step of that part (its errors name params by
  // their place in the part).
  absl::Status StepPart(int part, const std::vector<HyperParams>& hypers);
  // The per-element state bytes part `part` holds now.
  int64_t PartStateBytes(int part) const { return parts_[part]->StateBytes(); }

  // Every part, in order, once every part's arguments have passed Step's checks: a rejected
  // step changes nothing.
  absl::Status Step(const std::vector<HyperParams>& hypers) override;
  int64_t StateBytes() const override;
  OptimizerKind kind() const override { return kind_; }
  std::vector<std::pair<std::string, at::Tensor>> NamedState() const override;
  // Every entry is checked first (its index, key and shape); a part that then refuses its
  // entries (one lacking a key its kind keeps) leaves the parts loaded before it as they were.
  absl::Status LoadNamedState(
      const std::vector<std::pair<std::string, at::Tensor>>& state) override;

 private:
  SplitOptimizer() = default;

  OptimizerKind kind_ = OptimizerKind::kSgd;
  std::vector<ParamGroup> groups_;  // all the params, for the checks
  std::vector<std::string> keys_;   // the state keys an entry may have
  std::vector<std::unique_ptr<Optimizer>> parts_;
  // Per param, numbered across groups: its part and its number in that part; and back.
  std::vector<std::pair<int, int64_t>> where_;
  std::vector<std::vector<int64_t>> index_of_;  // [part][number in the part]
};

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_SPLIT_OPTIMIZER_H_
