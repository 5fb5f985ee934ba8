#include "daemon/runtime/loss_scale.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rannc {

absl::StatusOr<LossScaleOptions> ParseLossScale(const std::map<std::string, std::string>& keys,
                                                AmpDtype amp) {
  LossScaleOptions o;
  o.enabled = amp.has_value() && *amp == c10::ScalarType::Half;
  auto bad = [](const std::string& key, const std::string& value, const char* expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("config ", key, "='", value, "': expected ", expected));
  };
  if (auto it = keys.find("loss_scale"); it != keys.end()) {
    double fixed = 0;
    if (it->second == "dynamic") {
      o.enabled = true;
      o.dynamic = true;
    } else if (it->second == "none") {
      o.enabled = false;
    } else if (absl::SimpleAtod(it->second, &fixed) && std::isfinite(fixed) && fixed > 0) {
      o.enabled = true;
      o.dynamic = false;
      o.init = fixed;
    } else {
      return bad(it->first, it->second, "dynamic, none or a positive number");
    }
  }
  if (auto it = keys.find("loss_scale_init"); it != keys.end()) {
    if (!absl::SimpleAtod(it->second, &o.init) || !std::isfinite(o.init) || o.init <= 0) {
      return bad(it->first, it->second, "a positive number");
    }
  }
  if (auto it = keys.find("loss_scale_window"); it != keys.end()) {
    if (!absl::SimpleAtoi(it->second, &o.growth_interval) || o.growth_interval < 1) {
      return bad(it->first, it->second, "a positive integer");
    }
  }
  return o;
}

void LossScaler::Update(bool found_inf) {
  if (!options_.enabled) return;
  if (found_inf) ++skipped_;
  if (!options_.dynamic) return;
  if (found_inf) {
    scale_ *= options_.backoff;
    good_steps_ = 0;
  } else if (++good_steps_ == options_.growth_interval) {
    scale_ *= options_.growth;
    good_steps_ = 0;
  }
}

}  // namespace rannc
