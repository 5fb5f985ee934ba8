// The client side of planning, as `rannc plan` uses it: parsing its flags (byte sizes such as
// "80GiB", input specs such as "int64:64x1024"), making example inputs from them, and reading
// and printing deployment files (serialized rannc.v1.Deployment, see
// proto/rannc/v1/deployment.proto) without a daemon.
//
// Example:
//   absl::StatusOr<uint64_t> memory = rannc::ParseByteSize("80GiB");
//   absl::StatusOr<rannc::InputSpec> spec = rannc::ParseInputSpec("int64:64x1024");
//   std::mt19937_64 rng(0);
//   rannc::HostTensor ids = rannc::MakeExampleInput(*spec, /*batch=*/32, rng);  // int64[32, 1024]
//   absl::StatusOr<rannc::v1::Deployment> plan = rannc::ParseDeployment(bytes, "plan.pb");
//   absl::StatusOr<std::string> text = rannc::FormatDeployment(*plan, /*batch_size=*/64);
//
// Thread-safety: free functions without shared state; MakeExampleInput uses only the `rng` it is
// given, which callers must not share between threads.
#ifndef RANNC_CLIENT_PLANNING_H_
#define RANNC_CLIENT_PLANNING_H_

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/host_tensor.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

// The one deployment format_version this client reads and writes.
inline constexpr uint32_t kDeploymentFormatVersion = 1;

// Bytes from "80GiB", "512MiB", "1.5GB", "1e9", "1024" or "64 KiB": a non-negative number
// (integer, decimal or exponent form) and an optional unit B, KB, MB, GB, TB (powers of 1000) or
// KiB, MiB, GiB, TiB (powers of 1024), case-insensitive. Fractions of a byte are dropped.
absl::StatusOr<uint64_t> ParseByteSize(std::string_view text);

// A dtype by PyTorch's names: float32/float, float64/double, float16/half, bfloat16,
// int64/long, int32/int, int16, int8, uint8, bool.
absl::StatusOr<v1::DType> ParseDType(std::string_view name);

// One model input as `rannc plan --input` gives it: "DTYPE:D0xD1x...", e.g. "float32:64x3".
struct InputSpec {
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;  // at least one dimension, each >= 1
};
absl::StatusOr<InputSpec> ParseInputSpec(std::string_view text);

// An example input of `spec`'s dtype and shape, with dimension 0 replaced by `batch` when
// batch > 0. Floating-point inputs are standard normal; integer and bool inputs are zeros,
// which are valid token ids, class targets and indices for any embedding or loss, whereas random
// integers could fall outside a vocabulary.
HostTensor MakeExampleInput(const InputSpec& spec, int64_t batch, std::mt19937_64& rng);

// Parses a deployment file's bytes; INVALID_ARGUMENT naming `source` when they are not a
// deployment (unparsable, no format_version, no stages) or have an unknown format_version.
absl::StatusOr<v1::Deployment> ParseDeployment(std::string_view bytes, std::string_view source);

// The deployment for people at `batch_size`: a header (model, devices, schedule, estimated step
// time, then the optimizer with ZeRO/offload, who created the plan and whether it was loaded
// from a file, when recorded), one block per stage (node range, ops, devices, per-device
// micro-batch size ceil(batch / (micro_batches * replicas)), memory, times, then memory split
// into fixed (params among it) and activations), then "cuda:0 -> stage k, micro-batch size m"
// per device. INVALID_ARGUMENT when batch_size is not positive or smaller than micro_batches
// times the largest replica count.
absl::StatusOr<std::string> FormatDeployment(const v1::Deployment& deployment,
                                             int64_t batch_size);

// "1.2 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);

}  // namespace rannc

#endif  // RANNC_CLIENT_PLANNING_H_
