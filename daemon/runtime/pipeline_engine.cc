// The pipeline engine's setup and its public face (pipeline_engine.h): Init checks the plan
// against the model and the devices, routes each stage's inputs and outputs, copies the stages'
// tensors to their devices, builds the stage executors, workers and communicators; the
// PipelineEngine methods forward to the Impl (pipeline_engine_impl.h), whose steps are in
// pipeline_engine_step.cc and whose parameters and optimizers are in pipeline_engine_params.cc.
#include "daemon/runtime/pipeline_engine.h"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/comm/counting.h"
#include "daemon/graph/subgraph.h"
#include "daemon/optim/grad_norm.h"
#include "daemon/runtime/host_staged_communicator.h"
#include "daemon/runtime/pipeline_engine_impl.h"

namespace rannc {
namespace {

using pipeline_internal::Device;
using pipeline_internal::kMaxMicroBatches;
using pipeline_internal::kMaxValues;
using pipeline_internal::OutputKind;
using pipeline_internal::Phase;
using pipeline_internal::StageInfo;
using pipeline_internal::Tag;
using pipeline_internal::Worker;
using std::chrono::milliseconds;

std::atomic<int> engine_count{0};

using Clock = std::chrono::steady_clock;
// Seconds (and bytes) of Init's parts, for its log line.
struct InitTimings {
  double routing_s = 0;  // checking the plan, building the stages' subgraphs
  double copy_s = 0;     // the stages' parameters and buffers to their devices
  int64_t copied_bytes = 0;
  double offload_s = 0;    // pinning offloaded parameters
  double executors_s = 0;  // subgraphs, stage executors (constants placed, code compiled), workers
  double communicators_s = 0;
};

// The trainable parameters an offloaded stage keeps on the device
// (DeploymentStage::kept_on_device_bytes): whole parameters in the order the stage's nodes
// first read them, up to the first that does not fit in `bytes` (the planner counts their
// gradients as the backward reaches the blocks that read them first, the last blocks the
// backward runs: planner/cost_eval_internal.h, KeepOnDevice). Not the `tied` ones (read by
// several stages): every holder steps its copy, and they must step alike, on the host all of
// them.
std::set<int> KeptOnDevice(const IrGraph& ir, const StageInfo& st,
                           const std::vector<at::Tensor>& lifted, const std::vector<int>& tied,
                           int64_t bytes) {
  std::set<int> params(st.params.begin(), st.params.end());
  for (int li : tied) params.erase(li);
  std::set<int> seen, kept;
  const int users = static_cast<int>(ir.num_user_inputs);
  for (int n = st.first; n < st.end; ++n) {
    for (int v : ir.nodes[n].inputs) {
      const int li = v - users;
      if (v >= static_cast<int>(ir.inputs.size()) || li < 0 || !params.count(li) ||
          !seen.insert(li).second) {
        continue;
      }
      const int64_t size = static_cast<int64_t>(lifted[li].nbytes());
      if (size > bytes) return kept;
      kept.insert(li);
      bytes -= size;
    }
  }
  return kept;
}

}  // namespace

absl::Status PipelineEngine::Impl::Init(const IrGraph& ir, const v1::Deployment& plan,
                                        const std::vector<at::Tensor>& lifted,
                                        const EngineOptions& options) {
  const Clock::time_point start = Clock::now();
  InitTimings timings;
  ir_ = &ir;
  zero_ = options.zero;
  offload_ = options.offload;
  offload_block_bytes_ = options.offload_block_bytes;
  offload_low_precision_ = options.offload_low_precision;
  amp_cast_group_bytes_ = options.amp_cast_group_bytes;
  outputs_before_backward_ = options.outputs_before_backward;
  before_host_step_unit_ = options.before_host_step_unit;
  host_memory_available_ = options.host_memory_available;
  bucket_bytes_ = options.bucket_bytes;
  grad_wire_dtype_ = options.grad_wire_dtype;
  scaler_ = options.loss_scaler;
  const AmpDtype amp = options.amp;
  timeout_ = options.timeout;
  cancel_ = options.cancel;
  checkpoint_memory_ = options.checkpoint_memory;
  counters_ = options.counters;
  const comm::Backend backend = options.backend;
  const int num_devices = options.num_devices;
  id_ = !options.group.empty() ? options.group
                               : absl::StrCat("pipeline_engine", engine_count.fetch_add(1));
  const int num_nodes = static_cast<int>(ir.nodes.size());
  if (lifted.size() != ir.tensor_names.size()) {
    return absl::InvalidArgumentError(absl::StrCat(lifted.size(), " lifted tensors for ",
                                                   ir.tensor_names.size()));
  }
  if (plan.model_hash() != ir.hash) {
    return absl::InvalidArgumentError("the deployment was planned for another model");
  }
  if (static_cast<int>(plan.num_nodes()) != num_nodes) {
    return absl::InvalidArgumentError(absl::StrCat("the deployment has ", plan.num_nodes(),
                                                   " atomic nodes, the model ", num_nodes));
  }
  if (plan.stages_size() == 0) return absl::InvalidArgumentError("the deployment has no stages");
  if (plan.micro_batches() < 1 || plan.micro_batches() >= kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported micro-batch count ", plan.micro_batches()));
  }
  if (ir.values.size() >= static_cast<size_t>(kMaxValues)) {
    return absl::UnimplementedError("too many IR values for the transfer tags");
  }
  if (ir.outputs.empty()) return absl::InvalidArgumentError("the model has no outputs");
  if (!options.placement.empty() &&
      static_cast<int>(options.placement.size()) != num_devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a placement of ", options.placement.size(), " devices for ", num_devices));
  }
  for (const c10::Device& place : options.placement) {
    if (!place.is_cpu() && !place.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot run a stage on ", place.str()));
    }
  }
  micro_batches_ = static_cast<int>(plan.micro_batches());
  schedule_ = plan.schedule() == v1::SCHEDULE_GPIPE ? ScheduleKind::kGPipe : ScheduleKind::k1F1B;

  // Stages: contiguous, covering every node; devices valid and used once.
  world_rank_.assign(std::max(num_devices, 0), -1);
  std::vector<int> stage_of_node(num_nodes, -1);
  int next = 0;
  std::set<int> used;
  for (int s = 0; s < plan.stages_size(); ++s) {
    const v1::DeploymentStage& ps = plan.stages(s);
    StageInfo st;
    st.first = static_cast<int>(ps.first_node());
    st.end = static_cast<int>(ps.end_node());
    if (st.first != next || st.end <= st.first || st.end > num_nodes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", s, " runs nodes [", st.first, ", ", st.end, "); expected to start at ", next,
          " and end by ", num_nodes));
    }
    next = st.end;
    if (ps.devices_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", s, " has no devices"));
    }
    for (uint32_t dev : ps.devices()) {
      if (static_cast<int>(dev) >= num_devices) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", s, " uses device ", dev, " of ", num_devices));
      }
      if (!used.insert(static_cast<int>(dev)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("device ", dev, " appears more than once in the deployment"));
      }
      st.devices.push_back(static_cast<int>(dev));
    }
    for (int n = st.first; n < st.end; ++n) stage_of_node[n] = s;
    stages_.push_back(std::move(st));
  }
  if (next != num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the stages cover nodes [0, ", next, ") of ", num_nodes));
  }

  // Routing: where each stage's data inputs come from, where its outputs go.
  const int S = static_cast<int>(stages_.size());
  std::vector<int> holders(lifted.size(), 0);
  for (int s = 0; s < S; ++s) {
    StageInfo& st = stages_[s];
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, st.first, st.end);
    if (!sub.ok()) return Annotate(sub.status(), absl::StrCat("stage ", s));
    for (int v : sub->inputs) {
      const int li = v - static_cast<int>(ir.num_user_inputs);
      if (v < static_cast<int>(ir.inputs.size()) && li >= 0) {
        st.lifted.push_back(li);
        // A frozen parameter (requires_grad=False) is a constant here, as in PyTorch.
        if (ir.values[v].role == ValueRole::kParam && lifted[li].requires_grad()) {
          st.params.push_back(li);
          ++holders[li];
        }
      } else {
        st.data_inputs.push_back(v);
        int user = -1;
        for (size_t i = 0; i < ir.num_user_inputs; ++i) {
          if (ir.inputs[i] == v) user = static_cast<int>(i);
        }
        if (user >= 0) {
          st.source.push_back(-1 - user);
        } else {
          const int producer = ir.values[v].producer;
          if (producer < 0 || stage_of_node[producer] >= s) {
            return absl::InternalError(absl::StrCat("stage ", s, " reads value ",
                                                    ir.values[v].name,
                                                    " that no earlier stage produces"));
          }
          const int p = stage_of_node[producer];
          if (!ir.values[v].is_tensor) {
            return absl::InternalError(
                absl::StrCat("non-tensor value ", ir.values[v].name, " crosses stages"));
          }
          st.source.push_back(p);
        }
      }
    }
    st.outputs = sub->outputs;
    st.consumers.assign(st.outputs.size(), {});
  }
  for (int q = 0; q < S; ++q) {
    for (size_t j = 0; j < stages_[q].data_inputs.size(); ++j) {
      const int p = stages_[q].source[j];
      if (p < 0) continue;
      const int v = stages_[q].data_inputs[j];
      bool found = false;
      for (size_t k = 0; k < stages_[p].outputs.size(); ++k) {
        if (stages_[p].outputs[k] == v) {
          stages_[p].consumers[k].push_back(q);
          found = true;
        }
      }
      if (!found) {
        return absl::InternalError(absl::StrCat("stage ", p, " does not output ",
                                                ir.values[v].name, " that stage ", q, " reads"));
      }
    }
  }
  // Outputs: how each is assembled, and whether forward and backward can be fused.
  for (const StageInfo& st : stages_) {
    for (int v : st.outputs) {
      const IrValue& val = ir.values[v];
      if (!val.is_output) continue;
      OutputKind kind = OutputKind::kFirst;
      if (val.batch_dim >= 0) {
        kind = OutputKind::kBatched;
      } else if (val.reduction == IrValue::Reduction::kMean) {
        kind = OutputKind::kMean;
      } else if (val.reduction == IrValue::Reduction::kSum) {
        kind = OutputKind::kSum;
      }
      stage_outputs_[v] = kind;
    }
  }
  for (int v : ir.outputs) {
    const int index = static_cast<int>(std::find(ir.inputs.begin(), ir.inputs.end(), v) -
                                       ir.inputs.begin());
    if (stage_outputs_.count(v)) {
      output_kinds_.push_back(stage_outputs_[v]);
    } else if (index < static_cast<int>(ir.num_user_inputs)) {
      output_kinds_.push_back(OutputKind::kUserInput);
    } else if (index < static_cast<int>(ir.inputs.size())) {
      output_kinds_.push_back(OutputKind::kLifted);
    } else {
      return absl::UnimplementedError(absl::StrCat(
          "model output ", ir.values[v].name, " is computed by no stage"));
    }
  }
  if (!ir.batch_separable) {
    bool splits = micro_batches_ > 1;
    for (const StageInfo& st : stages_) splits = splits || st.devices.size() > 1;
    if (splits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the plan splits the batch, but ", ir.not_separable,
          "; plan it with one micro-batch and one replica per stage"));
    }
  }
  // A value whose samples interleave with other rows cannot be cut into rows per sample: it
  // may cross only between stages of one replica count, where each replica's share goes whole.
  for (int q = 0; q < S; ++q) {
    for (size_t j = 0; j < stages_[q].data_inputs.size(); ++j) {
      const int p = stages_[q].source[j];
      const IrValue& value = ir.values[stages_[q].data_inputs[j]];
      if (p >= 0 && value.interleave > 1 &&
          stages_[p].devices.size() != stages_[q].devices.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the plan cuts %", value.name, " between stage ", p, " (",
            stages_[p].devices.size(), " replicas) and stage ", q, " (",
            stages_[q].devices.size(), "), but its samples interleave with other rows (a "
            "reshape merged dimensions before the batch's into it); cut the model elsewhere"));
      }
    }
  }
  fused_ = FusesForwardBackward(ir);

  for (size_t i = 0; i < lifted.size(); ++i) {
    lifted_shapes_.push_back(lifted[i].sizes().vec());
    lifted_types_.push_back(lifted[i].scalar_type());
    if (holders[i] > 1) tied_.push_back(static_cast<int>(i));
  }
  primary_.assign(lifted.size(), -1);

  timings.routing_s = SecondsSince(start);
  Clock::time_point phase;

  // Devices: own copies of the stage's tensors, an executor, a worker.
  for (int dev : used) {
    world_rank_[dev] = static_cast<int>(devices_.size());
    devices_.emplace_back();
    devices_.back().index = dev;
    devices_.back().local = options.local_devices.empty() ||
                            std::find(options.local_devices.begin(), options.local_devices.end(),
                                      dev) != options.local_devices.end();
    partial_ = partial_ || !devices_.back().local;
    devices_.back().lifted.assign(lifted.size(), at::Tensor());
    if (!options.placement.empty()) devices_.back().place = options.placement[dev];
  }
  for (int dev : options.local_devices) {
    if (!used.count(dev)) {
      return absl::InvalidArgumentError(
          absl::StrCat("local device ", dev, " is not one of the plan's devices"));
    }
  }
  saver_.assign(lifted.size(), -1);
  for (int s = S - 1; s >= 0; --s) {
    for (int li : stages_[s].params) primary_[li] = world_rank_[stages_[s].devices[0]];
    for (int li : stages_[s].lifted) saver_[li] = world_rank_[stages_[s].devices[0]];
  }
  for (int& saver : saver_) {
    if (saver < 0) saver = world_rank_[stages_[0].devices[0]];  // held by no stage
  }
  // A tensor's owner: the first of this process's devices holding it, by stage then replica.
  owner_.assign(lifted.size(), -1);
  for (int s = 0; s < S; ++s) {
    for (int dev : stages_[s].devices) {
      if (!devices_[world_rank_[dev]].local) continue;
      for (int li : stages_[s].lifted) {
        if (owner_[li] < 0) owner_[li] = world_rank_[dev];
      }
    }
  }
  // Offload's host memory for a CUDA device, page-locked in the sizes asked for (PinnedExact).
  if (offload_ && std::any_of(devices_.begin(), devices_.end(), [](const Device& d) {
        return d.local && d.place.is_cuda();
      })) {
    host_pool_ = PinnedPool::Create();
  }
  for (int s = 0; s < S; ++s) {
    for (size_t r = 0; r < stages_[s].devices.size(); ++r) {
      Device& d = devices_[world_rank_[stages_[s].devices[r]]];
      d.stage = s;
      d.replica = static_cast<int>(r);
      d.world_rank = world_rank_[d.index];
      if (!d.local) continue;  // another process runs it
      phase = Clock::now();
      // Offload streams a stage without replicas block by block (SetUpStreaming), keeping what
      // the plan says fits on the device (SetUpOffload).
      const bool streams = offload_ && offload_block_bytes_ > 0 && stages_[s].devices.size() == 1;
      if (streams) {
        d.kept = KeptOnDevice(ir, stages_[s], lifted, tied_,
                              static_cast<int64_t>(plan.stages(s).kept_on_device_bytes()));
      }
      absl::Status copied = TorchCall(absl::StatusCode::kInternal, "copying tensors", [&] {
        const std::set<int> params(stages_[s].params.begin(), stages_[s].params.end());
        for (int li : stages_[s].lifted) {
          // Offloaded parameters stay in host memory (SetUpOffload).
          const bool host_master = offload_ && params.count(li) && !d.kept.count(li);
          const c10::Device place = host_master ? c10::Device(c10::kCPU) : d.place;
          // A CUDA device's host masters go straight into page-locked memory (SetUpOffload),
          // not through a pageable copy that would be pinned again.
          at::Tensor t = host_master && d.place.is_cuda() ? PinnedExact(lifted[li]) : at::Tensor();
          if (t.defined()) {
            t.copy_(lifted[li].detach());
          } else {
            t = lifted[li].detach().to(place, lifted[li].scalar_type(), /*non_blocking=*/false,
                                       /*copy=*/true);
          }
          timings.copied_bytes += t.numel() * t.element_size();
          if (ir.values[ir.inputs[ir.num_user_inputs + li]].role == ValueRole::kParam &&
              lifted[li].requires_grad()) {
            t.requires_grad_(true);
          }
          d.lifted[li] = t;
        }
        return absl::OkStatus();
      });
      if (!copied.ok()) return copied;
      timings.copy_s += SecondsSince(phase);
      phase = Clock::now();
      if (offload_) SetUpOffload(d);  // before the executor takes the device handles
      timings.offload_s += SecondsSince(phase);
      phase = Clock::now();
      absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, stages_[s].first, stages_[s].end);
      if (!sub.ok()) return sub.status();
      StageOptions options;
      options.recompute = plan.stages(s).recompute();
      options.amp = amp;
      options.device = d.place;
      options.cast_group_bytes = amp_cast_group_bytes_;
      std::vector<int> blocks;
      if (streams) {
        blocks = ParamBlockStarts(ir, stages_[s].first, stages_[s].end, offload_block_bytes_);
      }
      absl::StatusOr<std::unique_ptr<StageExecutor>> exec =
          blocks.size() > 1 ? StageExecutor::CreateBlocked(ir, std::move(*sub), blocks, d.lifted,
                                                           options, StreamingHooks(d))
                            : StageExecutor::Create(ir, std::move(*sub), d.lifted, options);
      if (!exec.ok()) return Annotate(exec.status(), absl::StrCat("stage ", s));
      d.exec = std::move(*exec);
      if (d.exec->num_cast_groups() > 0) {
        spdlog::debug("engine {}: device {} casts its parameters in {} groups", id_, d.index,
                      d.exec->num_cast_groups());
      }
      if (d.exec->num_blocks() > 1) SetUpStreaming(d);
      if (d.exec->data_inputs() != stages_[s].data_inputs) {
        return absl::InternalError("stage executor's data inputs differ from the subgraph's");
      }
      d.worker = std::make_unique<Worker>(d.place);
      // The device's allocations are its worker's: count them there (the step's peak).
      d.memory = std::make_shared<MemoryTracker>(d.place);
      d.worker
          ->Post([memory = d.memory] {
            c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, memory);
            return absl::OkStatus();
          })
          .get()
          .IgnoreError();
      timings.executors_s += SecondsSince(phase);
    }
  }
  phase = Clock::now();

  // Communicators, created concurrently on the devices' threads (each blocks for its group).
  if (options.store == nullptr) {
    owned_store_ = comm::MakeInMemoryStore();
    store_ = owned_store_.get();
  } else {
    store_ = options.store;
  }
  const int W = static_cast<int>(devices_.size());
  std::vector<std::future<absl::Status>> done;
  for (Device& d : devices_) {
    if (!d.local) continue;
    done.push_back(d.worker->Post([this, &d, backend, W]() -> absl::Status {
      // One device: nothing to exchange.
      if (W == 1) return absl::OkStatus();
      absl::StatusOr<std::unique_ptr<comm::Communicator>> world =
          MakeDeviceCommunicator(d, backend, absl::StrCat(id_, "/world"), d.world_rank, W);
      if (!world.ok()) return Annotate(world.status(), absl::StrCat("device ", d.index));
      d.world = std::move(*world);
      const int R = static_cast<int>(stages_[d.stage].devices.size());
      if (R > 1) {
        absl::StatusOr<std::unique_ptr<comm::Communicator>> reps = MakeDeviceCommunicator(
            d, backend, absl::StrCat(id_, "/stage", d.stage), d.replica, R);
        if (!reps.ok()) return Annotate(reps.status(), absl::StrCat("device ", d.index));
        d.replicas = std::move(*reps);
        std::vector<int> untied;
        for (int li : stages_[d.stage].params) {
          if (std::find(tied_.begin(), tied_.end(), li) == tied_.end()) untied.push_back(li);
        }
        absl::StatusOr<std::unique_ptr<GradReducer>> reducer = MakeReducer(d, untied);
        if (!reducer.ok()) return Annotate(reducer.status(), absl::StrCat("device ", d.index));
        d.reducer = std::move(*reducer);
      }
      return absl::OkStatus();
    }));
  }
  absl::Status status = absl::OkStatus();
  for (auto& f : done) {
    absl::Status s = f.get();
    if (status.ok() && !s.ok()) status = s;
  }
  if (!status.ok()) return status;
  timings.communicators_s = SecondsSince(phase);
  // Where a deployment's "place" time goes (issue 7); at info level only once it is worth
  // reading, so that tests making many small engines stay quiet.
  const double total_s = SecondsSince(start);
  if (host_pool_) {
    const PinnedPool::Stats pinned = host_pool_->stats();
    spdlog::info("engine {}: {} tensors of host masters in {:.3f} GB of page-locked memory "
                 "({:.3f} GB asked for; {:.3f} GB in LibTorch's allocator, which rounds each up "
                 "to a power of two; {:.3f} GB cached)",
                 id_, pinned.live_tensors, pinned.mapped_bytes / 1e9, pinned.live_bytes / 1e9,
                 pinned.live_power_of_two_bytes / 1e9, pinned.cached_bytes / 1e9);
  }
  spdlog::log(
      total_s >= 0.1 ? spdlog::level::info : spdlog::level::debug,
      "engine {}: {} local device(s) set up in {:.2f} s: routing {:.2f}, tensors to devices "
      "{:.2f} ({:.2f} GB, {:.1f} GB/s), offload pinning {:.2f}, stage executors {:.2f}, "
      "communicators {:.2f}",
      id_, std::count_if(devices_.begin(), devices_.end(), [](const Device& d) { return d.local; }),
      total_s, timings.routing_s, timings.copy_s, timings.copied_bytes / 1e9,
      timings.copy_s > 0 ? timings.copied_bytes / 1e9 / timings.copy_s : 0.0, timings.offload_s,
      timings.executors_s, timings.communicators_s);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<comm::Communicator>> PipelineEngine::Impl::MakeDeviceCommunicator(
    const Device& d, comm::Backend backend, const std::string& group, int rank, int size) const {
  comm::GroupOptions options{store_, group, rank, size, timeout_};
  if (d.place.is_cuda()) options.cuda_device = d.place.index();
  absl::StatusOr<std::unique_ptr<comm::Communicator>> c = comm::MakeCommunicator(backend, options);
  if (!c.ok()) return c;
  std::unique_ptr<comm::Communicator> counted =
      comm::CountBytes(std::move(*c), counters_ ? counters_->data_plane_bytes : nullptr);
  if (!d.place.is_cuda() || backend == comm::Backend::kNccl) return counted;
  // The host backends move host memory: a CUDA device's buffers go through it.
  return StageThroughHost(std::move(counted));
}

absl::StatusOr<std::unique_ptr<GradReducer>> PipelineEngine::Impl::MakeReducer(
    Device& d, const std::vector<int>& params) const {
  std::vector<at::Tensor> tensors;
  GradReducer::Options options;
  options.bucket_bytes = bucket_bytes_;
  options.wire_dtype = grad_wire_dtype_;
  // Offloaded: the device handles are empty between steps, and so are the buckets.
  options.transient = offload_;
  for (int li : params) {
    tensors.push_back(d.lifted[li]);
    if (offload_) options.numels.push_back(d.Master(li).numel());
  }
  return GradReducer::Create(std::move(tensors), d.replicas.get(), options);
}

PipelineEngine::PipelineEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineEngine::~PipelineEngine() {
  // Copies still reading the devices' memory (asynchronous reads) end before it is freed.
  impl_->AwaitAsyncReads();
}

absl::StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(
    const IrGraph& ir, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
    comm::Backend backend, int num_devices, std::chrono::milliseconds timeout) {
  EngineOptions options;
  options.backend = backend;
  options.num_devices = num_devices;
  options.timeout = timeout;
  return Create(ir, plan, lifted, options);
}

absl::StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(
    const IrGraph& ir, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
    const EngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  absl::Status s = impl->Init(ir, plan, lifted, options);
  if (!s.ok()) return s;
  return std::unique_ptr<PipelineEngine>(new PipelineEngine(std::move(impl)));
}

bool PipelineEngine::fused() const { return impl_->fused(); }
bool PipelineEngine::broken() const { return impl_->broken(); }
std::vector<int> PipelineEngine::devices() const { return impl_->device_indices(); }

absl::StatusOr<std::vector<at::Tensor>> PipelineEngine::Forward(
    const std::vector<at::Tensor>& inputs, bool requires_grad) {
  return impl_->Forward(inputs, requires_grad);
}

absl::Status PipelineEngine::Backward(
    const std::vector<std::pair<size_t, at::Tensor>>& output_grads, bool retain_graph) {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->Backward(output_grads, retain_graph);
}

void PipelineEngine::SetDelayGradReduction(bool delay) { impl_->SetDelayGradReduction(delay); }
bool PipelineEngine::grads_pending() const { return impl_->grads_pending(); }
absl::Status PipelineEngine::AllReduceGrads() {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->AllReduceGrads();
}

absl::StatusOr<StepResult> PipelineEngine::TrainStep(const std::vector<at::Tensor>& inputs) {
  absl::StatusOr<std::vector<at::Tensor>> out = impl_->Forward(inputs, true);
  if (!out.ok()) return out.status();
  absl::Status back = Backward({{0, at::ones_like((*out)[0])}}, false);
  if (!back.ok()) return back;
  return StepResult{(*out)[0]};
}

absl::StatusOr<at::Tensor> PipelineEngine::Grad(const std::string& tensor_name,
                                                int device) const {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  absl::StatusOr<const at::Tensor*> t = impl_->Find(tensor_name, device);
  if (!t.ok()) return t.status();
  if (!(*t)->requires_grad()) {
    return absl::NotFoundError(absl::StrCat(tensor_name, " is not a parameter"));
  }
  const auto& names = impl_->tensor_names();
  const int lifted = static_cast<int>(std::find(names.begin(), names.end(), tensor_name) -
                                      names.begin());
  return impl_->GradCopy(lifted, **t);
}

absl::StatusOr<at::Tensor> PipelineEngine::Param(const std::string& tensor_name,
                                                 int device) const {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  absl::StatusOr<const at::Tensor*> t = impl_->Find(tensor_name, device);
  if (!t.ok()) return t.status();
  const auto& names = impl_->tensor_names();
  return impl_->ParamValue(
      static_cast<int>(std::find(names.begin(), names.end(), tensor_name) - names.begin()),
      device);
}

at::Tensor PipelineEngine::GradAt(int lifted) const {
  impl_->SettleHostStepsKeepingFailure();
  const at::Tensor t = impl_->OwnerTensor(lifted);
  return t.defined() ? impl_->GradCopy(lifted, t) : at::Tensor();
}

at::Tensor PipelineEngine::ParamAt(int lifted) const {
  impl_->SettleHostStepsKeepingFailure();
  return impl_->ParamValue(lifted);
}

bool PipelineEngine::Holds(int lifted) const { return impl_->Holds(lifted); }
at::Tensor PipelineEngine::HostMaster(int lifted) const {
  impl_->SettleHostStepsKeepingFailure();
  return impl_->HostMaster(lifted);
}
bool PipelineEngine::Saves(int lifted) const { return impl_->Saves(lifted); }

void PipelineEngine::SetParam(int lifted, const at::Tensor& value) {
  impl_->SettleHostStepsKeepingFailure();
  impl_->SetParam(lifted, value);
}
void PipelineEngine::AddGrad(int lifted, const at::Tensor& grad) {
  impl_->SettleHostStepsKeepingFailure();
  impl_->AddGrad(lifted, grad);
}
void PipelineEngine::AddGradShare(int lifted, const at::Tensor& grad) {
  impl_->SettleHostStepsKeepingFailure();
  impl_->AddGradShare(lifted, grad);
}
void PipelineEngine::ZeroGrad(bool set_to_none) { impl_->ZeroGrad(set_to_none); }
absl::StatusOr<double> PipelineEngine::ClipGradNorm(const std::vector<int>& params,
                                                    double max_norm, double norm_type) {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> named =
      impl_->GradNorms(params, norm_type);
  if (!named.ok()) return named.status();
  std::vector<at::Tensor> norms;
  for (auto& [li, norm] : *named) norms.push_back(norm);
  if (norms.empty()) return 0.0;
  const at::Tensor total = CombineNorms(norms, norm_type);
  impl_->ScaleGrads(params, ClipCoefficient(total, max_norm));
  return total.item<double>();
}
absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> PipelineEngine::GradNorms(
    const std::vector<int>& params, double norm_type) const {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->GradNorms(params, norm_type);
}
void PipelineEngine::ScaleGrads(const std::vector<int>& params, const at::Tensor& coefficient) {
  impl_->SettleHostStepsKeepingFailure();
  impl_->ScaleGrads(params, coefficient);
}
absl::Status PipelineEngine::SetOptimizer(OptimizerKind kind,
                                          const std::vector<std::vector<int>>& groups,
                                          const std::vector<HyperParams>& hypers,
                                          std::shared_ptr<const ScriptedUpdate> scripted) {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->SetOptimizer(kind, groups, hypers, std::move(scripted));
}
absl::Status PipelineEngine::Step(const std::vector<HyperParams>& hypers) {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->Step(hypers);
}
const LossScaler& PipelineEngine::loss_scaler() const { return impl_->loss_scaler(); }
std::map<int, std::vector<std::pair<std::string, at::Tensor>>> PipelineEngine::OptimizerState()
    const {
  impl_->SettleHostStepsKeepingFailure();
  return impl_->OptimizerState();
}
std::vector<PipelineEngine::StatePiece> PipelineEngine::OptimizerStatePieces() const {
  impl_->SettleHostStepsKeepingFailure();
  return impl_->OptimizerStatePieces();
}
void PipelineEngine::BeginAsyncReads() {
  impl_->SettleHostStepsKeepingFailure();
  impl_->BeginAsyncReads();
}

std::vector<int64_t> PipelineEngine::CheckpointCudaReads(const std::vector<int>& lifted) const {
  impl_->SettleHostStepsKeepingFailure();
  return impl_->CheckpointCudaReads(lifted);
}

std::function<void()> PipelineEngine::EndAsyncReads() { return impl_->EndAsyncReads(); }

absl::Status PipelineEngine::LoadOptimizerState(
    const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state) {
  if (absl::Status s = impl_->SettleHostSteps(); !s.ok()) return s;
  return impl_->LoadOptimizerState(state);
}
void PipelineEngine::ApplySgd(double lr) {
  impl_->SettleHostStepsKeepingFailure();
  impl_->ApplySgd(lr);
}
int64_t PipelineEngine::DeviceBytes(int device) const { return impl_->DeviceBytes(device); }
int64_t PipelineEngine::PeakDeviceBytes(int device) const {
  return impl_->PeakDeviceBytes(device);
}
void PipelineEngine::ResetPeakDeviceBytes() { impl_->ResetPeakDeviceBytes(); }
int PipelineEngine::StreamedBlocks(int device) const { return impl_->StreamedBlocks(device); }
int64_t PipelineEngine::StreamedPeakBytes(int device) const {
  return impl_->StreamedPeakBytes(device);
}
int64_t PipelineEngine::KeptOnDeviceBytes(int device) const {
  return impl_->KeptOnDeviceBytes(device);
}
std::pair<int, int> PipelineEngine::OverlappedBuckets(int device) const {
  return impl_->OverlappedBuckets(device);
}

}  // namespace rannc
