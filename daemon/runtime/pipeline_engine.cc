#include "daemon/runtime/pipeline_engine.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/graph/subgraph.h"
#include "daemon/runtime/grad_reducer.h"
#include "daemon/runtime/micro_batch.h"
#include "daemon/runtime/schedule.h"
#include "daemon/runtime/stage_executor.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {
namespace {

using std::chrono::milliseconds;

// Point-to-point tags on the all-devices group: bit 31 = gradient (backward), bits 30..20 the
// micro-batch, bits 19..0 the IR value. One transfer per (direction, micro-batch, value) between
// a pair of devices per step, so (tag, issue order) matching is unambiguous.
constexpr int kMaxMicroBatches = 1 << 11;
constexpr int kMaxValues = 1 << 20;
uint32_t Tag(bool backward, int micro_batch, int value) {
  return (backward ? (1u << 31) : 0u) | (static_cast<uint32_t>(micro_batch) << 20) |
         static_cast<uint32_t>(value);
}

// A thread running posted tasks in order.
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::future<absl::Status> Post(std::function<absl::Status()> fn) {
    auto task = std::make_shared<std::packaged_task<absl::Status()>>(std::move(fn));
    std::future<absl::Status> done = task->get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back([task] { (*task)(); });
    }
    cv_.notify_one();
    return done;
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is constructed
};

struct StageInfo {
  int first = 0, end = 0;
  std::vector<int> devices;  // global device index per replica
  std::vector<int> data_inputs, outputs;
  // Per data input: the stage producing it, or -1 - i for user input i.
  std::vector<int> source;
  // Per output: the later stages that read it.
  std::vector<std::vector<int>> consumers;
  std::vector<int> params;  // lifted indices of the parameters it reads
  std::vector<int> lifted;  // lifted indices it reads (parameters and buffers)
};

struct Device {
  int index = 0, stage = 0, replica = 0, world_rank = 0;
  bool local = true;  // run by this process (EngineOptions::local_devices)
  std::vector<at::Tensor> lifted;  // per IR lifted input; undefined where the stage reads none
  std::unique_ptr<StageExecutor> exec;
  std::unique_ptr<comm::Communicator> world, replicas;
  // Sums the stage's untied parameters' gradients over `replicas`, overlapped with the
  // device's last backward.
  std::unique_ptr<GradReducer> reducer;
  // Operations abandoned by a failed step, with the memory they may still write.
  std::vector<std::pair<std::unique_ptr<comm::Work>, at::Tensor>> abandoned;
  // Per StageInfo::params: the gradients of a fused forward, waiting for the client's Backward.
  std::vector<at::Tensor> fused_grads;
  // This step's outputs without a batch dimension (IR value -> sum or first shard's).
  std::map<int, at::Tensor> partial;
  std::unique_ptr<Optimizer> optimizer;
  std::vector<int> optimizer_params;  // lifted index per optimizer param (across groups)
  std::unique_ptr<Worker> worker;
};

// How a model output is assembled from the shards that compute it (see the header).
enum class OutputKind { kBatched, kMean, kSum, kFirst, kUserInput, kLifted };

enum class Phase {
  kFused,     // forwards and backwards in the plan's schedule, output gradient 1 for the loss
  kForward,   // every micro-batch's forward (keeping graphs when the step requires grad)
  kBackward,  // every micro-batch's backward, GPipe order, with the client's output gradients
};

std::atomic<int> engine_count{0};

}  // namespace

class PipelineEngine::Impl {
 public:
  ~Impl() {
    for (Device& d : devices_) d.worker.reset();  // joins
    for (Device& d : devices_) {
      d.optimizer.reset();
      d.reducer.reset();
      d.exec.reset();
      d.replicas.reset();
      d.world.reset();
    }
  }

  absl::Status Init(const IrGraph& ir, const v1::Deployment& plan,
                    const std::vector<at::Tensor>& lifted, const EngineOptions& options);
  bool fused() const { return fused_; }
  bool broken() const { return broken_; }
  std::vector<int> device_indices() const {
    std::vector<int> out;
    for (const Device& d : devices_) {
      if (d.local) out.push_back(d.index);
    }
    return out;
  }
  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad);
  absl::Status Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                        bool retain_graph);
  absl::StatusOr<const at::Tensor*> Find(const std::string& name, int device) const;
  at::Tensor OwnerTensor(int lifted) const {
    return owner_[lifted] < 0 ? at::Tensor() : devices_[owner_[lifted]].lifted[lifted];
  }
  void SetParam(int lifted, const at::Tensor& value);
  void AddGrad(int lifted, const at::Tensor& grad);
  void ZeroGrad(bool set_to_none);
  absl::StatusOr<double> ClipGradNorm(const std::vector<int>& params, double max_norm,
                                      double norm_type);
  absl::Status SetOptimizer(OptimizerKind kind, const std::vector<std::vector<int>>& groups);
  absl::Status Step(const std::vector<HyperParams>& hypers);
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> OptimizerState() const;
  absl::Status LoadOptimizerState(
      const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state);
  void ApplySgd(double lr);
  int64_t DeviceBytes(int device) const;

 private:
  using Pending = std::vector<std::pair<std::unique_ptr<comm::Work>, at::Tensor>>;
  struct StepPlan {
    Phase phase = Phase::kForward;
    bool requires_grad = false;
    int64_t batch = 0;
    std::vector<int64_t> mb_sizes, mb_offsets;
    const std::vector<at::Tensor>* inputs = nullptr;      // forward phases
    std::map<int, at::Tensor>* batched = nullptr;         // forward: full-batch outputs
    const std::map<int, at::Tensor>* grads = nullptr;     // backward: client output gradients
    bool retain_graph = false;                            // backward: keep the graphs
  };
  // What the last forward left for Backward.
  enum class Held { kNothing, kFusedGrads, kGraphs };

  int64_t PerSample(int v) const {
    const IrValue& val = ir_->values[v];
    return val.batch_dim < 0 ? 0 : val.shape[val.batch_dim] / ir_->example_batch;
  }
  std::vector<int64_t> ShapeFor(int v, int64_t count) const {
    const IrValue& val = ir_->values[v];
    std::vector<int64_t> shape = val.shape;
    if (val.batch_dim >= 0) shape[val.batch_dim] = count * PerSample(v);
    return shape;
  }
  at::Tensor Rows(const at::Tensor& t, int v, int64_t offset, int64_t count) const {
    const int bd = ir_->values[v].batch_dim;
    if (bd < 0) return t;
    const int64_t ps = PerSample(v);
    return t.narrow(bd, offset * ps, count * ps);
  }

  // The transfers of value `v` (of a micro-batch of `n` samples) from stage p to stage q.
  std::vector<Transfer> Transfers(int v, int64_t n, int p, int q) const {
    const int rp = static_cast<int>(stages_[p].devices.size());
    const int rq = static_cast<int>(stages_[q].devices.size());
    std::vector<Transfer> out;
    if (ir_->values[v].batch_dim < 0) {
      // Whole values, assumed the same on every replica (sizes, masks): consumer replica k
      // reads producer replica k % rp's. Replicas without samples (a micro-batch smaller than
      // the replica count) run nothing, so they neither send nor receive.
      for (int k = 0; k < rq && k < n; ++k) {
        const int src = k % rp < n ? k % rp : 0;
        out.push_back({src, k, 0, 0, 0});
      }
      return out;
    }
    for (const Transfer& t : Reshard(SplitSizes(n, rp), SplitSizes(n, rq))) {
      if (t.count > 0) out.push_back(t);
    }
    return out;
  }

  absl::Status CheckUsable() const {
    if (!broken_) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("an earlier step failed: ", first_error_.message()));
  }
  // Runs `fn` on every device's worker at once; the first error (annotated with the device)
  // breaks the engine when `breaks`.
  absl::Status OnEveryDevice(const std::function<absl::Status(Device&)>& fn, bool breaks);
  absl::Status Wait(Device& d, std::unique_ptr<comm::Work> work, at::Tensor keep,
                    const std::string& what);
  absl::Status WaitAll(Device& d, Pending& pending);
  absl::Status Send(Device& d, const at::Tensor& t, int dst_device, uint32_t tag,
                    Pending& pending);
  absl::Status Recv(Device& d, const at::Tensor& t, int src_device, uint32_t tag,
                    const std::string& what);
  absl::Status RunDevice(Device& d, const StepPlan& step);
  absl::Status RunForward(Device& d, const StepPlan& step, int mb, Pending& pending);
  absl::Status RunBackward(Device& d, const StepPlan& step, int mb, Pending& pending);
  absl::Status ReduceGrads(Device& d);

  const IrGraph* ir_ = nullptr;
  std::string id_;
  ScheduleKind schedule_ = ScheduleKind::k1F1B;
  int micro_batches_ = 1;
  bool fused_ = false;
  milliseconds timeout_{120000};
  std::unique_ptr<comm::Store> owned_store_;
  comm::Store* store_ = nullptr;  // owned_store_, or EngineOptions::store
  bool partial_ = false;          // some of the plan's devices belong to other processes
  std::vector<StageInfo> stages_;
  std::vector<Device> devices_;                 // the plan's devices, ascending index
  std::vector<int> world_rank_;                 // per global device index (-1: unused)
  std::vector<int> owner_;                      // per lifted tensor: world rank of its owner
  std::vector<int> tied_;                       // parameters read by several stages
  std::vector<std::vector<int64_t>> lifted_shapes_;
  std::vector<at::ScalarType> lifted_types_;
  std::vector<OutputKind> output_kinds_;        // per IR output
  std::map<int, OutputKind> stage_outputs_;     // IR value -> kind, for values stages produce
  std::atomic<bool> aborted_{false};
  bool broken_ = false;
  std::mutex error_mu_;
  absl::Status first_error_;

  // The last forward: its sizes, outputs' shapes and dtypes, what it left for Backward.
  StepPlan last_;
  int last_micro_batches_ = 0;
  std::vector<std::pair<at::ScalarType, std::vector<int64_t>>> last_outputs_;
  Held held_ = Held::kNothing;
};

absl::Status PipelineEngine::Impl::Init(const IrGraph& ir, const v1::Deployment& plan,
                                        const std::vector<at::Tensor>& lifted,
                                        const EngineOptions& options) {
  ir_ = &ir;
  timeout_ = options.timeout;
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
  fused_ = FusesForwardBackward(ir);

  for (size_t i = 0; i < lifted.size(); ++i) {
    lifted_shapes_.push_back(lifted[i].sizes().vec());
    lifted_types_.push_back(lifted[i].scalar_type());
    if (holders[i] > 1) tied_.push_back(static_cast<int>(i));
  }

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
  }
  for (int dev : options.local_devices) {
    if (!used.count(dev)) {
      return absl::InvalidArgumentError(
          absl::StrCat("local device ", dev, " is not one of the plan's devices"));
    }
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
  for (int s = 0; s < S; ++s) {
    for (size_t r = 0; r < stages_[s].devices.size(); ++r) {
      Device& d = devices_[world_rank_[stages_[s].devices[r]]];
      d.stage = s;
      d.replica = static_cast<int>(r);
      d.world_rank = world_rank_[d.index];
      if (!d.local) continue;  // another process runs it
      absl::Status copied = TorchCall(absl::StatusCode::kInternal, "copying tensors", [&] {
        for (int li : stages_[s].lifted) {
          at::Tensor t = lifted[li].detach().clone();
          if (ir.values[ir.inputs[ir.num_user_inputs + li]].role == ValueRole::kParam &&
              lifted[li].requires_grad()) {
            t.requires_grad_(true);
          }
          d.lifted[li] = t;
        }
        return absl::OkStatus();
      });
      if (!copied.ok()) return copied;
      absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, stages_[s].first, stages_[s].end);
      if (!sub.ok()) return sub.status();
      StageOptions options;
      options.recompute = plan.stages(s).recompute();
      absl::StatusOr<std::unique_ptr<StageExecutor>> exec =
          StageExecutor::Create(ir, std::move(*sub), d.lifted, options);
      if (!exec.ok()) return Annotate(exec.status(), absl::StrCat("stage ", s));
      d.exec = std::move(*exec);
      if (d.exec->data_inputs() != stages_[s].data_inputs) {
        return absl::InternalError("stage executor's data inputs differ from the subgraph's");
      }
      d.worker = std::make_unique<Worker>();
    }
  }

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
      absl::StatusOr<std::unique_ptr<comm::Communicator>> world = comm::MakeCommunicator(
          backend, {store_, absl::StrCat(id_, "/world"), d.world_rank, W, timeout_});
      if (!world.ok()) return Annotate(world.status(), absl::StrCat("device ", d.index));
      d.world = std::move(*world);
      const int R = static_cast<int>(stages_[d.stage].devices.size());
      if (R > 1) {
        absl::StatusOr<std::unique_ptr<comm::Communicator>> reps = comm::MakeCommunicator(
            backend, {store_, absl::StrCat(id_, "/stage", d.stage), d.replica, R,
                      timeout_});
        if (!reps.ok()) return Annotate(reps.status(), absl::StrCat("device ", d.index));
        d.replicas = std::move(*reps);
        std::vector<at::Tensor> untied;
        for (int li : stages_[d.stage].params) {
          if (std::find(tied_.begin(), tied_.end(), li) == tied_.end()) {
            untied.push_back(d.lifted[li]);
          }
        }
        absl::StatusOr<std::unique_ptr<GradReducer>> reducer =
            GradReducer::Create(std::move(untied), d.replicas.get(), {});
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
  return status;
}

absl::Status PipelineEngine::Impl::Wait(Device& d, std::unique_ptr<comm::Work> work,
                                        at::Tensor keep, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    absl::Status s = work->Wait(milliseconds(20));
    if (s.code() != absl::StatusCode::kDeadlineExceeded) {
      if (s.ok()) return s;
      return Annotate(s, what);
    }
    const bool late = std::chrono::steady_clock::now() >= deadline;
    if (late || aborted_.load()) {
      d.abandoned.emplace_back(std::move(work), std::move(keep));
      if (late) {
        return absl::DeadlineExceededError(absl::StrCat(
            what, ": not done after ", timeout_.count(), " ms"));
      }
      return absl::AbortedError(absl::StrCat(what, ": abandoned, another device failed"));
    }
  }
}

absl::Status PipelineEngine::Impl::WaitAll(Device& d, Pending& pending) {
  absl::Status status = absl::OkStatus();
  for (auto& [work, keep] : pending) {
    if (!status.ok()) {
      d.abandoned.emplace_back(std::move(work), std::move(keep));
      continue;
    }
    status = Wait(d, std::move(work), std::move(keep), "a send");
  }
  pending.clear();
  return status;
}

absl::Status PipelineEngine::Impl::Send(Device& d, const at::Tensor& t, int dst_device,
                                        uint32_t tag, Pending& pending) {
  at::Tensor data = t.detach().contiguous();
  absl::StatusOr<comm::Buffer> buf = BufferOf(data);
  if (!buf.ok()) return buf.status();
  pending.emplace_back(d.world->Send(*buf, world_rank_[dst_device], {tag}), data);
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::Recv(Device& d, const at::Tensor& t, int src_device,
                                        uint32_t tag, const std::string& what) {
  absl::StatusOr<comm::Buffer> buf = BufferOf(t);
  if (!buf.ok()) return buf.status();
  return Wait(d, d.world->Recv(*buf, world_rank_[src_device], {tag}), t,
              absl::StrCat(what, " from device ", src_device));
}

absl::Status PipelineEngine::Impl::OnEveryDevice(const std::function<absl::Status(Device&)>& fn,
                                                 bool breaks) {
  aborted_ = false;
  std::vector<std::future<absl::Status>> done;
  for (Device& d : devices_) {
    if (!d.local) continue;
    done.push_back(d.worker->Post([this, &d, &fn]() -> absl::Status {
      absl::Status s = TorchCall(absl::StatusCode::kInternal, "step", [&] { return fn(d); });
      if (!s.ok()) {
        s = Annotate(s, absl::StrCat("device ", d.index, " (stage ", d.stage, ", replica ",
                                     d.replica, ")"));
        aborted_ = true;
      }
      return s;
    }));
  }
  absl::Status first = absl::OkStatus();
  for (auto& f : done) {
    absl::Status s = f.get();
    // An abandoned wait is the consequence of another device's error, not the cause.
    if (!s.ok() && (first.ok() || (first.code() == absl::StatusCode::kAborted &&
                                   s.code() != absl::StatusCode::kAborted))) {
      first = s;
    }
  }
  if (!first.ok() && breaks) {
    broken_ = true;
    std::lock_guard<std::mutex> lock(error_mu_);
    first_error_ = first;
  }
  return first;
}

absl::Status PipelineEngine::Impl::RunForward(Device& d, const StepPlan& step, int mb,
                                              Pending& pending) {
  const IrGraph& ir = *ir_;
  const StageInfo& st = stages_[d.stage];
  const int R = static_cast<int>(st.devices.size());
  const int64_t n = step.mb_sizes[mb];
  const std::vector<int64_t> shards = SplitSizes(n, R);
  const int64_t my_off = Offsets(shards)[d.replica];
  const int64_t my_count = shards[d.replica];
  const double weight = static_cast<double>(my_count) / step.batch;
  if (my_count == 0) return absl::OkStatus();  // no samples of this micro-batch here
  std::vector<at::Tensor> in;
  for (size_t j = 0; j < st.data_inputs.size(); ++j) {
    const int v = st.data_inputs[j];
    const int p = st.source[j];
    if (p < 0) {
      in.push_back(Rows((*step.inputs)[-1 - p], v, step.mb_offsets[mb] + my_off, my_count));
      continue;
    }
    const IrValue& val = ir.values[v];
    at::Tensor x = at::empty(ShapeFor(v, my_count), at::TensorOptions().dtype(val.dtype));
    for (const Transfer& t : Transfers(v, n, p, d.stage)) {
      if (t.dst != d.replica) continue;
      const bool whole = val.batch_dim < 0 || (t.dst_offset == 0 && t.count == my_count);
      at::Tensor piece = whole ? x : at::empty(ShapeFor(v, t.count), x.options());
      absl::Status s = Recv(d, piece, stages_[p].devices[t.src], Tag(false, mb, v),
                            absl::StrCat("activation ", val.name, " of micro-batch ", mb));
      if (!s.ok()) return s;
      if (!whole) Rows(x, v, t.dst_offset, t.count).copy_(piece);
    }
    in.push_back(x);
  }
  absl::StatusOr<std::vector<at::Tensor>> out = d.exec->Forward(mb, in, step.requires_grad);
  if (!out.ok()) return Annotate(out.status(), absl::StrCat("micro-batch ", mb));
  for (size_t k = 0; k < st.outputs.size(); ++k) {
    const int v = st.outputs[k];
    auto kind = stage_outputs_.find(v);
    if (kind != stage_outputs_.end()) {
      at::Tensor value = (*out)[k].detach();
      at::Tensor& partial = d.partial[v];
      switch (kind->second) {
        case OutputKind::kBatched:
          Rows(step.batched->at(v), v, step.mb_offsets[mb] + my_off, my_count).copy_(value);
          break;
        case OutputKind::kMean:
          value = value.to(at::kDouble) * weight;
          partial = partial.defined() ? partial + value : value;
          break;
        case OutputKind::kSum:
          partial = partial.defined() ? partial + value : value.clone();
          break;
        default:
          if (mb == 0 && d.replica == 0) partial = value.clone();
          break;
      }
    }
    for (int q : st.consumers[k]) {
      for (const Transfer& t : Transfers(v, n, d.stage, q)) {
        if (t.src != d.replica) continue;
        absl::Status s = Send(d, Rows((*out)[k], v, t.src_offset, t.count),
                              stages_[q].devices[t.dst], Tag(false, mb, v), pending);
        if (!s.ok()) return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::RunBackward(Device& d, const StepPlan& step, int mb,
                                               Pending& pending) {
  const IrGraph& ir = *ir_;
  const StageInfo& st = stages_[d.stage];
  const int R = static_cast<int>(st.devices.size());
  const int64_t n = step.mb_sizes[mb];
  const std::vector<int64_t> shards = SplitSizes(n, R);
  const int64_t my_off = Offsets(shards)[d.replica];
  const int64_t my_count = shards[d.replica];
  const double weight = static_cast<double>(my_count) / step.batch;
  if (my_count == 0) return absl::OkStatus();  // no samples of this micro-batch here
  std::vector<at::Tensor> out_grads;
  for (size_t k = 0; k < st.outputs.size(); ++k) {
    const int v = st.outputs[k];
    const IrValue& val = ir.values[v];
    at::Tensor g;
    if (step.phase == Phase::kFused) {
      // The loss's gradient 1, through its combination of the shards.
      if (v == ir.outputs[0]) {
        g = at::full(ShapeFor(v, 0), stage_outputs_.at(v) == OutputKind::kMean ? weight : 1.0,
                     at::TensorOptions().dtype(val.dtype));
      }
    } else if (auto client = step.grads->find(v); client != step.grads->end()) {
      switch (stage_outputs_.at(v)) {
        case OutputKind::kBatched:
          g = Rows(client->second, v, step.mb_offsets[mb] + my_off, my_count);
          break;
        case OutputKind::kMean:
          g = client->second * weight;
          break;
        case OutputKind::kSum:
          if (at::isFloatingType(val.dtype)) g = client->second;
          break;
        case OutputKind::kFirst:
          if (mb == 0 && d.replica == 0) g = client->second;
          break;
        default:
          break;
      }
    }
    if (!st.consumers[k].empty() && at::isFloatingType(val.dtype)) {
      at::Tensor sum = at::zeros(ShapeFor(v, my_count), at::TensorOptions().dtype(val.dtype));
      for (int q : st.consumers[k]) {
        for (const Transfer& t : Transfers(v, n, d.stage, q)) {
          if (t.src != d.replica) continue;
          at::Tensor piece = at::empty(ShapeFor(v, val.batch_dim < 0 ? 0 : t.count),
                                       sum.options());
          absl::Status s = Recv(d, piece, stages_[q].devices[t.dst], Tag(true, mb, v),
                                absl::StrCat("gradient of ", val.name, " of micro-batch ", mb));
          if (!s.ok()) return s;
          Rows(sum, v, t.src_offset, t.count).add_(piece);
        }
      }
      g = g.defined() ? g + sum : sum;
    }
    out_grads.push_back(g);
  }
  absl::StatusOr<std::vector<at::Tensor>> in_grads =
      d.exec->Backward(mb, out_grads, step.retain_graph);
  if (!in_grads.ok()) return Annotate(in_grads.status(), absl::StrCat("micro-batch ", mb));
  for (size_t j = 0; j < st.data_inputs.size(); ++j) {
    const int p = st.source[j];
    const int v = st.data_inputs[j];
    const IrValue& val = ir.values[v];
    if (p < 0 || !at::isFloatingType(val.dtype)) continue;
    at::Tensor g = (*in_grads)[j];
    g = g.defined() ? g.to(val.dtype)
                    : at::zeros(ShapeFor(v, my_count), at::TensorOptions().dtype(val.dtype));
    for (const Transfer& t : Transfers(v, n, p, d.stage)) {
      if (t.dst != d.replica) continue;
      absl::Status s = Send(d, Rows(g, v, t.dst_offset, t.count), stages_[p].devices[t.src],
                            Tag(true, mb, v), pending);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::RunDevice(Device& d, const StepPlan& step) {
  const StageInfo& st = stages_[d.stage];
  const int S = static_cast<int>(stages_.size());
  const int m = static_cast<int>(step.mb_sizes.size());
  std::vector<PipelineOp> ops;
  switch (step.phase) {
    case Phase::kFused:
      ops = StageOps(schedule_, d.stage, S, m);
      break;
    case Phase::kForward:
      for (int mb = 0; mb < m; ++mb) ops.push_back({false, mb});
      break;
    case Phase::kBackward:
      for (int mb = m - 1; mb >= 0; --mb) ops.push_back({true, mb});
      break;
  }
  if (step.phase != Phase::kBackward) {
    // A new forward replaces whatever the previous one kept, as re-running a model does.
    for (int mb = 0; mb < last_micro_batches_; ++mb) d.exec->Release(mb);
    d.fused_grads.clear();
    d.partial.clear();
  }
  const bool backward = step.phase != Phase::kForward;
  std::vector<at::Tensor> params;
  for (int li : st.params) params.push_back(d.lifted[li]);
  // This step's gradients are kept apart until they are reduced.
  std::vector<at::Tensor> saved;
  if (backward) {
    for (at::Tensor& p : params) {
      saved.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
    }
  }
  // On failure the gradients accumulated before this step are put back.
  auto fail = [&](absl::Status s) {
    for (size_t i = 0; i < saved.size(); ++i) params[i].mutable_grad() = saved[i];
    return s;
  };
  Pending pending;
  for (size_t i = 0; i < ops.size(); ++i) {
    const PipelineOp& op = ops[i];
    // The device's last op is its last backward: the reducer starts each bucket's all-reduce
    // as soon as autograd has finished that bucket's gradients.
    if (backward && i + 1 == ops.size() && d.reducer) d.reducer->BeginFinalBackward();
    absl::Status s = op.backward ? RunBackward(d, step, op.micro_batch, pending)
                                 : RunForward(d, step, op.micro_batch, pending);
    if (!s.ok()) {
      WaitAll(d, pending).IgnoreError();
      return fail(s);
    }
  }
  absl::Status sent = WaitAll(d, pending);
  if (!sent.ok()) return fail(sent);
  if (!backward) return absl::OkStatus();
  absl::Status reduced = ReduceGrads(d);
  if (!reduced.ok()) return fail(reduced);
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor step_grad = params[i].grad();
    if (step.phase == Phase::kFused) {
      d.fused_grads.push_back(step_grad);
      params[i].mutable_grad() = saved[i];
    } else if (saved[i].defined()) {
      params[i].mutable_grad() = step_grad.defined() ? saved[i].add_(step_grad) : saved[i];
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::ReduceGrads(Device& d) {
  const StageInfo& st = stages_[d.stage];
  auto grad_of = [&](int li) -> at::Tensor {
    at::Tensor& p = d.lifted[li];
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
    return p.grad();
  };
  std::set<int> tied(tied_.begin(), tied_.end());
  // Tied parameters: over every device, the non-holders contributing zeros (this step's local
  // gradients, so the sum over all devices is the full gradient; no replica reduction).
  for (int li : tied_) {
    const bool holds = d.lifted[li].defined();
    at::Tensor g = holds ? grad_of(li)
                         : at::zeros(lifted_shapes_[li],
                                     at::TensorOptions().dtype(lifted_types_[li]));
    if (!d.world) continue;
    absl::StatusOr<comm::Buffer> buf = BufferOf(g);
    if (!buf.ok()) return buf.status();
    absl::Status s = Wait(d, d.world->AllReduce(*buf, {comm::ReduceOp::kSum}), g,
                          absl::StrCat("all-reducing the tied ", ir_->tensor_names[li]));
    if (!s.ok()) return s;
  }
  if (d.reducer) {
    absl::Status s = d.reducer->Finish(
        [&](std::unique_ptr<comm::Work> work, at::Tensor keep, const std::string& what) {
          return Wait(d, std::move(work), std::move(keep), what);
        });
    if (!s.ok()) return s;
  }
  for (int li : st.params) {
    if (!tied.count(li)) grad_of(li);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> PipelineEngine::Impl::Forward(
    const std::vector<at::Tensor>& inputs, bool requires_grad) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  const IrGraph& ir = *ir_;
  if (inputs.size() != ir.num_user_inputs) {
    return absl::InvalidArgumentError(
        absl::StrCat(inputs.size(), " inputs for ", ir.num_user_inputs));
  }
  StepPlan step;
  step.inputs = &inputs;
  step.requires_grad = requires_grad;
  step.phase = requires_grad && fused_ ? Phase::kFused : Phase::kForward;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int v = ir.inputs[i];
    const int bd = ir.values[v].batch_dim;
    if (bd < 0) continue;
    if (!inputs[i].defined() || inputs[i].dim() <= bd) {
      return absl::InvalidArgumentError(absl::StrCat("input ", i, " has no batch dimension"));
    }
    const int64_t ps = PerSample(v);
    const int64_t b = ps > 0 ? inputs[i].size(bd) / ps : 0;
    if (step.batch == 0) step.batch = b;
    if (b != step.batch || b * ps != inputs[i].size(bd)) {
      return absl::InvalidArgumentError(
          absl::StrCat("input ", i, "'s batch does not match the others' (", step.batch, ")"));
    }
  }
  if (step.batch <= 0) return absl::InvalidArgumentError("the inputs have no batch");
  // A batch smaller than the plan's (an epoch's last) runs in fewer micro-batches, as long as
  // each keeps one sample per replica; below that, replicas without samples sit a micro-batch
  // out (and all-reduce zeros).
  int64_t max_replicas = 1;
  for (const StageInfo& st : stages_) {
    max_replicas = std::max<int64_t>(max_replicas, st.devices.size());
  }
  const int m = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(micro_batches_, step.batch / max_replicas)));
  step.mb_sizes = SplitSizes(step.batch, m);
  step.mb_offsets = Offsets(step.mb_sizes);

  std::map<int, at::Tensor> batched;
  for (const auto& [v, kind] : stage_outputs_) {
    if (kind == OutputKind::kBatched) {
      // A partial engine's share: other processes' rows stay zeros.
      const at::TensorOptions type = at::TensorOptions().dtype(ir.values[v].dtype);
      batched[v] = partial_ ? at::zeros(ShapeFor(v, step.batch), type)
                            : at::empty(ShapeFor(v, step.batch), type);
    }
  }
  step.batched = &batched;
  held_ = Held::kNothing;
  absl::Status ran = OnEveryDevice([&](Device& d) { return RunDevice(d, step); }, true);
  last_micro_batches_ = m;
  if (!ran.ok()) return ran;

  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i < ir.outputs.size(); ++i) {
    const int v = ir.outputs[i];
    const IrValue& val = ir.values[v];
    at::Tensor out;
    switch (output_kinds_[i]) {
      case OutputKind::kBatched:
        out = batched.at(v);
        break;
      case OutputKind::kUserInput:
      case OutputKind::kLifted: {
        // Returned as they are; of several partial engines, the one running the plan's first
        // device returns them (the others zeros, so that members' outputs add up).
        const int index =
            static_cast<int>(std::find(ir.inputs.begin(), ir.inputs.end(), v) - ir.inputs.begin());
        if (partial_ && !devices_[0].local) {
          out = at::zeros(val.shape, at::TensorOptions().dtype(val.dtype));
        } else if (output_kinds_[i] == OutputKind::kUserInput) {
          out = inputs[index];
        } else {
          const at::Tensor held = OwnerTensor(index - static_cast<int>(ir.num_user_inputs));
          out = held.defined() ? held.detach().clone()
                               : at::zeros(val.shape, at::TensorOptions().dtype(val.dtype));
        }
        break;
      }
      default:
        for (const Device& d : devices_) {
          auto p = d.partial.find(v);
          if (p == d.partial.end()) continue;
          if (output_kinds_[i] == OutputKind::kFirst) {
            out = p->second;
            break;
          }
          out = out.defined() ? out + p->second : p->second;
        }
        if (!out.defined() && partial_) out = at::zeros(val.shape, at::kDouble);
        if (!out.defined()) return absl::InternalError(absl::StrCat("no shard computed ", val.name));
        out = out.to(val.dtype);
        break;
    }
    outputs.push_back(out);
  }
  last_ = step;
  last_.inputs = nullptr;
  last_.batched = nullptr;
  last_outputs_.clear();
  for (const at::Tensor& o : outputs) last_outputs_.push_back({o.scalar_type(), o.sizes().vec()});
  if (requires_grad) held_ = fused_ ? Held::kFusedGrads : Held::kGraphs;
  return outputs;
}

absl::Status PipelineEngine::Impl::Backward(
    const std::vector<std::pair<size_t, at::Tensor>>& output_grads, bool retain_graph) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  if (held_ == Held::kNothing) {
    return absl::FailedPreconditionError(
        "backward called with no forward pending: call forward (with gradients enabled) first, "
        "or keep_graph(True) to run backward twice over one forward");
  }
  std::map<int, at::Tensor> grads;
  for (const auto& [index, grad] : output_grads) {
    if (index >= last_outputs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ", but the model has ", last_outputs_.size(),
          " outputs"));
    }
    const auto& [dtype, shape] = last_outputs_[index];
    if (!grad.defined() || !grad.sizes().equals(shape) || grad.scalar_type() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient for output #", index, ": expected ", DescribeTensor(dtype, shape), ", got ",
          grad.defined() ? DescribeTensor(grad.scalar_type(), grad.sizes()) : "none"));
    }
    if (!at::isFloatingType(grad.scalar_type())) continue;
    const int v = ir_->outputs[index];
    at::Tensor& slot = grads[v];
    slot = slot.defined() ? slot + grad : grad.contiguous();
  }
  if (held_ == Held::kFusedGrads) {
    // Gradients are linear in the output gradient: add g x the fused forward's.
    auto loss_grad = grads.find(ir_->outputs[0]);
    const double g = loss_grad == grads.end() ? 0.0 : loss_grad->second.item<double>();
    at::NoGradGuard no_grad;
    for (Device& d : devices_) {
      const StageInfo& st = stages_[d.stage];
      for (size_t i = 0; i < d.fused_grads.size() && g != 0.0; ++i) {
        at::Tensor& grad = d.lifted[st.params[i]].mutable_grad();
        const at::Tensor& step = d.fused_grads[i];
        if (!step.defined()) continue;
        if (grad.defined()) {
          grad.add_(step, g);
        } else {
          grad = g == 1.0 && !retain_graph ? step : step * g;
        }
      }
      if (!retain_graph) d.fused_grads.clear();
    }
    if (!retain_graph) held_ = Held::kNothing;
    return absl::OkStatus();
  }
  StepPlan step = last_;
  step.phase = Phase::kBackward;
  step.grads = &grads;
  step.retain_graph = retain_graph;
  if (!retain_graph) held_ = Held::kNothing;
  return OnEveryDevice([&](Device& d) { return RunDevice(d, step); }, true);
}

absl::StatusOr<const at::Tensor*> PipelineEngine::Impl::Find(const std::string& name,
                                                             int device) const {
  for (size_t li = 0; li < ir_->tensor_names.size(); ++li) {
    if (ir_->tensor_names[li] != name) continue;
    if (device >= 0) {
      if (device < static_cast<int>(world_rank_.size()) && world_rank_[device] >= 0 &&
          devices_[world_rank_[device]].lifted[li].defined()) {
        return &devices_[world_rank_[device]].lifted[li];
      }
      break;
    }
    if (owner_[li] >= 0) return &devices_[owner_[li]].lifted[li];
  }
  return absl::NotFoundError(absl::StrCat("no stage", device >= 0 ? " on that device" : "",
                                          " holds a tensor named ", name));
}

void PipelineEngine::Impl::SetParam(int lifted, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  for (Device& d : devices_) {
    if (d.lifted[lifted].defined()) d.lifted[lifted].copy_(value);
  }
}

void PipelineEngine::Impl::AddGrad(int lifted, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  for (Device& d : devices_) {
    at::Tensor& p = d.lifted[lifted];
    if (!p.defined() || !p.requires_grad()) continue;
    if (p.grad().defined()) {
      p.mutable_grad().add_(grad);
    } else {
      p.mutable_grad() = grad.to(p.options()).clone();
    }
  }
}

void PipelineEngine::Impl::ZeroGrad(bool set_to_none) {
  for (Device& d : devices_) {
    for (at::Tensor& t : d.lifted) {
      if (!t.defined() || !t.grad().defined()) continue;
      if (set_to_none) {
        t.mutable_grad().reset();
      } else {
        t.mutable_grad().zero_();
      }
    }
  }
}

absl::StatusOr<double> PipelineEngine::Impl::ClipGradNorm(const std::vector<int>& params,
                                                          double max_norm, double norm_type) {
  at::NoGradGuard no_grad;
  // The same reductions, in the same order, as torch.nn.utils.clip_grad_norm_ (1.13), each
  // parameter's norm taken once, on its owner.
  std::vector<at::Tensor> norms;
  for (int li : params) {
    const at::Tensor t = OwnerTensor(li);
    if (!t.defined() || !t.grad().defined()) continue;
    norms.push_back(std::isinf(norm_type) ? t.grad().abs().max() : at::norm(t.grad(), norm_type));
  }
  if (norms.empty()) return 0.0;
  at::Tensor total;
  if (std::isinf(norm_type)) {
    total = norms.size() == 1 ? norms[0] : at::stack(norms).max();
  } else {
    total = at::norm(at::stack(norms), norm_type);
  }
  const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  std::set<int> selected(params.begin(), params.end());
  for (Device& d : devices_) {
    for (int li : selected) {
      at::Tensor& p = d.lifted[li];
      if (p.defined() && p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return total.item<double>();
}

absl::Status PipelineEngine::Impl::SetOptimizer(OptimizerKind kind,
                                                const std::vector<std::vector<int>>& groups) {
  for (Device& d : devices_) {
    std::vector<ParamGroup> device_groups;
    std::vector<int> order;
    for (const std::vector<int>& group : groups) {
      device_groups.emplace_back();
      for (int li : group) {
        if (li < 0 || li >= static_cast<int>(d.lifted.size())) {
          return absl::InvalidArgumentError(absl::StrCat("no lifted tensor ", li));
        }
        const at::Tensor& p = d.lifted[li];
        if (!p.defined() || !p.requires_grad()) continue;
        device_groups.back().params.push_back(p);
        order.push_back(li);
      }
    }
    absl::StatusOr<std::unique_ptr<Optimizer>> opt = MakeOptimizer(kind, std::move(device_groups));
    if (!opt.ok()) return Annotate(opt.status(), absl::StrCat("device ", d.index));
    d.optimizer = std::move(*opt);
    d.optimizer_params = std::move(order);
  }
  return absl::OkStatus();
}

absl::Status PipelineEngine::Impl::Step(const std::vector<HyperParams>& hypers) {
  absl::Status usable = CheckUsable();
  if (!usable.ok()) return usable;
  for (const Device& d : devices_) {
    if (!d.optimizer) return absl::FailedPreconditionError("the engine has no optimizer");
  }
  // Every device checks the same hypers against the same groups: all fail or none does.
  return OnEveryDevice([&](Device& d) { return d.optimizer->Step(hypers); }, false);
}

std::map<int, std::vector<std::pair<std::string, at::Tensor>>>
PipelineEngine::Impl::OptimizerState() const {
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> out;
  for (const Device& d : devices_) {
    if (!d.optimizer) continue;
    for (const auto& [name, value] : d.optimizer->NamedState()) {
      const size_t dot = name.find('.');
      const int li = d.optimizer_params[std::stoi(name.substr(0, dot))];
      if (owner_[li] != d.world_rank) continue;
      out[li].emplace_back(name.substr(dot + 1), value.detach().clone());
    }
  }
  return out;
}

absl::Status PipelineEngine::Impl::LoadOptimizerState(
    const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state) {
  for (Device& d : devices_) {
    if (!d.optimizer) return absl::FailedPreconditionError("the engine has no optimizer");
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < d.optimizer_params.size(); ++i) {
      auto it = state.find(d.optimizer_params[i]);
      if (it == state.end()) continue;
      for (const auto& [key, value] : it->second) {
        named.emplace_back(absl::StrCat(i, ".", key), value);
      }
    }
    absl::Status s = d.optimizer->LoadNamedState(named);
    if (!s.ok()) return Annotate(s, absl::StrCat("device ", d.index));
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::ApplySgd(double lr) {
  at::NoGradGuard no_grad;
  for (Device& d : devices_) {
    for (at::Tensor& t : d.lifted) {
      if (t.defined() && t.requires_grad() && t.grad().defined()) t.sub_(t.grad(), lr);
    }
  }
}

int64_t PipelineEngine::Impl::DeviceBytes(int device) const {
  if (device < 0 || device >= static_cast<int>(world_rank_.size()) || world_rank_[device] < 0) {
    return 0;
  }
  const Device& d = devices_[world_rank_[device]];
  int64_t bytes = 0;
  for (const at::Tensor& t : d.lifted) {
    if (!t.defined()) continue;
    bytes += t.nbytes();
    if (t.grad().defined()) bytes += t.grad().nbytes();
  }
  for (const at::Tensor& t : d.fused_grads) {
    if (t.defined()) bytes += t.nbytes();
  }
  if (d.optimizer) bytes += d.optimizer->StateBytes();
  return bytes;
}

PipelineEngine::PipelineEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineEngine::~PipelineEngine() = default;

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
  return impl_->Backward(output_grads, retain_graph);
}

absl::StatusOr<StepResult> PipelineEngine::TrainStep(const std::vector<at::Tensor>& inputs) {
  absl::StatusOr<std::vector<at::Tensor>> out = impl_->Forward(inputs, true);
  if (!out.ok()) return out.status();
  absl::Status back = impl_->Backward({{0, at::ones_like((*out)[0])}}, false);
  if (!back.ok()) return back;
  return StepResult{(*out)[0]};
}

absl::StatusOr<at::Tensor> PipelineEngine::Grad(const std::string& tensor_name,
                                                int device) const {
  absl::StatusOr<const at::Tensor*> t = impl_->Find(tensor_name, device);
  if (!t.ok()) return t.status();
  if (!(*t)->requires_grad()) {
    return absl::NotFoundError(absl::StrCat(tensor_name, " is not a parameter"));
  }
  const at::Tensor g = (*t)->grad();
  return g.defined() ? g.detach().clone() : at::Tensor();
}

absl::StatusOr<at::Tensor> PipelineEngine::Param(const std::string& tensor_name,
                                                 int device) const {
  absl::StatusOr<const at::Tensor*> t = impl_->Find(tensor_name, device);
  if (!t.ok()) return t.status();
  return (*t)->detach().clone();
}

at::Tensor PipelineEngine::GradAt(int lifted) const {
  const at::Tensor t = impl_->OwnerTensor(lifted);
  return t.defined() && t.grad().defined() ? t.grad().detach().clone() : at::Tensor();
}

at::Tensor PipelineEngine::ParamAt(int lifted) const {
  const at::Tensor t = impl_->OwnerTensor(lifted);
  return t.defined() ? t.detach().clone() : at::Tensor();
}

void PipelineEngine::SetParam(int lifted, const at::Tensor& value) {
  impl_->SetParam(lifted, value);
}
void PipelineEngine::AddGrad(int lifted, const at::Tensor& grad) { impl_->AddGrad(lifted, grad); }
void PipelineEngine::ZeroGrad(bool set_to_none) { impl_->ZeroGrad(set_to_none); }
absl::StatusOr<double> PipelineEngine::ClipGradNorm(const std::vector<int>& params,
                                                    double max_norm, double norm_type) {
  return impl_->ClipGradNorm(params, max_norm, norm_type);
}
absl::Status PipelineEngine::SetOptimizer(OptimizerKind kind,
                                          const std::vector<std::vector<int>>& groups) {
  return impl_->SetOptimizer(kind, groups);
}
absl::Status PipelineEngine::Step(const std::vector<HyperParams>& hypers) {
  return impl_->Step(hypers);
}
std::map<int, std::vector<std::pair<std::string, at::Tensor>>> PipelineEngine::OptimizerState()
    const {
  return impl_->OptimizerState();
}
absl::Status PipelineEngine::LoadOptimizerState(
    const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state) {
  return impl_->LoadOptimizerState(state);
}
void PipelineEngine::ApplySgd(double lr) { impl_->ApplySgd(lr); }
int64_t PipelineEngine::DeviceBytes(int device) const { return impl_->DeviceBytes(device); }

}  // namespace rannc
