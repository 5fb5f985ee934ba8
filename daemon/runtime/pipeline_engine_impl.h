// Private to //daemon/runtime:pipeline_engine: the engine's implementation class and the
// per-device state it drives, shared by pipeline_engine.cc (setup), pipeline_engine_params.cc
// (parameters, gradients, optimizers), pipeline_engine_step.cc (forward, backward and gradient
// reduction over the devices), pipeline_engine_offload.cc and pipeline_engine_zero.cc.
#ifndef RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_IMPL_H_
#define RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_IMPL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/comm/communicator.h"
#include "daemon/comm/store.h"
#include "daemon/common/memory_tracker.h"
#include "daemon/graph/ir.h"
#include "daemon/optim/optimizer.h"
#include "daemon/optim/split_optimizer.h"
#include "daemon/runtime/grad_reducer.h"
#include "daemon/runtime/micro_batch.h"
#include "daemon/runtime/pinned_pool.h"
#include "daemon/runtime/pipeline_engine.h"
#include "daemon/runtime/schedule.h"
#include "daemon/runtime/stage_executor.h"

namespace rannc {
namespace pipeline_internal {

// Point-to-point tags on the all-devices group: bit 31 = gradient (backward), bits 30..20 the
// micro-batch, bits 19..0 the IR value. One transfer per (direction, micro-batch, value) between
// a pair of devices per step, so (tag, issue order) matching is unambiguous.
constexpr int kMaxMicroBatches = 1 << 11;
constexpr int kMaxValues = 1 << 20;
inline uint32_t Tag(bool backward, int micro_batch, int value) {
  return (backward ? (1u << 31) : 0u) | (static_cast<uint32_t>(micro_batch) << 20) |
         static_cast<uint32_t>(value);
}

// A thread running posted tasks in order, with `place` its current device (for a CUDA device,
// so that LibTorch allocates there and launches on its default stream).
class Worker {
 public:
  explicit Worker(c10::Device place = c10::kCPU) : place_(place), thread_([this] { Loop(); }) {}
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
    if (!place_.is_cpu()) c10::impl::getDeviceGuardImpl(place_.type())->setDevice(place_);
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
  const c10::Device place_;
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

// ZeRO (EngineOptions::zero): a bucket of a stage's untied parameters of one optimizer param
// group and one dtype, at most EngineOptions::bucket_bytes (a larger parameter alone), laid out
// in one flat buffer whose slices they are (set_ onto its storage, so the stage executor and
// every reader see it), padded to a multiple of the replica count R. Replica r owns `shard`,
// elements [r * len, (r + 1) * len), i.e. chunk r of every partition: the optimizer's
// parameter there is `shard` itself, a leaf sharing the flat buffer's storage, and its grad()
// is this replica's slice of the gradient summed over the replicas. The gradients are
// reduce-scattered partition by partition by Device::zero_reducer, overlapped with each step's
// last backward, and the parameters keep no gradient between steps; after each optimizer step
// the shards are all-gathered into every replica's flat buffer.
//
// With offload, `shard` is a host tensor of its own (the master of the replica's slice of the
// parameters, with its gradient and optimizer state) and `flat` exists on the device only while
// the device is resident: Upload all-gathers the replicas' shards into it, Release frees it.
struct ZeroPartition {
  int group = 0;
  std::vector<int> params;       // lifted indices, in layout order
  std::vector<int64_t> offsets;  // each one's first element in `flat`
  at::Tensor flat;
  at::Tensor shard;
  int64_t shard_offset = 0, len = 0;
  at::Tensor fused_grad;  // a fused forward's shard gradient, waiting for Backward
};

struct Device {
  int index = 0, stage = 0, replica = 0, world_rank = 0;
  c10::Device place{c10::kCPU};  // EngineOptions::placement
  at::TensorOptions On(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(place);
  }
  // `t` on this device (`t` itself when it is there already).
  at::Tensor Here(const at::Tensor& t) const { return t.device() == place ? t : t.to(place); }
  bool local = true;  // run by this process (EngineOptions::local_devices)
  std::vector<at::Tensor> lifted;  // per IR lifted input; undefined where the stage reads none
  // Offload (EngineOptions::offload; pipeline_engine_offload.cc): per lifted index, the host
  // master of each of the stage's parameters: its value, its accumulated gradient, the
  // optimizer's parameter. Its `lifted` tensor (the executor's handle, a leaf on the device)
  // then holds the value only while `resident`, from Upload at a step's start to Release at
  // its end, and is empty otherwise. Undefined where not offloaded (`lifted` is the master:
  // buffers, and the parameters `kept` on the device), and for a ZeRO parameter, whose master
  // is its partition's host shard.
  std::vector<at::Tensor> host;
  bool resident = true;
  // Offload's streaming: the stage's trainable parameters kept on the device all the time
  // (DeploymentStage::kept_on_device_bytes), lifted indices. Their `host` is undefined: their
  // masters, gradients and optimizer state are on the device, stepped there (StartHostStep),
  // as without offload.
  std::set<int> kept;
  // `optimizer` when `kept` is not empty: its part 0 holds the kept parameters, stepped on the
  // worker (StepKept), part 1 the rest, stepped by the host step's thread at the same time.
  SplitOptimizer* optimizer_parts = nullptr;
  // Offload's streaming (EngineOptions::offload_block_bytes; pipeline_engine_offload.cc): per
  // block of the stage executor, the offloaded parameters that only it reads (lifted indices).
  // Their handles keep their shape and lose their memory between uses: a block's are on the
  // device from just before its forward or backward to just after it, and its gradients go to
  // the host (`streamed_grads`) as its backward ends. Parameters read by several blocks are
  // uploaded for the whole step, as without streaming. Empty without streaming.
  std::vector<std::vector<int>> streamed;
  // Per block: off the device, on it, or being prefetched (its copies may still run on
  // `upload_stream`, which `block_ready` marks the end of).
  enum class BlockState { kOff, kOn, kPrefetching };
  std::vector<BlockState> block_state;
  std::optional<c10::Stream> upload_stream;  // a CUDA device's: where prefetches copy
  std::vector<std::unique_ptr<c10::Event>> block_ready;
  // A CUDA device's: where blocks' gradients copy to the host while later blocks compute.
  std::optional<c10::Stream> download_stream;
  // Gradients of blocks whose backward has ended, copying on `download_stream` into page-locked
  // memory (`host`) until `done`; `device` is kept until then. Oldest first; added to
  // `streamed_grads` in that order.
  struct Download {
    std::vector<std::pair<int, at::Tensor>> device, host;  // (lifted index, gradient)
    std::unique_ptr<c10::Event> done;
  };
  std::deque<Download> downloads;
  std::vector<char> is_streamed;     // per lifted index
  bool Streamed(int li) const { return !is_streamed.empty() && is_streamed[li]; }
  // This step's gradients of streamed parameters so far, on the host, by lifted index.
  std::map<int, at::Tensor> streamed_grads;
  // Per lifted index: the narrower dtype a streamed parameter is read in when the forward reads
  // it only through a cast (graph/ir.h LowPrecisionRead: amp_level O2), else Undefined. Such a
  // parameter's handle takes that dtype: its uploads are `host_low`, a page-locked copy of its
  // master in that dtype cast once while the device is resident (`low_fresh`), and its
  // gradients come back in it, widened on the host. Half the bytes over the host link for bf16,
  // with the same values: the cast computes on the device what it computes on the host, and
  // its backward only widens the gradient.
  std::vector<at::ScalarType> low_dtype;
  std::vector<at::Tensor> host_low;
  std::vector<char> low_fresh;
  bool Low(int li) const {
    return !low_dtype.empty() && low_dtype[li] != at::ScalarType::Undefined;
  }
  // Bytes of streamed parameters on the device now, and the most at once since the engine began.
  int64_t streamed_bytes = 0, streamed_peak = 0;
  // Streaming: the optimizer's step of the host masters, running on a thread of its own
  // beside the next forward (pipeline_engine_host_step.cc). It steps `units` in the order that
  // forward reads them: the parameters uploaded whole (before the step returns), then each
  // block's streamed ones, and a block is fetched once its unit is done. Until `finished` the
  // thread alone touches the masters, their gradients and the optimizer: it took the
  // gradients (`grads`, by lifted index) and gives them back at its end, or drops them where
  // ZeroGrad came meanwhile (`zero_grad`: set_to_none).
  struct HostStep {
    std::vector<std::vector<int>> units;  // lifted indices
    std::vector<at::Tensor> grads;
    std::vector<HyperParams> hypers;
    // The kept parameters' step (StepKept) on the device's worker; the thread waits for it
    // before it finishes, and so does anything else touching their gradients or their
    // state's count meanwhile (AwaitKeptStep).
    std::shared_future<absl::Status> kept;
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;  // units stepped
    bool finished = false;
    absl::Status status;  // the first failure
    std::optional<bool> zero_grad;
    std::thread thread;
    // For the debug log (SettleHostSteps): when Step began, the thread's seconds, and the
    // seconds the forward waited for a unit.
    std::chrono::steady_clock::time_point started;
    double thread_s = 0, waited_s = 0;
    int64_t bytes = 0;  // the masters stepped
  };
  std::unique_ptr<HostStep> host_step;
  // ZeroGrad(false): the parameters (lifted indices) whose gradient is zeros without being
  // held: freed, and made again only where read (GradCopy) or stepped (Step), so that a step's
  // backward does not hold the zeros beside the gradients it computes. A parameter whose
  // gradient is defined again is not affected.
  std::set<int> zeroed;
  at::Tensor& Master(int li) { return !host.empty() && host[li].defined() ? host[li] : lifted[li]; }
  const at::Tensor& Master(int li) const {
    return !host.empty() && host[li].defined() ? host[li] : lifted[li];
  }
  std::unique_ptr<StageExecutor> exec;
  std::unique_ptr<comm::Communicator> world, replicas;
  // Sums the stage's untied parameters' gradients over `replicas`, overlapped with the
  // device's last backward.
  std::unique_ptr<GradReducer> reducer;
  // Operations abandoned by a failed step, with the memory they may still write.
  std::vector<std::pair<std::unique_ptr<comm::Work>, at::Tensor>> abandoned;
  // Per StageInfo::params: the gradients of a fused forward, waiting for the client's Backward.
  std::vector<at::Tensor> fused_grads;
  std::vector<ZeroPartition> zero;  // EngineOptions::zero, on a stage with replicas
  // ZeRO's reduce-scatter, one bucket per partition (in `zero`'s order). Its hooks issue
  // collectives on `replicas` during the last backward, so `reducer` is then armed only after
  // the backward, once this one has issued all of its buckets (the group's collectives must
  // be issued in the same order on every replica). Null without partitions.
  std::unique_ptr<GradReducer> zero_reducer;
  // This step's outputs without a batch dimension (IR value -> sum or first shard's).
  std::map<int, at::Tensor> partial;
  // A CUDA device's `partial` copied into page-locked memory as each micro-batch's forward
  // ends, and the event after the last copy (PartialOnHost): a forward call returns its outputs
  // once they are computed, not once the backward that a fused pass queued after them has run
  // too (the host's next work, an offloaded step's, then overlaps that backward's tail).
  std::map<int, at::Tensor> partial_host;
  std::unique_ptr<c10::Event> partial_ready;
  std::unique_ptr<Optimizer> optimizer;
  // Lifted index per optimizer param (across groups); -1 - k for the shard of zero[k].
  std::vector<int> optimizer_params;
  // An entry of optimizer->NamedState(), "<index>.<key>": its optimizer_params entry and key.
  std::pair<int, std::string> StateOf(const std::string& name) const {
    const size_t dot = name.find('.');
    return {optimizer_params[std::stoi(name.substr(0, dot))], name.substr(dot + 1)};
  }
  std::unique_ptr<Worker> worker;
  // The worker thread's LibTorch allocations, and the most this device has held at once
  // during a step: what it held when the step began plus the step's high-water mark.
  std::shared_ptr<MemoryTracker> memory;
  int64_t peak_bytes = 0;  // written by the worker during a step, read between steps
};

// How a model output is assembled from the shards that compute it (see the header).
enum class OutputKind { kBatched, kMean, kSum, kFirst, kUserInput, kLifted };

enum class Phase {
  kFused,     // forwards and backwards in the plan's schedule, output gradient 1 for the loss
  kForward,   // every micro-batch's forward (keeping graphs when the step requires grad)
  kBackward,  // every micro-batch's backward, GPipe order, with the client's output gradients
};

}  // namespace pipeline_internal

class PipelineEngine::Impl {
  using Device = pipeline_internal::Device;
  using StageInfo = pipeline_internal::StageInfo;
  using OutputKind = pipeline_internal::OutputKind;
  using Phase = pipeline_internal::Phase;
  using milliseconds = std::chrono::milliseconds;

 public:
  ~Impl() {
    SettleHostSteps().IgnoreError();
    for (Device& d : devices_) d.worker.reset();  // joins
    CloseHostPool();
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
  const std::vector<std::string>& tensor_names() const { return ir_->tensor_names; }
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
  void SetDelayGradReduction(bool delay) { delay_ = delay; }
  bool grads_pending() const { return pending_; }
  absl::Status AllReduceGrads();
  // Every device's optimizer step thread joined (Device::host_step): the first failure among
  // them, or one a call without a status kept. Every call of the engine that reads or writes
  // the masters, their gradients or the optimizer's state starts with it; a call that returns
  // no status keeps the failure for the next that does (SettleHostStepsKeepingFailure).
  absl::Status SettleHostSteps();
  void SettleHostStepsKeepingFailure();
  absl::StatusOr<const at::Tensor*> Find(const std::string& name, int device) const;
  // A copy of parameter `lifted`'s gradient as Grad defines it (undefined: none): `t`'s, or
  // while reductions are pending the sum over this process's holders, or for a ZeRO parameter
  // its replicas' shards assembled (FullGrad).
  at::Tensor GradCopy(int lifted, const at::Tensor& t) const;
  absl::Status CheckReduced(const char* what) const;
  // The master of lifted tensor `lifted` on its owner (undefined: none here; an empty tensor
  // for a ZeRO parameter with offload, whose value ParamValue assembles).
  at::Tensor OwnerTensor(int lifted) const {
    return owner_[lifted] < 0 ? at::Tensor() : devices_[owner_[lifted]].Master(lifted);
  }
  // Whether ParamValue(lifted) has a value (its owner holds it), without the copy.
  bool Holds(int lifted) const {
    return owner_[lifted] >= 0 && devices_[owner_[lifted]].lifted[lifted].defined();
  }
  bool Saves(int lifted) const { return devices_[saver_[lifted]].local; }
  at::Tensor HostMaster(int lifted) const;  // PipelineEngine::HostMaster
  // A copy of lifted tensor `lifted`'s value on `device` (-1: its owner); undefined when not
  // held there.
  at::Tensor ParamValue(int lifted, int device = -1) const;
  // Parameter `lifted`'s gradient, undefined when it has none (a ZeRO parameter's is assembled
  // from its stage's replicas' shards: a new tensor).
  at::Tensor FullGrad(int lifted) const;
  bool sharded(int lifted) const { return zero_slots_.count(lifted) > 0; }
  void SetParam(int lifted, const at::Tensor& value);
  void AddGrad(int lifted, const at::Tensor& grad);
  void AddGradShare(int lifted, const at::Tensor& grad);
  void ZeroGrad(bool set_to_none);
  absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> GradNorms(
      const std::vector<int>& params, double norm_type) const;
  void ScaleGrads(const std::vector<int>& params, const at::Tensor& coefficient);
  absl::Status SetOptimizer(OptimizerKind kind, const std::vector<std::vector<int>>& groups,
                            const std::vector<HyperParams>& hypers,
                            std::shared_ptr<const ScriptedUpdate> scripted);
  absl::Status Step(const std::vector<HyperParams>& hypers);
  const LossScaler& loss_scaler() const { return scaler_; }
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> OptimizerState() const;
  std::vector<PipelineEngine::StatePiece> OptimizerStatePieces() const;
  void BeginAsyncReads();
  std::function<void()> EndAsyncReads();
  // Returns once every asynchronous read ended (before the devices' memory goes).
  void AwaitAsyncReads() const;
  absl::Status LoadOptimizerState(
      const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state);
  void ApplySgd(double lr);
  // The device of plan index `device` when this process runs it; else null.
  const Device* DeviceAt(int device) const;
  int64_t DeviceBytes(int device) const;
  std::vector<int64_t> CheckpointCudaReads(const std::vector<int>& lifted) const;
  int64_t PeakDeviceBytes(int device) const;
  void ResetPeakDeviceBytes();
  int StreamedBlocks(int device) const;
  int64_t StreamedPeakBytes(int device) const;
  int64_t KeptOnDeviceBytes(int device) const;
  std::pair<int, int> OverlappedBuckets(int device) const;
  // What `d` holds between steps: parameters, buffers, gradients, optimizer state.
  int64_t HeldBytes(const Device& d) const;

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
    bool delay = false;  // leave the step's gradients unreduced (SetDelayGradReduction)
    // Reduced step gradients while reductions are pending: only each parameter's primary
    // holder adds them, so the sum over holders counts them once.
    bool primary_only = false;
  };
  // What the last forward left for Backward.
  enum class Held { kNothing, kFusedGrads, kGraphs };

  // Device `d`'s shard of micro-batch `mb`: the micro-batch's samples, where the shard starts
  // within it, its samples, and its share of the whole batch (its loss weight).
  struct MicroBatchShard {
    int64_t micro_batch = 0, offset = 0, count = 0;
    double weight = 0;
  };
  MicroBatchShard ShardOf(const Device& d, const StepPlan& step, int mb) const {
    MicroBatchShard shard;
    shard.micro_batch = step.mb_sizes[mb];
    const std::vector<int64_t> sizes =
        SplitSizes(shard.micro_batch, static_cast<int>(stages_[d.stage].devices.size()));
    shard.offset = Offsets(sizes)[d.replica];
    shard.count = sizes[d.replica];
    shard.weight = static_cast<double>(shard.count) / step.batch;
    return shard;
  }

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
  absl::Status RunDevice(Device& d, const StepPlan& step);  // RunDeviceOps, timed
  absl::Status RunDeviceOps(Device& d, const StepPlan& step);
  // Adds the time since `start` to counters_'s `counter` (nothing without counters).
  void CountSince(std::chrono::steady_clock::time_point start,
                  std::atomic<int64_t> EngineCounters::*counter) const;
  absl::Status RunForward(Device& d, const StepPlan& step, int mb, Pending& pending);
  absl::Status RunBackward(Device& d, const StepPlan& step, int mb, Pending& pending);
  // Sums `d`'s current gradients over the stage's replicas (tied ones over every device). Each
  // gradient is replaced only once all of the device's reductions have completed.
  absl::Status ReduceGrads(Device& d);
  // Step without loss scaling's check.
  absl::Status OptimizerStep(const std::vector<HyperParams>& hypers);
  // Loss scaling: multiplies a step's gradient by 1/scale in place (EngineOptions::loss_scaler).
  void Unscale(const at::Tensor& grad) const;
  // Whether any device of any process holds a gradient that is not finite (collective: every
  // device's all-reduce over the world group).
  absl::StatusOr<bool> FoundInf();
  // Rank `rank` of communicator group `group` (`size` ranks) for device `d`: on its CUDA device
  // (NCCL), or staged through host memory for a CUDA device on a host backend.
  absl::StatusOr<std::unique_ptr<comm::Communicator>> MakeDeviceCommunicator(
      const Device& d, comm::Backend backend, const std::string& group, int rank,
      int size) const;
  // The bucketed all-reduce of `params` (lifted indices) over `d`'s stage replicas.
  absl::StatusOr<std::unique_ptr<GradReducer>> MakeReducer(Device& d,
                                                           const std::vector<int>& params) const;
  // Before local gradients are added while none are pending: every holder has the reduced
  // gradient, so all but each parameter's primary holder drop theirs, which keeps the sum over
  // holders equal to it. Then reductions are pending.
  void BeginLocalGrads();

  // ZeRO (pipeline_engine_zero.cc). Where a sharded parameter lives: its partition's index in
  // Device::zero (the same on every replica of its stage) and its index in that partition.
  struct ZeroSlot {
    int stage = 0, partition = 0, index = 0;
  };
  std::map<int, ZeroSlot> zero_slots_;  // by lifted index
  // Lays out `d`'s partitions for the optimizer's `groups` (and rebuilds its reducer without
  // them); appends each partition's shard to its group in `device_groups`, and -1 - k to the
  // group's `ids`.
  absl::Status SetUpZero(Device& d, const std::vector<std::vector<int>>& groups,
                         std::vector<ParamGroup>* device_groups,
                         std::vector<std::vector<int>>* ids);
  // After a backward: finishes zero_reducer's reduce-scatters (the buckets not started during
  // the backward start now), leaving the parameters without gradients; per partition, this
  // replica's shard of the step's gradient, unscaled, where the shard's master is.
  absl::StatusOr<std::vector<at::Tensor>> ReduceScatterZero(Device& d);
  // Adds ReduceScatterZero's shards to the shards' gradients (a fused step's are kept apart in
  // fused_grad).
  void AddZeroShards(Device& d, std::vector<at::Tensor> shards, bool fused);
  // Backward(g) of a fused step: shard grad += g x fused_grad.
  void AddZeroFusedGrads(Device& d, double g, bool retain_graph);
  // After an optimizer step: every replica's flat buffers get every shard.
  absl::Status GatherZeroParams(Device& d);
  // Calls fn(shard slice, parameter slice) with the overlap of `d`'s shard and parameter i of
  // partition `part` (flattened), when they overlap.
  void ForShardSlice(const pipeline_internal::ZeroPartition& part, size_t i,
                     const std::function<void(int64_t shard_from, int64_t param_from,
                                              int64_t count)>& fn) const;
  void LoadZeroOptimizerState(
      const Device& d, const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state,
      std::vector<std::pair<std::string, at::Tensor>>* named) const;
  // Offload (pipeline_engine_offload.cc). At Init: the stage's parameters move to host masters
  // and the device handles are emptied.
  void SetUpOffload(Device& d);
  // On `d`'s worker, at a step's start: the parameters' values onto the device (ZeRO's
  // partitions all-gathered from the replicas' host shards). Nothing when already resident.
  absl::Status Upload(Device& d);
  // Frees the device copies of the parameters (and ZeRO's flat buffers) and their gradients.
  void Release(Device& d);
  // Streaming (Device::streamed). At Init, once the blocked executor exists: which parameters
  // stream, their handles shaped and emptied. The executor's hooks: a block's parameters onto
  // the device (Fetch), off it (Evict), its gradients to the host (BlockGradsToHost).
  void SetUpStreaming(Device& d);
  StageBlockHooks StreamingHooks(Device& d);
  absl::Status Fetch(Device& d, int block);
  // What streamed parameter `li`'s upload copies: its master, or (Device::low_dtype) the master
  // cast to the narrower dtype, cast now if not yet since the device became resident.
  const at::Tensor& UploadSource(Device& d, int li);
  // Fetch issued ahead, for the block that computes next: on a CUDA device on its upload stream,
  // so that the copies overlap the block computing now (Fetch then waits for them there).
  void Prefetch(Device& d, int block);
  void Evict(Device& d, int block);
  void BlockGradsToHost(Device& d, int block);
  // The optimizer's step beside the next forward (Device::host_step;
  // pipeline_engine_host_step.cc). Whether `d` steps so (a streamed device with an optimizer).
  bool StepsBesideForward(const Device& d) const;
  // Steps the parameters uploaded whole, then starts the kept parameters' step on the worker
  // and the thread that steps each block's; the first unit's failure (bad hyper-parameters) is
  // returned with nothing stepped.
  absl::Status StartHostStep(Device& d, const std::vector<HyperParams>& hypers);
  // Offload: RESOURCE_EXHAUSTED, naming `what`, when `bytes` more of host memory is more than
  // host_memory_available_ says the host has (EngineOptions::host_memory_available).
  absl::Status CheckHostMemory(int64_t bytes, const std::string& what) const;
  // The host memory the optimizer's next step over offloaded masters will allocate for state
  // it does not hold yet, and the low-precision copies a forward will make.
  int64_t HostStateToMake(const std::vector<HyperParams>& hypers) const;
  int64_t HostCopiesToMake() const;
  // The optimizer's step of the parameters kept on the device (Device::kept, the optimizer's
  // part 0), posted to its worker: it runs there after the work posted before it and before
  // the next forward's; d.host_step->kept tells its end.
  void StepKept(Device& d);
  // The bytes of optimizer state of `d`'s kept parameters (not while their step runs: off the
  // worker, after AwaitKeptStep).
  static int64_t KeptStateBytes(const Device& d);
  // Off the worker: waits for the kept parameters' step of a host step begun, if any. ZeroGrad
  // and the memory counts, which do not wait for the whole host step, wait for this.
  static void AwaitKeptStep(const Device& d);
  // Steps unit `u` of d.host_step (on its thread, or the caller's for unit 0).
  absl::Status StepUnit(Device& d, int u);
  // On the device's worker: whether block `block`'s parameters are stepped; waiting for it
  // (the step's failure, if it failed).
  bool Stepped(Device& d, int block);
  absl::Status AwaitStepped(Device& d, int block);
  // Waits until the thread is done with the masters (Release, on the worker).
  void AwaitHostStepEnd(Device& d);
  // ZeroGrad on a device whose step runs: remembered for the thread's end. False when none runs.
  bool DeferZeroGrad(Device& d, bool set_to_none);

  // Adds gradient `g` (on the host) of streamed parameter `li` to this step's, in its master's
  // dtype.
  void AddStreamedGrad(Device& d, int li, const at::Tensor& g);
  // Adds the downloads that have ended (all of them, waiting, with `wait`) to streamed_grads.
  void TakeDownloads(Device& d, bool wait);
  // AllReduceGrads on an offloaded device: its host gradients onto the device, reduced, back.
  absl::Status ReduceOffloaded(Device& d, bool keep_resident);
  // `t` in host memory: a copy for an accelerator's tensor, `t` itself for a CPU one.
  static at::Tensor ToHost(const at::Tensor& t);
  // Device::partial_host: `d.partial[v]`, just updated by a micro-batch's forward, copied to the
  // host behind the work queued so far on a CUDA device (nothing on a CPU device).
  void PartialToHost(Device& d, int v);
  // `d.partial[v]` on the host: the copy above once its event has run (not what was queued
  // after it), else a blocking copy.
  static at::Tensor PartialOnHost(const Device& d, int v);
  // A host copy of `t`, wherever `t` is (the engine's reads return host tensors of their own).
  static at::Tensor HostCopy(const at::Tensor& t);
  // An empty page-locked host tensor shaped as `t`, in its dtype or `dtype`; undefined when
  // none can be had.
  static at::Tensor PinnedLike(const at::Tensor& t,
                               std::optional<at::ScalarType> dtype = std::nullopt);
  // PinnedLike for what an offloaded job keeps in host memory (masters, their gradients and
  // low-precision copies): from host_pool_, page-locked in its own size where LibTorch's
  // allocator would round it up to a power of two, for tensors of at least kExactPinnedBytes;
  // else, or when the pool refuses, PinnedLike's.
  at::Tensor PinnedExact(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt);
  static constexpr int64_t kExactPinnedBytes = int64_t{1} << 20;
  // The engine's end: waits for the copies still queued on its CUDA devices' streams (a step
  // that failed), which may read or write host_pool_'s memory (it does not track streams, as
  // LibTorch's allocator does), then closes the pool.
  void CloseHostPool();
  // An empty host tensor shaped as `t` in `dtype`, for `d`: page-locked for a CUDA device
  // (PinnedExact; pageable when none can be had, as for a CPU device).
  at::Tensor HostBuffer(const Device& d, const at::Tensor& t, at::ScalarType dtype);
  // PipelineEngine::BeginAsyncReads..EndAsyncReads (pipeline_engine_params.cc): HostCopy, or,
  // while async_reads_, a copy on the device's read stream that returns before it ends.
  at::Tensor ReadCopy(const at::Tensor& t) const;
  // The devices' streams wait for the asynchronous reads (before a write of what they read).
  void WaitForAsyncReads();
  // Returns once `event`'s work has run.
  static void AwaitOnHost(const c10::Event& event);
  // A ZeRO parameter's value assembled from its replicas' shards (offload: they are the
  // masters).
  at::Tensor ShardedValue(int lifted) const;
  // Parameter `lifted`'s slice of its replicas' shards (or of their gradients), concatenated
  // and shaped as the parameter (undefined when a replica has no gradient).
  at::Tensor Assemble(const ZeroSlot& slot, int lifted, bool grad) const;
  // The devices running stage `s`'s replicas, in replica order.
  std::vector<const Device*> Replicas(int s) const {
    std::vector<const Device*> out;
    for (int dev : stages_[s].devices) out.push_back(&devices_[world_rank_[dev]]);
    return out;
  }

  const IrGraph* ir_ = nullptr;
  std::string id_;
  ScheduleKind schedule_ = ScheduleKind::k1F1B;
  int micro_batches_ = 1;
  bool fused_ = false;
  bool zero_ = false;  // EngineOptions::zero
  bool offload_ = false;  // EngineOptions::offload
  int64_t offload_block_bytes_ = 0;  // EngineOptions::offload_block_bytes
  bool offload_low_precision_ = false;  // EngineOptions::offload_low_precision
  int64_t amp_cast_group_bytes_ = 0;     // EngineOptions::amp_cast_group_bytes
  bool outputs_before_backward_ = true;  // EngineOptions::outputs_before_backward
  absl::Status host_step_failure_;  // SettleHostStepsKeepingFailure's
  std::function<void(int, int)> before_host_step_unit_;  // EngineOptions'
  std::function<int64_t()> host_memory_available_;        // EngineOptions'
  bool host_copies_checked_ = false;  // Forward's check of the low-precision copies is done
  size_t bucket_bytes_ = 25u << 20;  // EngineOptions::bucket_bytes
  AmpDtype grad_wire_dtype_;         // EngineOptions::grad_wire_dtype
  LossScaler scaler_;     // EngineOptions::loss_scaler, updated by each Step
  milliseconds timeout_{120000};
  std::unique_ptr<comm::Store> owned_store_;
  comm::Store* store_ = nullptr;  // owned_store_, or EngineOptions::store
  bool partial_ = false;          // some of the plan's devices belong to other processes
  std::atomic<bool> warned_cast_{false};  // a sent value was cast to the IR's dtype (logged once)
  // Asynchronous reads (ReadCopy). Mutable: reading the model is const, but queues copies.
  struct PendingRead {
    c10::Device device;
    std::shared_ptr<c10::Event> done;
  };
  mutable bool async_reads_ = false;
  mutable std::vector<std::pair<c10::Device, c10::Stream>> read_streams_;  // this batch's
  std::vector<PendingRead> pending_reads_;  // ended batches' copies, not yet waited for
  std::vector<StageInfo> stages_;
  std::vector<Device> devices_;                 // the plan's devices, ascending index
  std::vector<int> world_rank_;                 // per global device index (-1: unused)
  std::vector<int> owner_;                      // per lifted tensor: world rank of its owner
  std::vector<int> tied_;                       // parameters read by several stages
  // Per lifted tensor: world rank of the plan's first device holding it as a parameter (first
  // stage, replica 0), which keeps its reduced gradient while reductions are pending; -1: none.
  std::vector<int> primary_;
  // Per lifted tensor: world rank of the plan's first device holding it (first stage, replica
  // 0; the first stage's for a tensor no stage holds), whose process saves it in a checkpoint.
  std::vector<int> saver_;
  std::vector<std::vector<int64_t>> lifted_shapes_;
  std::vector<at::ScalarType> lifted_types_;
  std::vector<OutputKind> output_kinds_;        // per IR output
  std::map<int, OutputKind> stage_outputs_;     // IR value -> kind, for values stages produce
  std::atomic<bool> aborted_{false};
  std::shared_ptr<std::atomic<bool>> cancel_;  // EngineOptions::cancel
  std::shared_ptr<PinnedArena> checkpoint_memory_;  // EngineOptions::checkpoint_memory
  // Offload on a CUDA device: the host memory of masters and gradients (PinnedExact).
  std::shared_ptr<PinnedPool> host_pool_;
  std::shared_ptr<EngineCounters> counters_;        // EngineOptions::counters (may be null)
  mutable bool arena_open_ = false;  // this batch of asynchronous reads allocates from it
  mutable int64_t arena_missed_ = 0;  // bytes of this batch's reads the arena had no room for
  // CheckpointCudaReads: ReadCopy copies nothing and lists the CUDA tensors' bytes.
  mutable bool counting_reads_ = false;
  mutable std::vector<int64_t> counted_reads_;
  bool Cancelled() const { return cancel_ && cancel_->load(); }
  bool broken_ = false;
  std::mutex error_mu_;
  absl::Status first_error_;

  // The last forward: its sizes, outputs' shapes and dtypes, what it left for Backward.
  StepPlan last_;
  int last_micro_batches_ = 0;
  std::vector<std::pair<at::ScalarType, std::vector<int64_t>>> last_outputs_;
  Held held_ = Held::kNothing;

  // Delayed gradient reduction (see the header). Invariant: with pending_, a parameter's
  // gradient is the sum of its holders' copies over every process; without, every holder has
  // it.
  bool delay_ = false;
  bool pending_ = false;
  bool fused_local_ = false;  // the last fused forward's gradients are unreduced
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_IMPL_H_
