#include "daemon/runtime/numerics.h"

#include <ATen/Context.h>

#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"

namespace rannc {
namespace {

struct Held {
  std::mutex mu;
  std::multiset<std::string> jobs;  // guarded by mu; the leases' jobs
  NumericSettings settings;         // guarded by mu; what the switches are while jobs are held
};

Held& held() {
  static Held* const h = new Held;
  return *h;
}

const char* Bool(bool b) { return b ? "True" : "False"; }

}  // namespace

bool NumericSettings::operator==(const NumericSettings& o) const {
  return float32_matmul_precision == o.float32_matmul_precision &&
         cudnn_allow_tf32 == o.cudnn_allow_tf32 && cudnn_deterministic == o.cudnn_deterministic &&
         cudnn_benchmark == o.cudnn_benchmark &&
         deterministic_algorithms == o.deterministic_algorithms &&
         deterministic_warn_only == o.deterministic_warn_only;
}

std::string NumericSettings::ToString() const {
  return absl::StrCat("float32_matmul_precision=", float32_matmul_precision,
                      " cudnn.allow_tf32=", Bool(cudnn_allow_tf32),
                      " cudnn.deterministic=", Bool(cudnn_deterministic),
                      " cudnn.benchmark=", Bool(cudnn_benchmark),
                      " deterministic_algorithms=", Bool(deterministic_algorithms),
                      deterministic_algorithms && deterministic_warn_only ? " (warn_only)" : "");
}

absl::Status ValidateNumericSettings(const NumericSettings& s) {
  if (s.float32_matmul_precision != "highest" && s.float32_matmul_precision != "high" &&
      s.float32_matmul_precision != "medium") {
    return absl::InvalidArgumentError(absl::StrCat(
        "float32_matmul_precision '", s.float32_matmul_precision,
        "' is not one of PyTorch's: highest, high, medium"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NumericsLease>> NumericsLease::Acquire(
    const NumericSettings& settings, const std::string& job) {
  absl::Status valid = ValidateNumericSettings(settings);
  if (!valid.ok()) return valid;
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mu);
  if (!h.jobs.empty()) {
    if (h.settings != settings) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job, " computes with ", settings.ToString(), ", but this ranncd runs job ",
          *h.jobs.begin(), " with ", h.settings.ToString(),
          ". PyTorch keeps these settings process-wide, so one daemon runs jobs of one setting "
          "at a time: match them in the client, or wait for the other job to end"));
    }
    h.jobs.insert(job);
    return std::unique_ptr<NumericsLease>(new NumericsLease(job));
  }
  absl::Status set = TorchCall(absl::StatusCode::kInvalidArgument,
                               "applying the client's numeric settings", [&] {
    at::Context& ctx = at::globalContext();
    ctx.setFloat32MatmulPrecision(settings.float32_matmul_precision);
    ctx.setAllowTF32CuDNN(settings.cudnn_allow_tf32);
    ctx.setDeterministicCuDNN(settings.cudnn_deterministic);
    ctx.setBenchmarkCuDNN(settings.cudnn_benchmark);
    ctx.setDeterministicAlgorithms(settings.deterministic_algorithms,
                                   settings.deterministic_warn_only);
    return absl::OkStatus();
  });
  if (!set.ok()) return set;
  h.settings = settings;
  h.jobs.insert(job);
  return std::unique_ptr<NumericsLease>(new NumericsLease(job));
}

NumericsLease::~NumericsLease() {
  Held& h = held();
  std::lock_guard<std::mutex> lock(h.mu);
  h.jobs.erase(h.jobs.find(job_));
}

}  // namespace rannc
