#include "daemon/planner/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/elapsed.h"
#include "daemon/config/options.h"
#include "daemon/graph/subgraph.h"
#include "daemon/planner/coarsen.h"
#include "daemon/planner/links.h"
#include "daemon/planner/search.h"

namespace rannc {
namespace planner {
namespace {

absl::Status BadKey(const std::string& key, const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("config key ", key, "='", value, "': expected ",
                                                 want));
}

absl::Status ReadInt(const std::map<std::string, std::string>& keys, const std::string& key,
                     int min, int* out) {
  auto it = keys.find(key);
  if (it == keys.end()) return absl::OkStatus();
  if (!absl::SimpleAtoi(it->second, out) || *out < min) {
    return BadKey(key, it->second, absl::StrCat("an integer >= ", min));
  }
  return absl::OkStatus();
}

// The per-device micro-batch sizes to profile: powers of two from just below the smallest the
// search can ask for up to the largest, and the largest itself. Between them cost_eval
// interpolates.
std::vector<int64_t> ProfileSizes(int64_t batch, const SearchOptions& o) {
  const int64_t max_m = o.pipeline_num > 0 ? o.pipeline_num : std::min<int64_t>(o.max_pipeline, batch);
  const int64_t max_r = o.replica_num > 0 ? o.replica_num : o.num_devices;
  const int64_t min_r = o.replica_num > 0 ? o.replica_num : 1;
  const int64_t min_m = o.pipeline_num > 0 ? o.pipeline_num : 1;
  const int64_t smallest = std::max<int64_t>(1, batch / (max_m * max_r));
  const int64_t largest = std::max<int64_t>(1, (batch + min_m * min_r - 1) / (min_m * min_r));
  std::vector<int64_t> sizes;
  int64_t p = 1;
  while (p * 2 <= smallest) p *= 2;
  for (; p < largest; p *= 2) sizes.push_back(p);
  sizes.push_back(largest);
  return sizes;
}

// Whether the pieces cost the same per sample at the smallest and the largest size, so that
// the sizes between follow by linear interpolation (cost_eval's): at the two sizes, the time
// per sample of the pieces that make up at least 95% of the time differs by less than 25%. On
// a device busy at any size (a CPU) that holds; where small sizes are mostly overhead (a GPU's
// kernel launches) it does not, and every size is profiled. Memory (activations grow
// linearly, working memory as a maximum of linear terms) is not checked: interpolation
// overestimates a convex curve, never underestimates it. `small`, `large`: one record per
// piece of the model (so a repeated layer weighs as often as it occurs).
bool CostsProportional(int64_t small_mb, const std::vector<ProfileRecord>& small,
                       int64_t large_mb, const std::vector<ProfileRecord>& large) {
  double total = 0, proportional = 0;
  for (size_t p = 0; p < large.size(); ++p) {
    const double t_small = (small[p].fwd_ms + small[p].bwd_ms) / small_mb;
    const double t_large = (large[p].fwd_ms + large[p].bwd_ms) / large_mb;
    total += t_large;
    if (t_small <= 1.25 * t_large && t_large <= 1.25 * t_small) proportional += t_large;
  }
  return total > 0 && proportional >= 0.95 * total;
}

}  // namespace

absl::StatusOr<PlannerConfig> PlannerConfigFromKeys(
    const std::map<std::string, std::string>& keys) {
  PlannerConfig c;
  for (auto [key, field] : std::vector<std::pair<std::string, int*>>{
           {"partition_num", &c.partition_num}, {"pipeline_num", &c.pipeline_num},
           {"replica_num", &c.replica_num}}) {
    absl::Status s = ReadInt(keys, key, 0, field);
    if (!s.ok()) return s;
  }
  absl::Status s = ReadInt(keys, "max_pipeline", 1, &c.max_pipeline);
  if (!s.ok()) return s;
  s = ReadInt(keys, "coarsen_blocks", 1, &c.max_blocks);
  if (!s.ok()) return s;
  s = ReadInt(keys, "profile_repeats", 1, &c.profiling.repeats);
  if (!s.ok()) return s;
  s = ReadInt(keys, "batch_size", 0, &c.batch_size);
  if (!s.ok()) return s;
  if (auto it = keys.find("offload_block_bytes"); it != keys.end()) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(it->second);
    if (!bytes.ok() || *bytes > (uint64_t{1} << 62)) {
      return BadKey("offload_block_bytes", it->second, "a size such as 512MiB, or 0");
    }
    c.offload_block_bytes = static_cast<int64_t>(*bytes);
  }
  if (auto it = keys.find("mem_margin"); it != keys.end()) {
    if (!absl::SimpleAtod(it->second, &c.mem_margin) || c.mem_margin < 0 || c.mem_margin >= 1) {
      return BadKey("mem_margin", it->second, "a fraction in [0, 1)");
    }
  }
  if (auto it = keys.find("schedule"); it != keys.end()) {
    std::string v = it->second;
    std::transform(v.begin(), v.end(), v.begin(), ::tolower);
    if (v == "1f1b") {
      c.schedule = Schedule::k1F1B;
    } else if (v == "gpipe") {
      c.schedule = Schedule::kGPipe;
    } else {
      return BadKey("schedule", it->second, "1f1b or gpipe");
    }
  }
  if (auto it = keys.find("verify_partitioning"); it != keys.end()) {
    if (!absl::SimpleAtob(it->second, &c.verify_partitioning)) {
      return BadKey("verify_partitioning", it->second, "true or false");
    }
  }
  if (auto it = keys.find("profile_all_sizes"); it != keys.end()) {
    if (!absl::SimpleAtob(it->second, &c.profile_all_sizes)) {
      return BadKey("profile_all_sizes", it->second, "true or false");
    }
  }
  if (auto it = keys.find("offload_keep_on_device"); it != keys.end()) {
    if (!absl::SimpleAtob(it->second, &c.offload_keep_on_device)) {
      return BadKey("offload_keep_on_device", it->second, "true or false");
    }
  }
  if (auto it = keys.find("offload_low_precision"); it != keys.end()) {
    if (!absl::SimpleAtob(it->second, &c.offload_low_precision)) {
      return BadKey("offload_low_precision", it->second, "true or false");
    }
  }
  if (auto it = keys.find("auto_memory"); it != keys.end()) {
    if (!absl::SimpleAtob(it->second, &c.auto_memory)) {
      return BadKey("auto_memory", it->second, "true or false");
    }
  }
  if (auto it = keys.find("use_all_devices"); it != keys.end()) {
    bool all = true;
    if (!absl::SimpleAtob(it->second, &all)) {
      return BadKey("use_all_devices", it->second, "true or false");
    }
    c.use_all_devices = all;
  }
  return c;
}

absl::StatusOr<v1::Deployment> PlanModel(const IrGraph& ir, const std::vector<at::Tensor>& tensors,
                                         const std::vector<at::Tensor>& example_inputs,
                                         const PlanTarget& target, const MemoryModel& memory,
                                         const PlannerConfig& config, ProfileCache* cache,
                                         const std::string& created_by) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t batch = target.batch_size > 0 ? target.batch_size : ir.example_batch;
  const int num_nodes = static_cast<int>(ir.nodes.size());

  SearchOptions options;
  options.batch_size = batch;
  options.num_devices = target.num_devices;
  // 0 means unchecked (a job on a daemon without a budget): effectively unlimited.
  options.device_memory_bytes =
      target.device_memory_bytes != 0 ? target.device_memory_bytes : (uint64_t{1} << 60);
  options.mem_margin = config.mem_margin;
  // Without fused forward/backward the runtime keeps every micro-batch's graph until the
  // client's gradients come: GPipe's order and memory, whatever was asked.
  options.schedule = FusesForwardBackward(ir) ? config.schedule : Schedule::kGPipe;
  options.optimizer_state_factor = memory.optimizer_state_factor;
  options.zero = memory.zero;
  options.offload = memory.offload;
  options.offload_block_bytes = static_cast<double>(config.offload_block_bytes);
  // Without a memory size there is no room to tell: everything stays offloaded, as asked.
  options.offload_keep_on_device =
      config.offload_keep_on_device && target.device_memory_bytes != 0;
  options.amp_cast_factor = memory.amp_cast_factor;
  options.partition_num = config.partition_num;
  options.pipeline_num = config.pipeline_num;
  options.replica_num = config.replica_num;
  options.max_pipeline = config.max_pipeline;
  options.overlap_allreduce = target.device_type == "cuda";
  options.overlap_host_copies = target.device_type == "cuda";
  if (!ir.batch_separable) {
    // Splitting the batch would change the model's results: stages only, one micro-batch.
    if (config.pipeline_num > 1 || config.replica_num > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline_num/replica_num split the batch, but ", ir.not_separable,
          "; splitting it would change the results, so only partition_num applies"));
    }
    options.pipeline_num = 1;
    options.replica_num = 1;
  }
  if (config.partition_num > num_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition_num=", config.partition_num, " but the model has only ", num_nodes,
        " atomic nodes to split between stages"));
  }

  // Blocks: balanced by forward time, cut where little crosses; repeated layers alike, so
  // that one layer's pieces are profiled for all of them.
  ProfilerOptions profiling = config.profiling;
  profiling.device_type = target.device_type;
  profiling.device = target.profile_device;
  Profiler profiler(ir, tensors, example_inputs, cache, profiling);
  const auto profile_start = std::chrono::steady_clock::now();
  std::vector<int> starts, pieces;
  std::vector<double> cut;  // per atomic node, where coarsening needed them
  const int max_blocks = std::max(config.max_blocks, config.partition_num);
  if (num_nodes <= max_blocks) {
    for (int i = 0; i < num_nodes; ++i) starts.push_back(i);
    pieces = starts;
  } else {
    absl::StatusOr<std::vector<double>> node_ms = profiler.AtomicForwardMs();
    if (!node_ms.ok()) return node_ms.status();
    cut.assign(num_nodes, 0.0);
    for (int i = 1; i < num_nodes; ++i) cut[i] = CutBytesPerSample(ir, i);
    Coarsening c = CoarsenRepeated(*node_ms, cut, profiler.node_classes(), max_blocks);
    starts = std::move(c.blocks);
    pieces = std::move(c.pieces);
    spdlog::info("planning: {} atomic nodes ({} measured, {} cached, {} repeats) timed in {:.2f} s; "
                 "{} blocks of {} pieces", num_nodes, profiler.measured(), profiler.cache_hits(),
                 profiler.shared(), SecondsSince(profile_start), starts.size(), pieces.size());
  }
  const int num_blocks = static_cast<int>(starts.size());
  auto block_end = [&](int b) { return b + 1 < num_blocks ? starts[b + 1] : num_nodes; };

  // The cost table: parameters (each distinct tensor once), profiles, boundaries.
  CostTable table;
  std::unordered_map<const void*, int> param_index;  // tied tensors share one entry
  std::vector<int> lifted_param(tensors.size(), -1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const void* key = tensors[i].unsafeGetTensorImpl();
    auto [it, added] = param_index.emplace(key, static_cast<int>(table.param_bytes.size()));
    if (added) {
      table.param_bytes.push_back(tensors[i].numel() * tensors[i].element_size());
      table.param_trainable.push_back(tensors[i].requires_grad());
    }
    lifted_param[i] = it->second;
  }
  if (options.offload && config.offload_low_precision) {
    // The runtime streams an untied parameter the forward reads only through a cast in the
    // cast's dtype (EngineOptions::offload_low_precision).
    table.param_streamed_bytes = table.param_bytes;
    std::vector<int> lifts(table.param_bytes.size(), 0);
    for (int p : lifted_param) ++lifts[p];
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::optional<at::ScalarType> low = LowPrecisionRead(ir, static_cast<int>(i));
      if (low && lifts[lifted_param[i]] == 1) {
        table.param_streamed_bytes[lifted_param[i]] = tensors[i].numel() * at::elementSize(*low);
      }
    }
    // What a streamed stage moves over the host link per byte of its masters, over the model's
    // trainable tensors: the same bytes its blocks hold.
    double master = 0, wire = 0;
    for (size_t p = 0; p < table.param_bytes.size(); ++p) {
      if (!table.param_trainable[p]) continue;
      master += static_cast<double>(table.param_bytes[p]);
      wire += static_cast<double>(table.param_streamed_bytes[p]);
    }
    if (master > 0) options.offload_wire_factor = wire / master;
  }
  table.blocks.resize(num_blocks);
  table.cut_bytes_per_sample.assign(num_blocks, 0.0);
  for (int b = 0; b < num_blocks; ++b) {
    std::set<int> params;
    for (int n = starts[b]; n < block_end(b); ++n) {
      std::vector<int> read;
      for (int v : ir.nodes[n].inputs) {
        if (v >= static_cast<int>(ir.num_user_inputs) && v < static_cast<int>(ir.inputs.size())) {
          params.insert(lifted_param[v - ir.num_user_inputs]);
          read.push_back(lifted_param[v - ir.num_user_inputs]);
        }
      }
      // Where offload's runtime may start a block, and what that block's input is.
      if (options.offload && !read.empty()) {
        const double before = cut.empty() ? (n > 0 ? CutBytesPerSample(ir, n) : 0.0) : cut[n];
        table.blocks[b].param_reads.push_back({std::move(read), before});
      }
    }
    table.blocks[b].params.assign(params.begin(), params.end());
    if (b > 0) table.cut_bytes_per_sample[b] = CutBytesPerSample(ir, starts[b]);
  }
  // A block is costed as its pieces, as a stage is as its blocks: times and activations add
  // up, the working memory is the largest piece's.
  std::vector<int64_t> sizes = ProfileSizes(batch, options);
  if (!config.profile_all_sizes && sizes.size() > 2) {
    // The smallest and the largest first: if they cost the same per sample, the rest is
    // interpolated.
    std::swap(sizes[1], sizes.back());
  }
  std::vector<ProfileRecord> smallest;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t mb = sizes[k];
    const auto size_start = std::chrono::steady_clock::now();
    const int measured = profiler.measured();
    absl::StatusOr<std::vector<ProfileRecord>> records = profiler.ProfileBlocks(pieces, mb);
    if (!records.ok()) return records.status();
    size_t p = 0;
    for (int b = 0; b < num_blocks; ++b) {
      BlockProfile& bp = table.blocks[b].by_mb[mb];
      for (; p < pieces.size() && pieces[p] < block_end(b); ++p) {
        const ProfileRecord& r = (*records)[p];
        bp.fwd_ms += r.fwd_ms;
        bp.bwd_ms += r.bwd_ms;
        bp.act_bytes += r.act_bytes;
        bp.peak_bytes = std::max(bp.peak_bytes, r.peak_bytes);
      }
    }
    spdlog::info("planning: micro-batch {}: {} pieces measured in {:.2f} s", mb,
                 profiler.measured() - measured, SecondsSince(size_start));
    if (k == 0) smallest = *records;
    if (k == 1 && !config.profile_all_sizes && sizes.size() > 2 &&
        CostsProportional(sizes[0], smallest, mb, *records)) {
      spdlog::info("planning: micro-batches {} and {} cost alike per sample; the sizes between "
                   "are interpolated", sizes[0], mb);
      break;
    }
  }
  const double profiling_s = SecondsSince(profile_start);
  if (cache != nullptr) (void)cache->Flush();  // a failed write only costs a re-profile

  const auto search_start = std::chrono::steady_clock::now();
  options.use_all_devices = config.use_all_devices.value_or(ir.batch_separable);
  absl::StatusOr<Plan> plan = SearchPlan(table, target.links, options);
  if (!plan.ok() && !config.use_all_devices.has_value()) {
    options.use_all_devices = false;
    plan = SearchPlan(table, target.links, options);
  }
  spdlog::info("planning: profiled in {:.2f} s ({} measured, {} cached, {} repeats), searched "
               "in {:.2f} s", profiling_s, profiler.measured(), profiler.cache_hits(),
               profiler.shared(), SecondsSince(search_start));
  if (!plan.ok()) return plan.status();

  v1::Deployment d;
  d.set_format_version(1);
  d.set_model_hash(ir.hash);
  d.set_num_nodes(num_nodes);
  d.set_batch_size(batch);
  d.set_device_type(target.device_type);
  d.set_num_devices(target.num_devices);
  d.set_device_memory_bytes(target.device_memory_bytes);
  d.set_mem_margin(config.mem_margin);
  d.set_schedule(plan->schedule == Schedule::kGPipe ? v1::SCHEDULE_GPIPE : v1::SCHEDULE_1F1B);
  d.set_micro_batches(plan->micro_batches);
  d.set_estimated_step_ms(plan->simulated_ms);
  d.set_objective_ms(plan->objective_ms);
  d.set_estimated_bubble(plan->simulated_bubble);
  d.set_optimizer(memory.optimizer);
  if (!ir.batch_separable) d.set_batch_whole(ir.not_separable);
  d.set_zero(memory.zero);
  d.set_offload(memory.offload);
  d.set_created_by(created_by);
  d.set_links(DescribeLinks(target.links));
  uint32_t device = 0;
  for (size_t s = 0; s < plan->stages.size(); ++s) {
    const StagePlan& st = plan->stages[s];
    const StageEval& e = st.eval;
    v1::DeploymentStage* stage = d.add_stages();
    stage->set_index(s);
    stage->set_first_node(starts[st.begin]);
    stage->set_end_node(block_end(st.end - 1));
    for (int r = 0; r < st.replicas; ++r) stage->add_devices(device++);
    stage->set_recompute(e.recompute);
    // The runtime streams a stage of one replica (EngineOptions::offload_block_bytes) in the
    // blocks ParamBlockStarts gives, which the estimate replays (StreamedBlocksOf).
    if (memory.offload) stage->set_offload_blocks(static_cast<uint32_t>(e.offload_blocks));
    stage->set_memory_bytes(e.memory_bytes);
    // What does not grow with the batch (CheckDeployment scales the rest).
    stage->set_fixed_bytes(e.fixed_bytes);
    stage->set_param_bytes(e.param_bytes);
    stage->set_activation_bytes(e.memory_bytes - stage->fixed_bytes());
    stage->set_fwd_ms(e.fwd_ms);
    stage->set_bwd_ms(e.bwd_ms);
    stage->set_comm_ms(e.comm_ms);
    stage->set_allreduce_ms(e.allreduce_ms);
    stage->set_host_step_ms(e.host_step_ms);
    stage->set_kept_on_device_bytes(e.kept_bytes);
    stage->set_micro_batch(e.micro_batch);
    std::set<int> params;
    for (int n = stage->first_node(); n < static_cast<int>(stage->end_node()); ++n) {
      stage->add_ops(ir.nodes[n].label);
      for (int v : ir.nodes[n].inputs) {
        if (v >= static_cast<int>(ir.num_user_inputs) && v < static_cast<int>(ir.inputs.size())) {
          params.insert(v - static_cast<int>(ir.num_user_inputs));
        }
      }
    }
    for (int p : params) stage->add_params(ir.tensor_names[p]);
  }

  if (config.verify_partitioning) {
    std::vector<int> stage_starts;
    for (const v1::DeploymentStage& st : d.stages()) stage_starts.push_back(st.first_node());
    absl::Status verified = VerifySplit(ir, stage_starts, tensors, example_inputs);
    if (!verified.ok()) return verified;
  }
  d.set_profiling_seconds(profiling_s);
  d.set_planning_seconds(SecondsSince(start));
  return d;
}

}  // namespace planner
}  // namespace rannc
