#include "daemon/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace rannc {

double LrSchedule::At(int64_t step) const {
  const double i = static_cast<double>(std::max<int64_t>(step - 1, 0));
  if (i < warmup_steps) return lr * i / static_cast<double>(warmup_steps);
  if (kind == Kind::kConstant) return lr;
  const double span = static_cast<double>(std::max<int64_t>(total_steps - warmup_steps, 1));
  const double p = std::min(1.0, (i - warmup_steps) / span);
  if (kind == Kind::kLinear) return lr - (lr - min_lr) * p;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * p));
}

absl::Status LrSchedule::Validate() const {
  if (!(lr > 0)) return absl::InvalidArgumentError(absl::StrCat("lr ", lr, " must be > 0"));
  if (!(min_lr >= 0 && min_lr <= lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_lr ", min_lr, " must be in [0, lr = ", lr, "]"));
  }
  if (total_steps <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("total steps ", total_steps,
                                                   " must be > 0"));
  }
  if (warmup_steps < 0 || warmup_steps > total_steps) {
    return absl::InvalidArgumentError(absl::StrCat("warmup steps ", warmup_steps,
                                                   " must be in [0, steps = ", total_steps,
                                                   "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LrSchedule::Kind> ParseLrScheduleKind(const std::string& name) {
  if (name == "constant") return LrSchedule::Kind::kConstant;
  if (name == "linear") return LrSchedule::Kind::kLinear;
  if (name == "cosine") return LrSchedule::Kind::kCosine;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown lr schedule '", name, "': constant, linear or cosine"));
}

}  // namespace rannc
