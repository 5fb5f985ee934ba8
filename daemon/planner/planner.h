// Plans a model end to end: IR -> forward time of every atomic node -> blocks (coarsening,
// balanced by time, cut where little crosses) -> each block profiled at the micro-batch sizes
// the search may use -> CostTable -> SearchPlan (exact DP over stages x replicas x
// micro-batches under each device's memory) -> a Deployment (proto/rannc/v1/deployment.proto).
//
// The devices need not exist (dry runs): costs are measured on the daemon's own device type,
// memory limits and link speeds come from the PlanTarget.
//
//   absl::StatusOr<PlannerConfig> config = PlannerConfigFromKeys(job_options.config());
//   absl::StatusOr<v1::Deployment> plan =
//       PlanModel(ir, tensors, example_inputs, target, memory, *config, &cache, "ranncd 0.1.0");
//
// PlanModel runs the model many times on the calling thread; it never changes `tensors`.
#ifndef RANNC_DAEMON_PLANNER_PLANNER_H_
#define RANNC_DAEMON_PLANNER_PLANNER_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "daemon/planner/cost_eval.h"
#include "daemon/planner/cost_table.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/planner/profiler.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {
namespace planner {

// A job's planning knobs: the config keys a client sends (RANNC_<KEY> / rannc.toml).
struct PlannerConfig {
  int partition_num = 0;    // "partition_num": stages; 0 = the planner decides
  int pipeline_num = 0;     // "pipeline_num": micro-batches per step; 0 = the planner decides
  int replica_num = 0;      // "replica_num": replicas of every stage; 0 = the planner decides
  int max_pipeline = 32;    // "max_pipeline": the most micro-batches searched
  double mem_margin = 0.1;  // "mem_margin": fraction of each device's memory kept free
  Schedule schedule = Schedule::k1F1B;  // "schedule": "1f1b" or "gpipe"
  int max_blocks = 32;      // "coarsen_blocks": blocks the search splits between
  bool verify_partitioning = false;  // "verify_partitioning": check the split at job creation
  // "use_all_devices": plans use every device (the default, as RaNNC: a job gets the whole
  // daemon); false lets the planner leave devices idle when fewer are faster. Unset, a model
  // that cannot use every device (too small a batch, a replica_num that does not divide them)
  // is planned on fewer.
  std::optional<bool> use_all_devices;
  ProfilerOptions profiling;         // "profile_repeats": timed runs per measurement (3)
  // "profile_all_sizes": profile every micro-batch size the search may use (powers of two
  // between the smallest and the largest). False (the default): the smallest and the largest
  // are profiled first, and when they cost the same per sample (within 25%, for 95% of the
  // time: a compute-bound device), the sizes between are interpolated instead of run.
  bool profile_all_sizes = false;
  // "batch_size": the global batch to plan for; 0 (the default): the example inputs' batch. A
  // client that traces the model on a few samples of its batch (pyrannc's trace_batch) sends
  // the whole batch's size here.
  int batch_size = 0;
  // "auto_memory": when no plan fits with the job's memory switches, plan again with ZeRO,
  // then with parameter offload, then with both (what a user would turn on by hand), and run
  // the job in the first mode that fits. False: fail with the planner's RESOURCE_EXHAUSTED.
  bool auto_memory = true;
  // "offload_block_bytes": with offload, a stage of one replica streams its parameters in
  // blocks of at most this many bytes (EngineOptions::offload_block_bytes); 0: at once.
  int64_t offload_block_bytes = int64_t{1} << 30;
  // "offload_keep_on_device": a streamed stage keeps the parameters its memory estimate has
  // room for on the device (SearchOptions::offload_keep_on_device), where the device's memory
  // is known.
  bool offload_keep_on_device = true;
  // "offload_low_precision": streamed parameters the forward reads only through a cast to a
  // narrower dtype (amp_level O2) cross the host link in that dtype
  // (EngineOptions::offload_low_precision).
  bool offload_low_precision = false;
};

// Reads the keys above from `keys` (other keys are other readers': config/keys.h lists them
// all). INVALID_ARGUMENT naming the key for a value that does not parse or is out of range.
absl::StatusOr<PlannerConfig> PlannerConfigFromKeys(const std::map<std::string, std::string>& keys);

// The devices to plan for.
struct PlanTarget {
  int num_devices = 1;
  uint64_t device_memory_bytes = 0;  // per device
  std::string device_type = "cpu";
  int64_t batch_size = 0;            // global batch; 0 = the example batch
  Links links;
  // Where blocks are profiled (ProfilerOptions::device): one of the devices planned for, e.g.
  // the daemon's first GPU. The CPU for CPU devices and for dry runs.
  c10::Device profile_device{c10::kCPU};
};

// What the job keeps per trainable parameter byte besides the parameter and its gradient.
struct MemoryModel {
  double optimizer_state_factor = 0;  // SGD 0, SGD with momentum 1, Adam 2, amsgrad 3
  std::string optimizer = "none";
  bool zero = false;
  // offload_params: parameters, gradients between steps and optimizer state live in host
  // memory; a device holds its stage's parameters and the step's gradients only during a step.
  bool offload = false;
  // AMP: low-precision weight copies per trainable byte, per micro-batch in flight (0 without
  // AMP, 0.5 for bf16/fp16); see SearchOptions::amp_cast_factor.
  double amp_cast_factor = 0;
};

absl::StatusOr<v1::Deployment> PlanModel(const IrGraph& ir, const std::vector<at::Tensor>& tensors,
                                         const std::vector<at::Tensor>& example_inputs,
                                         const PlanTarget& target, const MemoryModel& memory,
                                         const PlannerConfig& config, ProfileCache* cache,
                                         const std::string& created_by);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_PLANNER_H_
