#include "daemon/planner/deployment.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {
namespace planner {

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

absl::Status CheckDeployment(const v1::Deployment& d, const IrGraph& ir, const PlanTarget& target) {
  if (d.format_version() != kDeploymentFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the deployment has format version ", d.format_version(), "; this daemon reads version ",
        kDeploymentFormatVersion, " (re-plan the model and save the deployment again)"));
  }
  if (d.model_hash() != ir.hash || d.num_nodes() != ir.nodes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the deployment was made for another model (model hash ", d.model_hash(), ", ",
        d.num_nodes(), " nodes; this model: ", ir.hash, ", ", ir.nodes.size(),
        " nodes); load a deployment saved from this model or let the daemon plan"));
  }
  if (d.device_type() != target.device_type) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the deployment was made for ", d.device_type(), " devices, but this daemon has ",
        target.device_type, " devices"));
  }
  if (d.stages().empty() || d.micro_batches() == 0) {
    return absl::InvalidArgumentError("the deployment has no stages or no micro-batches");
  }
  if (!(d.mem_margin() >= 0 && d.mem_margin() < 1)) {  // NaN too
    return absl::InvalidArgumentError(absl::StrCat("the deployment's memory margin ",
                                                   d.mem_margin(), " is not in [0, 1)"));
  }
  uint32_t next = 0;
  uint32_t max_device = 0;
  size_t max_replicas = 1;
  std::set<uint32_t> used;
  for (const v1::DeploymentStage& s : d.stages()) {
    if (s.first_node() != next || s.end_node() <= s.first_node() || s.devices().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "deployment stage ", s.index(), " does not continue the previous one (nodes [",
          s.first_node(), ", ", s.end_node(), ") after node ", next, ") or has no devices"));
    }
    next = s.end_node();
    for (uint32_t dev : s.devices()) {
      if (!used.insert(dev).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the deployment places device ", dev, " twice (stage ", s.index(),
            "); each device runs one replica of one stage"));
      }
      max_device = std::max(max_device, dev);
    }
    max_replicas = std::max<size_t>(max_replicas, s.devices().size());
  }
  if (next != ir.nodes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the deployment's stages end at node ", next,
                                                   " of ", ir.nodes.size()));
  }
  if (max_device >= static_cast<uint32_t>(target.num_devices)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the deployment places stages on ", max_device + 1, " devices, but this daemon has ",
        target.num_devices));
  }
  const int64_t batch = target.batch_size > 0 ? target.batch_size : d.batch_size();
  if (batch < static_cast<int64_t>(d.micro_batches() * max_replicas)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the deployment splits each batch into ", d.micro_batches(), " micro-batches over up to ",
        max_replicas, " replicas, so it needs at least ", d.micro_batches() * max_replicas,
        " samples per batch; the batch has ", batch));
  }
  const double usable = target.device_memory_bytes * (1 - d.mem_margin());
  for (const v1::DeploymentStage& s : d.stages()) {
    // Activations scale with the samples each device sees per micro-batch.
    // In 64 bits: at most `batch` (checked above), and at least 1.
    const int64_t split = static_cast<int64_t>(d.micro_batches()) * s.devices_size();
    const int64_t per_device = (batch + split - 1) / split;
    const double scale = s.micro_batch() > 0 ? static_cast<double>(per_device) / s.micro_batch()
                                             : 1.0;
    const double need = s.fixed_bytes() + (s.memory_bytes() - s.fixed_bytes()) * scale;
    if (target.device_memory_bytes != 0 && need > usable) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the deployment's stage ", s.index(), " needs ", HumanBytes(static_cast<uint64_t>(need)),
          " per device, but these devices have ", HumanBytes(target.device_memory_bytes),
          " less the ", d.mem_margin() * 100, "% margin (",
          HumanBytes(static_cast<uint64_t>(usable)), "); let the daemon plan again"));
    }
  }
  return absl::OkStatus();
}

std::string DescribeDeployment(const v1::Deployment& d) {
  std::string out = absl::StrCat(
      "plan for ", d.num_devices(), " x ", d.device_type(), " (", HumanBytes(d.device_memory_bytes()),
      " each), batch ", d.batch_size(), ": ", d.stages_size(), d.stages_size() == 1 ? " stage" : " stages",
      ", ", d.micro_batches(), d.micro_batches() == 1 ? " micro-batch" : " micro-batches", ", ",
      d.schedule() == v1::SCHEDULE_GPIPE ? "GPipe" : "1F1B");
  char buf[160];
  std::snprintf(buf, sizeof(buf), "; estimated step %.3f ms (planned in %.2f s, profiling %.2f s)%s\n",
                d.estimated_step_ms(), d.planning_seconds(), d.profiling_seconds(),
                d.loaded() ? ", loaded from a file" : "");
  out += buf;
  if (!d.batch_whole().empty()) {
    absl::StrAppend(&out, "  batch kept whole: ", d.batch_whole(), "\n");
  }
  for (const v1::DeploymentStage& s : d.stages()) {
    std::vector<std::string> devices;
    for (uint32_t dev : s.devices()) devices.push_back(absl::StrCat(d.device_type(), ":", dev));
    std::vector<std::string> ops;
    for (int i = 0; i < s.ops_size() && i < 4; ++i) ops.push_back(s.ops(i));
    if (s.ops_size() > 4) ops.push_back("...");
    int n = std::snprintf(buf, sizeof(buf),
                          "fwd %.3f ms, bwd %.3f ms, comm %.3f ms, all-reduce %.3f ms", s.fwd_ms(),
                          s.bwd_ms(), s.comm_ms(), s.allreduce_ms());
    if (s.host_step_ms() > 0 && n > 0 && n < static_cast<int>(sizeof(buf))) {
      std::snprintf(buf + n, sizeof(buf) - n, ", host step %.3f ms", s.host_step_ms());
    }
    absl::StrAppend(&out, "  stage ", s.index(), ": nodes [", s.first_node(), ", ", s.end_node(),
                    ") on ", absl::StrJoin(devices, ", "), " (", s.devices_size(),
                    s.devices_size() == 1 ? " replica" : " replicas", "), micro-batch ",
                    s.micro_batch(), " per device, ", HumanBytes(s.memory_bytes()),
                    " per device (params ", HumanBytes(s.param_bytes()), ")",
                    s.kept_on_device_bytes() > 0
                        ? absl::StrCat(", ", HumanBytes(s.kept_on_device_bytes()),
                                       " of offloaded parameters kept on the device")
                        : "",
                    s.recompute() ? ", recompute" : "", "; ", buf, "; ops: ",
                    absl::StrJoin(ops, " | "), "\n");
  }
  return out;
}

}  // namespace planner
}  // namespace rannc
