// Loss scaling for fp16 mixed precision, as torch.cuda.amp.GradScaler does it: the backward
// starts from the loss's gradient times a scale S, so that small fp16 gradients do not flush to
// zero; the gradients are multiplied by 1/S before anything reads them. A step whose gradients
// are not all finite (on any device) is skipped, and the dynamic scale then shrinks by
// `backoff`; after `growth_interval` steps in a row without overflow it grows by `growth`.
//
//   LossScaler scaler(*ParseLossScale(config_keys, amp_dtype));
//   ... backward seeded with scaler.scale(); gradients *= 1 / scaler.scale() ...
//   bool skipped = found_inf;  // over every device
//   if (!skipped) optimizer.Step();
//   scaler.Update(found_inf);
//
// Plain data; not thread-safe.
#ifndef RANNC_DAEMON_RUNTIME_LOSS_SCALE_H_
#define RANNC_DAEMON_RUNTIME_LOSS_SCALE_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/runtime/autocast.h"

namespace rannc {

struct LossScaleOptions {
  bool enabled = false;
  bool dynamic = true;      // false: the scale stays `init`
  double init = 65536.0;    // GradScaler's defaults
  double growth = 2.0;
  double backoff = 0.5;
  int growth_interval = 2000;
};

// From a job's config keys: "loss_scale" is "dynamic", "none", or a number (a static scale);
// unset, it is dynamic for fp16 mixed precision and none otherwise (bf16 and fp32 have fp32's
// range). "loss_scale_init" (dynamic's first scale) and "loss_scale_window" (its growth
// interval) tune it. INVALID_ARGUMENT naming the key for a bad value.
absl::StatusOr<LossScaleOptions> ParseLossScale(const std::map<std::string, std::string>& keys,
                                                AmpDtype amp);

class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const LossScaleOptions& options)
      : options_(options), scale_(options.enabled ? options.init : 1.0) {}

  bool enabled() const { return options_.enabled; }
  // The factor the backward's seed is multiplied by (1 when disabled).
  double scale() const { return scale_; }
  // After a step (skipped or not): whether its gradients overflowed anywhere.
  void Update(bool found_inf);
  int skipped_steps() const { return skipped_; }
  // Steps without overflow since the scale last changed; and the whole state back from a
  // checkpoint.
  int good_steps() const { return good_steps_; }
  void Restore(double scale, int good_steps, int skipped_steps) {
    scale_ = options_.enabled ? scale : 1.0;
    good_steps_ = good_steps;
    skipped_ = skipped_steps;
  }

 private:
  LossScaleOptions options_;
  double scale_ = 1.0;
  int good_steps_ = 0;  // in a row, since the last change of the scale
  int skipped_ = 0;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_LOSS_SCALE_H_
