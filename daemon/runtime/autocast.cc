#include "daemon/runtime/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

// LibTorch 2.4 replaced the per-device functions by ones taking the device type.
#if TORCH_VERSION_MAJOR >= 2
bool Enabled(bool cuda) { return at::autocast::is_autocast_enabled(cuda ? at::kCUDA : at::kCPU); }
void SetEnabled(bool cuda, bool on) {
  at::autocast::set_autocast_enabled(cuda ? at::kCUDA : at::kCPU, on);
}
c10::ScalarType Dtype(bool cuda) {
  return at::autocast::get_autocast_dtype(cuda ? at::kCUDA : at::kCPU);
}
void SetDtype(bool cuda, c10::ScalarType t) {
  at::autocast::set_autocast_dtype(cuda ? at::kCUDA : at::kCPU, t);
}
#else
bool Enabled(bool cuda) { return cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled(); }
void SetEnabled(bool cuda, bool on) {
  cuda ? at::autocast::set_enabled(on) : at::autocast::set_cpu_enabled(on);
}
c10::ScalarType Dtype(bool cuda) {
  return cuda ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
void SetDtype(bool cuda, c10::ScalarType t) {
  cuda ? at::autocast::set_autocast_gpu_dtype(t) : at::autocast::set_autocast_cpu_dtype(t);
}
#endif

}  // namespace

absl::StatusOr<c10::ScalarType> ParseAmpDtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return c10::ScalarType::Half;
  return absl::InvalidArgumentError(absl::StrCat(
      "amp_dtype '", name, "': expected bf16 or fp16 (bf16 is what CPU devices support)"));
}

AmpDtype CurrentAutocast(bool cuda) {
  if (!Enabled(cuda)) return std::nullopt;
  return Dtype(cuda);
}

AutocastGuard::AutocastGuard(AmpDtype dtype, bool cuda) : active_(dtype.has_value()), cuda_(cuda) {
  if (!active_) return;
  prev_enabled_ = Enabled(cuda_);
  prev_dtype_ = Dtype(cuda_);
  prev_cache_ = at::autocast::is_autocast_cache_enabled();
  SetEnabled(cuda_, true);
  SetDtype(cuda_, *dtype);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(true);
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  SetEnabled(cuda_, prev_enabled_);
  SetDtype(cuda_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_);
}

}  // namespace rannc
