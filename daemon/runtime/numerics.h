// The client's PyTorch numeric settings for a job: TF32 in matmuls and in cuDNN convolutions,
// cuDNN's deterministic and benchmark modes, and deterministic algorithms, which PyTorch keeps
// as process-wide switches (at::globalContext()) and a daemon's CUDA devices must follow so that
// a job computes as the client's PyTorch would (CPU devices read only deterministic_algorithms).
//
// Owns: nothing but the process-wide record of the settings that live jobs hold. LibTorch's
// switches are global, so one daemon runs jobs of one setting at a time: a job whose settings
// differ from those of a job already holding them is refused (FAILED_PRECONDITION naming the
// job and both values); the switches take a job's values when it is the first to hold them.
//
// Thread-safety: every function is safe from any thread.
//
// Usage:
//   ASSIGN_OR_RETURN(std::unique_ptr<NumericsLease> lease,
//                    NumericsLease::Acquire(settings.numerics, job_name));
//   ... the job runs; the lease lives as long as the job ...
#ifndef RANNC_DAEMON_RUNTIME_NUMERICS_H_
#define RANNC_DAEMON_RUNTIME_NUMERICS_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace rannc {

// PyTorch's names and defaults.
struct NumericSettings {
  // torch.get_float32_matmul_precision(): "highest" (no TF32), "high" (TF32, what
  // torch.backends.cuda.matmul.allow_tf32 = True sets) or "medium" (bf16 allowed).
  std::string float32_matmul_precision = "highest";
  bool cudnn_allow_tf32 = true;      // torch.backends.cudnn.allow_tf32
  bool cudnn_deterministic = false;  // torch.backends.cudnn.deterministic
  bool cudnn_benchmark = false;      // torch.backends.cudnn.benchmark
  // torch.use_deterministic_algorithms(mode, warn_only=...)
  bool deterministic_algorithms = false;
  bool deterministic_warn_only = false;

  bool operator==(const NumericSettings& other) const;
  bool operator!=(const NumericSettings& other) const { return !(*this == other); }
  // "float32_matmul_precision=highest cudnn.allow_tf32=True ...", for messages.
  std::string ToString() const;
};

// INVALID_ARGUMENT for a float32_matmul_precision other than highest, high and medium.
absl::Status ValidateNumericSettings(const NumericSettings& settings);

// A job's hold on the process-wide settings; releases it when destroyed.
class NumericsLease {
 public:
  // Holds `settings` for job `job`, setting LibTorch's switches when no other lease is held.
  // FAILED_PRECONDITION when other leases hold different settings; INVALID_ARGUMENT as
  // ValidateNumericSettings.
  static absl::StatusOr<std::unique_ptr<NumericsLease>> Acquire(const NumericSettings& settings,
                                                                const std::string& job);
  ~NumericsLease();
  NumericsLease(const NumericsLease&) = delete;
  NumericsLease& operator=(const NumericsLease&) = delete;

 private:
  explicit NumericsLease(std::string job) : job_(std::move(job)) {}
  std::string job_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_NUMERICS_H_
