// Learning-rate schedules as the common trainers have them (Hugging Face's
// get_{constant,linear,cosine}_schedule_with_warmup, the cosine one with a floor as
// get_cosine_with_min_lr_schedule_with_warmup): `rannc train` and detached jobs set each step's
// lr from one. No LibTorch: the CLI uses it too.
//
//   LrSchedule s{LrSchedule::Kind::kCosine, /*lr=*/3e-4, /*warmup_steps=*/100,
//                /*min_lr=*/3e-5, /*total_steps=*/5000};
//   RETURN_IF_ERROR(s.Validate());
//   hyper.set_lr(s.At(step));   // step = 1 for the first optimizer step
//
// A value type; every function is safe from any thread.
#ifndef RANNC_DAEMON_OPTIM_LR_SCHEDULE_H_
#define RANNC_DAEMON_OPTIM_LR_SCHEDULE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {

struct LrSchedule {
  enum class Kind { kConstant, kLinear, kCosine };
  Kind kind = Kind::kConstant;
  double lr = 1e-3;           // the peak
  int64_t warmup_steps = 0;   // steps of linear warmup from 0
  double min_lr = 0;          // the floor that linear and cosine decay end at
  int64_t total_steps = 0;    // the run's optimizer steps (the decay's end)

  // The lr of optimizer step `step` (1 for the first), as LambdaLR gives it with Hugging Face's
  // lambdas at index i = step - 1: lr * i / warmup_steps during warmup (the first step's lr is
  // 0 with warmup, as there); then, with progress p = (i - warmup_steps) / (total_steps -
  // warmup_steps) in [0, 1], constant lr, linear lr - (lr - min_lr) * p, or cosine
  // min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2. Steps past total_steps stay at the end's.
  double At(int64_t step) const;

  // INVALID_ARGUMENT naming the field: lr > 0, 0 <= min_lr <= lr, 0 <= warmup_steps <=
  // total_steps, total_steps > 0.
  absl::Status Validate() const;
};

// "constant", "linear" or "cosine"; INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<LrSchedule::Kind> ParseLrScheduleKind(const std::string& name);

}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_LR_SCHEDULE_H_
