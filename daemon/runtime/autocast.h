// Mixed precision as PyTorch's autocast does it: while an AutocastGuard is alive, this thread's
// ops run under torch.autocast(device_type, dtype) (matmuls and convolutions in the low
// precision dtype, precision-sensitive ops in fp32, parameters staying fp32: they are the
// master weights), exactly as the client's `with torch.autocast(...)` would, since the same
// dispatcher key does the casting. Leaving the outermost guard clears the cast cache, as
// torch.autocast's __exit__ does.
//
//   {
//     AutocastGuard amp(AmpDtype{at::kBFloat16});   // CPU devices
//     outputs = RunTheForward(...);
//   }
//   backward(...);  // outside, as PyTorch recommends
//
// Thread-compatible: the state is the thread's; a guard must be destroyed on the thread that
// made it, in reverse order of creation.
#ifndef RANNC_DAEMON_RUNTIME_AUTOCAST_H_
#define RANNC_DAEMON_RUNTIME_AUTOCAST_H_

#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace rannc {

// A job's mixed precision: the low-precision dtype (bf16 or fp16), or none.
using AmpDtype = std::optional<c10::ScalarType>;

// "bf16"/"bfloat16" or "fp16"/"float16"/"half" (config key amp_dtype); INVALID_ARGUMENT
// otherwise.
absl::StatusOr<c10::ScalarType> ParseAmpDtype(const std::string& name);

// This thread's autocast state for the CPU (or CUDA): its dtype while enabled, else none.
AmpDtype CurrentAutocast(bool cuda = false);

class AutocastGuard {
 public:
  // Nothing when `dtype` is empty. `cuda`: the CUDA autocast state instead of the CPU one.
  explicit AutocastGuard(AmpDtype dtype, bool cuda = false);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  bool cuda_ = false;
  bool prev_enabled_ = false;
  bool prev_cache_ = true;
  c10::ScalarType prev_dtype_ = c10::ScalarType::BFloat16;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_AUTOCAST_H_
