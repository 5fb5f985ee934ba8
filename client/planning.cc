#include "client/planning.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace rannc {
namespace {

// absl::string_view is not std::string_view in Debian's Abseil.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }
std::string_view ToStd(absl::string_view s) { return std::string_view(s.data(), s.size()); }

// How many ops of a stage the summary names before it only counts them.
constexpr size_t kOpsShown = 4;

std::string OpsSummary(const v1::DeploymentStage& stage) {
  std::vector<std::string> ops;
  for (const std::string& node : stage.ops()) {
    for (absl::string_view op : absl::StrSplit(node, ',', absl::SkipEmpty())) {
      ops.emplace_back(op);
    }
  }
  if (ops.empty()) return "(no ops recorded)";
  std::vector<std::string> shown(ops.begin(), ops.begin() + std::min(ops.size(), kOpsShown));
  return absl::StrCat(absl::StrJoin(shown, ", "), ops.size() > kOpsShown ? ", ..." : "", " (",
                      ops.size(), " ops)");
}

std::string DeviceName(const v1::Deployment& d, uint32_t index) {
  return absl::StrCat(d.device_type().empty() ? "cpu" : d.device_type(), ":", index);
}

const char* ScheduleName(v1::PipelineSchedule schedule) {
  return schedule == v1::SCHEDULE_GPIPE ? "GPipe" : "1F1B";
}

// "optimizer adam + ZeRO + offload; created by ranncd ...; loaded from a file": what the memory
// estimate assumed and where the plan came from; empty when the deployment records none of it.
std::string Provenance(const v1::Deployment& d) {
  std::vector<std::string> memory;
  if (!d.optimizer().empty()) memory.push_back(absl::StrCat("optimizer ", d.optimizer()));
  if (d.zero()) memory.push_back("ZeRO");
  if (d.offload()) memory.push_back("offload");
  std::vector<std::string> parts;
  if (!memory.empty()) parts.push_back(absl::StrJoin(memory, " + "));
  if (!d.created_by().empty()) parts.push_back(absl::StrCat("created by ", d.created_by()));
  if (d.loaded()) parts.push_back("loaded from a file");
  return absl::StrJoin(parts, "; ");
}

}  // namespace

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%d B", bytes)
                   : absl::StrFormat("%.1f %s", value, units[unit]);
}

absl::StatusOr<uint64_t> ParseByteSize(std::string_view std_text) {
  const absl::string_view text = ToAbsl(std_text);
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid size '", text, "': ", why,
        "; expected bytes, or a number with a unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB "
        "(e.g. 80GiB, 512MiB, 1e9)"));
  };
  if (trimmed.empty()) return invalid("empty");
  if (trimmed.front() == '-') return invalid("negative");
  // The unit is the trailing letters; an exponent's 'e' is always followed by digits.
  size_t unit_start = trimmed.size();
  while (unit_start > 0 && absl::ascii_isalpha(trimmed[unit_start - 1])) --unit_start;
  const absl::string_view number = absl::StripTrailingAsciiWhitespace(trimmed.substr(0, unit_start));
  const std::string unit = absl::AsciiStrToLower(trimmed.substr(unit_start));
  static const std::map<std::string, uint64_t>* kUnits = new std::map<std::string, uint64_t>{
      {"", 1},
      {"b", 1},
      {"kb", 1000ull},
      {"mb", 1000ull * 1000},
      {"gb", 1000ull * 1000 * 1000},
      {"tb", 1000ull * 1000 * 1000 * 1000},
      {"kib", 1ull << 10},
      {"mib", 1ull << 20},
      {"gib", 1ull << 30},
      {"tib", 1ull << 40},
  };
  auto multiplier = kUnits->find(unit);
  if (multiplier == kUnits->end()) {
    return invalid(absl::StrCat("unknown unit '", trimmed.substr(unit_start), "'"));
  }
  if (number.empty()) return invalid("no number");
  // Whole numbers are exact up to 2^64-1; only other forms go through a double.
  uint64_t whole = 0;
  if (std::all_of(number.begin(), number.end(), absl::ascii_isdigit)) {
    if (!absl::SimpleAtoi(number, &whole)) return invalid("larger than 2^64-1 bytes");
    const unsigned __int128 bytes = static_cast<unsigned __int128>(whole) * multiplier->second;
    if (bytes > UINT64_MAX) return invalid("larger than 2^64-1 bytes");
    return static_cast<uint64_t>(bytes);
  }
  double value = 0;
  if (!absl::SimpleAtod(number, &value) || !std::isfinite(value)) return invalid("not a number");
  if (value < 0) return invalid("negative");
  const double bytes = std::floor(value * static_cast<double>(multiplier->second));
  if (bytes >= 18446744073709551616.0) return invalid("larger than 2^64-1 bytes");
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<v1::DType> ParseDType(std::string_view std_name) {
  static const std::map<std::string, v1::DType>* kNames = new std::map<std::string, v1::DType>{
      {"float32", v1::FLOAT32}, {"float", v1::FLOAT32},    {"float64", v1::FLOAT64},
      {"double", v1::FLOAT64},  {"float16", v1::FLOAT16},  {"half", v1::FLOAT16},
      {"bfloat16", v1::BFLOAT16}, {"int64", v1::INT64},    {"long", v1::INT64},
      {"int32", v1::INT32},     {"int", v1::INT32},        {"int16", v1::INT16},
      {"int8", v1::INT8},       {"uint8", v1::UINT8},      {"bool", v1::BOOL},
  };
  const std::string name = absl::AsciiStrToLower(ToAbsl(std_name));
  auto it = kNames->find(name);
  if (it == kNames->end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown dtype '", ToAbsl(std_name),
        "'; expected float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8 or "
        "bool"));
  }
  return it->second;
}

absl::StatusOr<InputSpec> ParseInputSpec(std::string_view std_text) {
  const absl::string_view text = ToAbsl(std_text);
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid input '", text, "': ", why,
                                                   "; expected DTYPE:SHAPE, e.g. int64:64x1024"));
  };
  const size_t colon = text.find(':');
  if (colon == absl::string_view::npos) return invalid("no ':'");
  absl::StatusOr<v1::DType> dtype = ParseDType(ToStd(text.substr(0, colon)));
  if (!dtype.ok()) return invalid(dtype.status().message());
  InputSpec spec;
  spec.dtype = *dtype;
  const absl::string_view shape = text.substr(colon + 1);
  if (shape.empty()) return invalid("no shape");
  for (absl::string_view dim : absl::StrSplit(shape, absl::ByAnyChar("x,"))) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(dim, &size) || size < 1) {
      return invalid(absl::StrCat("dimension '", dim, "' is not a positive integer"));
    }
    spec.shape.push_back(size);
  }
  return spec;
}

HostTensor MakeExampleInput(const InputSpec& spec, int64_t batch, std::mt19937_64& rng) {
  std::vector<int64_t> shape = spec.shape;
  if (batch > 0 && !shape.empty()) shape[0] = batch;
  const bool floating = spec.dtype == v1::FLOAT32 || spec.dtype == v1::FLOAT64 ||
                        spec.dtype == v1::FLOAT16 || spec.dtype == v1::BFLOAT16;
  if (!floating) return HostTensor::Full(spec.dtype, std::move(shape), 0);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> values(static_cast<size_t>(n));
  for (double& v : values) v = normal(rng);
  // FromDoubles fails only for unknown dtypes, and every floating dtype is known.
  return *HostTensor::FromDoubles(spec.dtype, values, std::move(shape));
}

absl::StatusOr<v1::Deployment> ParseDeployment(std::string_view bytes,
                                               std::string_view std_source) {
  const absl::string_view source = ToAbsl(std_source);
  const std::string what =
      " is not a deployment file (a serialized rannc.v1.Deployment, as `rannc plan --save` and "
      "RaNNCModule.save_deployment write)";
  v1::Deployment deployment;
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(source, what, ": empty"));
  if (!deployment.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(source, what, ": it does not parse"));
  }
  if (deployment.format_version() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(source, what, ": it has no format_version"));
  }
  if (deployment.format_version() != kDeploymentFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, " has deployment format_version ", deployment.format_version(),
        "; this client reads only version ", kDeploymentFormatVersion));
  }
  if (deployment.stages_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(source, what, ": it has no stages"));
  }
  return deployment;
}

absl::StatusOr<std::string> FormatDeployment(const v1::Deployment& d, int64_t batch_size) {
  if (batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch size must be positive, got ", batch_size));
  }
  const int64_t micro = std::max<int64_t>(d.micro_batches(), 1);
  int64_t max_replicas = 1;
  for (const v1::DeploymentStage& s : d.stages()) {
    max_replicas = std::max<int64_t>(max_replicas, s.devices_size());
  }
  if (batch_size < micro * max_replicas) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "this plan cannot run batch size %d: it splits each batch into %d micro-batches over up "
        "to %d replicas, so it needs a batch of at least %d",
        batch_size, micro, max_replicas, micro * max_replicas));
  }
  auto micro_batch = [&](const v1::DeploymentStage& s) {
    const int64_t per = micro * std::max(s.devices_size(), 1);
    return (batch_size + per - 1) / per;
  };

  std::string out = absl::StrFormat(
      "Deployment of model %s (%d atomic nodes)\n"
      "  devices:   %d x %s, %s each (mem_margin %g)\n"
      "  schedule:  %s, %d micro-batches\n"
      "  estimated step time: %.2f ms at the planned batch size %d\n",
      d.model_hash().empty() ? "(unknown)" : d.model_hash(), d.num_nodes(), d.num_devices(),
      d.device_type().empty() ? "cpu" : d.device_type(), HumanBytes(d.device_memory_bytes()),
      d.mem_margin(), ScheduleName(d.schedule()), d.micro_batches(), d.estimated_step_ms(),
      d.batch_size());
  const std::string provenance = Provenance(d);
  if (!provenance.empty()) absl::StrAppend(&out, "  ", provenance, "\n");
  if (!d.batch_whole().empty()) {
    absl::StrAppend(&out, "  batch kept whole: ", d.batch_whole(), "\n");
  }
  absl::StrAppend(&out, "Batch size ", batch_size, ":\n");
  std::map<uint32_t, std::vector<std::string>> by_device;
  for (const v1::DeploymentStage& s : d.stages()) {
    std::vector<std::string> devices;
    for (uint32_t i : s.devices()) {
      devices.push_back(DeviceName(d, i));
      by_device[i].push_back(
          absl::StrFormat("stage %d, micro-batch size %d", s.index(), micro_batch(s)));
    }
    absl::StrAppendFormat(&out, "Stage %d: nodes [%d, %d)  ops: %s\n", s.index(), s.first_node(),
                          s.end_node(), OpsSummary(s));
    absl::StrAppendFormat(
        &out,
        "  devices: %s (%d replica%s), micro-batch size %d per device, recompute %s; %s per "
        "device; fwd %.2f ms, bwd %.2f ms per micro-batch\n",
        devices.empty() ? "(none)" : absl::StrJoin(devices, ", "), s.devices_size(),
        s.devices_size() == 1 ? "" : "s", micro_batch(s), s.recompute() ? "yes" : "no",
        HumanBytes(s.memory_bytes()), s.fwd_ms(), s.bwd_ms());
    if (s.offload_blocks() > 1) {
      absl::StrAppendFormat(&out, "  offload: parameters streamed in %d blocks\n",
                            s.offload_blocks());
    }
    // The split of that memory, as a loaded deployment is checked by it: what does not grow
    // with the batch (parameters among it), and what does. Files without it show no line.
    if (s.fixed_bytes() != 0 || s.param_bytes() != 0 || s.activation_bytes() != 0) {
      absl::StrAppend(&out, "  memory: fixed ", HumanBytes(s.fixed_bytes()), " (params ",
                      HumanBytes(s.param_bytes()), ") + activations ",
                      HumanBytes(s.activation_bytes()), " per device\n");
    }
  }
  absl::StrAppend(&out, "Devices:\n");
  uint32_t num_devices = d.num_devices();
  if (!by_device.empty()) num_devices = std::max(num_devices, by_device.rbegin()->first + 1);
  for (uint32_t i = 0; i < num_devices; ++i) {
    auto it = by_device.find(i);
    absl::StrAppend(&out, "  ", DeviceName(d, i), " -> ",
                    it == by_device.end() ? "unused" : absl::StrJoin(it->second, "; "), "\n");
  }
  return out;
}

}  // namespace rannc
