// Runs a planned job (a v1::Deployment) on N devices: pipeline stages, each with data-parallel
// replicas, one worker thread per device. A step splits the client's batch into the plan's
// micro-batches and each micro-batch over a stage's replicas; every device runs
// StageOps(schedule, stage, S, m) on its StageExecutor, exchanging activations and their
// gradients with the other stages' replicas over a communicator covering all devices (resharded
// when replica counts differ), and ends by all-reducing its parameter gradients over its stage's
// replicas (tied parameters, read by several stages, over every device). Each device keeps its
// own copies of its stage's parameters, buffers and optimizer state. See docs/runtime.md.
//
// Gradient accumulation (RaNNC's delay_grad_allreduce): with SetDelayGradReduction(true) a
// backward leaves each device's gradients local (its replica's contribution, accumulated over
// backwards) and AllReduceGrads reduces them all at once, one collective per bucket of each
// stage's replica group (and one per tied parameter over every device) however many backwards
// came before. While reductions are pending (grads_pending()) a parameter's gradient is the sum
// of its holders' copies: reads (Grad, GradAt) return that sum, computed here without touching
// the devices; Step, ClipGradNorm and GradNorms fail with FAILED_PRECONDITION until
// AllReduceGrads, as RaNNC requires allreduce_grads() before the optimizer step.
//
//   engine->SetDelayGradReduction(true);
//   for (batch : batches) { engine->Forward(batch, true); engine->Backward({{0, one}}, false); }
//   engine->AllReduceGrads();
//   engine->Step({hyper});
//
//   absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
//       ir, plan, lifted_tensors, comm::Backend::kUcx, /*num_devices=*/4);
//   (*engine)->SetOptimizer(OptimizerKind::kAdamW, {all_param_lifted_indices});
//   absl::StatusOr<std::vector<at::Tensor>> out = (*engine)->Forward(inputs, true);
//   (*engine)->Backward({{0, at::ones({})}}, /*retain_graph=*/false);
//   (*engine)->Step({hyper});
//
// Outputs: batched outputs are concatenated in sample order; a batch-dependent output without a
// batch dimension (a loss) combines the shards' as the model combines samples, a batch-weighted
// mean or a sum (IrValue::reduction, found when the IR is built); other outputs (made from
// parameters or constants) come from the first shard. A model whose samples are not
// independent (IrGraph::batch_separable: BatchNorm in training mode) is refused a plan that
// splits the batch.
//
// Forward with gradients has two modes (see fused()):
//  - fused, when the model's first output is a floating scalar loss and no other output is
//    floating:
//    the forward runs each micro-batch's backward too, in the plan's schedule (1F1B keeps few
//    micro-batches in flight), as if the client's gradient of the loss were 1, and keeps this
//    step's parameter gradients apart. Backward with the client's gradient g adds g x them to
//    the accumulated gradients: exact, since gradients are linear in g. A forward whose backward
//    never comes costs a backward's compute; the next forward drops its gradients.
//  - otherwise every micro-batch's forward runs and keeps its autograd graph (GPipe's memory);
//    Backward splits the client's output gradients over the micro-batches and runs their
//    backwards.
//
// The IrGraph must outlive the engine. Methods must be called from one thread at a time. A step
// that fails (any worker's first error, annotated with the device and stage; a transfer that
// does not complete within the timeout) leaves the engine broken: later steps fail with
// FAILED_PRECONDITION. Tensors passed in and returned are host tensors.
#ifndef RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_
#define RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "daemon/comm/factory.h"
#include "daemon/graph/ir.h"
#include "daemon/optim/optimizer.h"
#include "daemon/runtime/autocast.h"
#include "daemon/runtime/loss_scale.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

class PinnedArena;  // pinned_arena.h

// What a job's engines have done, summed over this process's devices, for the job's metrics:
// the counters outlive an engine (a job's engine is rebuilt after an undeploy and goes on adding
// to the same ones). Times are the host's: a CUDA stage's kernels run asynchronously, so its
// compute time is what the host spent issuing (and waiting on) them.
struct EngineCounters {
  // Bytes handed to the data plane: sends and each collective's local contribution
  // (comm/counting.h).
  std::shared_ptr<std::atomic<uint64_t>> data_plane_bytes =
      std::make_shared<std::atomic<uint64_t>>(0);
  // Per device, summed: time in its stage's forwards and backwards, and time running a step's
  // schedule (those plus waiting for other stages' activations and gradients, transfers and
  // bookkeeping). One minus their ratio over a step bounds the pipeline bubble from above.
  std::atomic<int64_t> compute_ns{0};
  std::atomic<int64_t> schedule_ns{0};
};

// How an engine runs: its data plane, and for a job spanning several processes (daemons), which
// of the plan's devices this process runs and where the processes meet.
struct EngineOptions {
  comm::Backend backend = comm::Backend::kUcx;
  int num_devices = 1;  // devices the plan's indices refer to
  // The plan's devices this process runs; empty: all of them. Each process of a job creates
  // its engine with the same plan, group and store, and its own local devices; every call
  // (Forward with the same inputs, Backward, Step, ...) is then made on every process's engine.
  // A partial engine's outputs are its devices' share (rows computed elsewhere are zeros,
  // losses are its weighted partial sums): the processes' outputs add up to the model's.
  std::vector<int> local_devices;
  // Where each of the plan's devices runs (by plan device index): CPU, or a CUDA device whose
  // stage, parameters, gradients, optimizer state and transfers live in its memory. Empty: every
  // device on the CPU. Several plan devices may share one CUDA device (tests on one GPU); the
  // NCCL backend refuses that, the others stage CUDA transfers through host memory
  // (runtime/host_staged_communicator.h).
  std::vector<c10::Device> placement;
  // Rendezvous of the communicators (not owned; e.g. a gRPC store for several processes);
  // null: an in-memory store of this engine.
  comm::Store* store = nullptr;
  // Names the engine's communicator groups; must be equal in every process of a job (and
  // unique per job). Empty: a name unique within this process.
  std::string group;
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // Set by another thread to cancel: the step in progress fails at once (its waits abandoned)
  // and so does every later one, with ABORTED. E.g. a job that lost a daemon running its part.
  std::shared_ptr<std::atomic<bool>> cancel;
  // Where a checkpoint's asynchronous reads (BeginAsyncReads) put their host copies of CUDA
  // tensors, made ready beforehand (pinned_arena.h); null, or what does not fit: LibTorch's
  // pinned allocator.
  std::shared_ptr<PinnedArena> checkpoint_memory;
  // ZeRO (stage 2): on stages with replicas, the gradients and optimizer state of untied
  // parameters are sharded over the replicas, from SetOptimizer on: each backward's gradients
  // are reduce-scattered (instead of all-reduced), each replica's optimizer steps its shard,
  // and the shards are all-gathered into every replica's parameters after the step. Results are
  // those of the unsharded engine; reads (GradAt, OptimizerState) assemble the shards. A
  // stage's replicas must all be local (UNIMPLEMENTED at SetOptimizer otherwise).
  bool zero = false;
  // Parameter offload: see "Offload" in the header comment.
  bool offload = false;
  // Offload's streaming: a stage with one replica runs as blocks of at most this many bytes of
  // parameters (graph/subgraph.h ParamBlockStarts), whose parameters are on the device only
  // while the block computes, and whose gradients go to the host as its backward ends
  // (docs/runtime.md, "Parameter offload"). 0: the stage's parameters are uploaded at once.
  // A streamed stage keeps up to its plan's DeploymentStage::kept_on_device_bytes of trainable
  // parameters on the device instead (the planner's choice where memory has room): their fp32
  // masters, gradients and optimizer state there, stepped by the device, whole parameters in
  // the order the stage's forward first reads them, each that still fits.
  int64_t offload_block_bytes = 0;
  // Streaming: a parameter the forward reads only through a cast to a narrower dtype
  // (amp_level O2) is uploaded in that dtype, from a copy of its master the host casts once a
  // step, and its gradient comes back in it: half the bytes over the host link for bf16 and
  // half the device memory for streamed parameters, the same values. False: in the master's
  // dtype (faster where the link outruns the host's cast: docs/runtime.md).
  bool offload_low_precision = false;
  // amp_level O2: a stage without recomputation casts its parameters before its ops run, in
  // groups of at most this many bytes of masters (StageOptions::cast_group_bytes); 0: each
  // cast where the graph has it.
  int64_t amp_cast_group_bytes = int64_t{256} << 20;
  // On CUDA devices, the outputs without a batch dimension (a loss) are copied to the host as
  // each micro-batch's forward computes them, and Forward returns once those copies have run,
  // not once the backward a fused pass queued after them has (Device::partial_host). False:
  // a blocking copy at the end, after everything queued.
  bool outputs_before_backward = true;
  // Tests: called on a streamed device's optimizer step thread before it steps each unit
  // after the first (the device's plan index, the unit: 1 + the block), and on its worker
  // before the step of the parameters kept on the device (unit -1), to hold them there.
  std::function<void(int device, int unit)> before_host_step_unit;
  // Offload: the bytes of host memory the engine may still allocate (its default reads
  // /proc/meminfo's MemAvailable; a negative answer: unknown, not checked). The optimizer's
  // first step over host masters (its state) and the first forward of low-precision streaming
  // (the casts' copies) allocate that much at once; they fail with RESOURCE_EXHAUSTED before
  // allocating anything when it is short, where the kernel would otherwise kill the daemon.
  // Tests set it.
  std::function<int64_t()> host_memory_available;
  // Upper bound, in bytes, of a gradient bucket: of the replica all-reduce's buckets
  // (GradReducer::Options::bucket_bytes) and of ZeRO's partitions, each of which is
  // reduce-scattered as soon as the last backward of a step has produced its gradients, while
  // the backward goes on. Default 25 MiB (PyTorch DDP's); a parameter larger gets its own.
  size_t bucket_bytes = 25u << 20;
  // Mixed precision: every stage's forward runs under autocast to this dtype (runtime/autocast.h);
  // parameters, gradients and optimizer state stay in their own dtype (the fp32 masters). The
  // IR must have been built under the same autocast, so that values crossing stages have the
  // dtypes the stages produce.
  AmpDtype amp;
  // The replicas all-reduce floating gradients as this dtype (GradReducer::Options::wire_dtype;
  // none: as their own): RaNNC's allreduce_amp_master_params=False at amp_level O2, where the
  // forward reads the parameters in the low precision. Not for ZeRO's reduce-scatter.
  AmpDtype grad_wire_dtype;
  // Where the engine counts what it does (null: nowhere).
  std::shared_ptr<EngineCounters> counters;
  // Loss scaling (fp16 mixed precision), starting from this scaler's state (a job moving to a
  // new engine passes the old one's loss_scaler()): every backward starts from the loss's
  // gradient (or the client's output gradients) times scale(), and the step's gradients are
  // multiplied by 1/scale() before they join the accumulated ones, so every read sees unscaled
  // gradients. Step skips the optimizer step on every device (of every process) when any
  // device holds a gradient that is not finite, and updates the scale.
  LossScaler loss_scaler;
};

struct StepResult {
  at::Tensor loss;  // 0-dim: the batch-weighted mean of every shard's loss
};

class PipelineEngine {
 public:
  // `lifted`: the host master of each of the IR's lifted inputs (IrGraph::tensor_names order);
  // each device gets its own copies of the ones its stage reads (parameters that require grad
  // become leaves requiring grad; frozen ones stay constants). INVALID_ARGUMENT when the plan does not fit the IR or the devices.
  static absl::StatusOr<std::unique_ptr<PipelineEngine>> Create(
      const IrGraph& ir, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
      const EngineOptions& options);
  // Every device local, an in-memory store.
  static absl::StatusOr<std::unique_ptr<PipelineEngine>> Create(
      const IrGraph& ir, const v1::Deployment& plan, const std::vector<at::Tensor>& lifted,
      comm::Backend backend, int num_devices,
      std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~PipelineEngine();

  bool fused() const;
  // A step failed: only the accessors (Param, Grad, OptimizerState, DeviceBytes) still work;
  // gradients accumulated before the failed step are intact.
  bool broken() const;
  // The plan's devices this process runs, ascending.
  std::vector<int> devices() const;

  // The model's flattened outputs (IrGraph::outputs order) for `inputs`, the model's user inputs
  // holding the whole batch. Drops whatever the previous forward kept.
  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad);
  // Gradients of the last forward's outputs, by output index (others: none). Parameter
  // gradients accumulate, as PyTorch's do, until ZeroGrad. Without `retain_graph` the forward
  // is released: a second Backward is FAILED_PRECONDITION.
  absl::Status Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                        bool retain_graph);
  // Forward with gradients and Backward with the loss's gradient 1.
  absl::StatusOr<StepResult> TrainStep(const std::vector<at::Tensor>& inputs);

  // Whether later backwards leave their gradients unreduced (default false). A fused forward
  // runs its backward, so the setting at the forward decides for that forward's gradients,
  // whatever it is at the Backward that adds them.
  void SetDelayGradReduction(bool delay);
  // Some gradients are not reduced yet: a backward ran delayed since the last AllReduceGrads
  // or ZeroGrad.
  bool grads_pending() const;
  // All-reduces the gradients accumulated by delayed backwards, as a backward's end does
  // (stage replicas, tied parameters over every device); every holder then has the full
  // gradient. Collective over every device (and, for an engine spanning processes, every
  // process calls it). OK and nothing issued when no reduction is pending. A failure breaks
  // the engine, as a failed step does; each device keeps its gradients until its reduction
  // completes.
  absl::Status AllReduceGrads();

  // A copy of the gradient (undefined tensor: none yet) / value of a lifted tensor: its owner's
  // (the first local device holding it, by stage then replica), or `device`'s (after a step every holder has the
  // same). NOT_FOUND for a name no stage (or `device`) holds; Grad also for a buffer.
  // While reductions are pending, a gradient is the sum of this process's holders' copies
  // (for any `device`): the reduced gradient when every device is local, this process's share
  // of it otherwise.
  absl::StatusOr<at::Tensor> Grad(const std::string& tensor_name, int device = -1) const;
  absl::StatusOr<at::Tensor> Param(const std::string& tensor_name, int device = -1) const;
  // By lifted index; an undefined tensor when no stage holds it (or, for Grad, it has none).
  at::Tensor GradAt(int lifted) const;
  at::Tensor ParamAt(int lifted) const;
  // Whether a stage of this process holds lifted tensor `lifted` (ParamAt would return a
  // value), without copying it.
  bool Holds(int lifted) const;
  // With offload: the host master of parameter `lifted` on its owner (the tensor itself, not a
  // copy: the optimizer steps it in place, and a step's upload reads it); undefined where it has
  // none (not offloaded, a ZeRO shard, or held by another process). A caller may keep it, and
  // write it only between steps.
  at::Tensor HostMaster(int lifted) const;
  // Whether this process saves lifted tensor `lifted` (and its optimizer state) when every
  // process writes its share of a checkpoint: the plan's first device holding it (first stage,
  // replica 0) is one of its own (for a tensor no stage holds, the first stage's). Exactly one
  // process saves each tensor.
  bool Saves(int lifted) const;

  // Copies `value` into every device's copy of lifted tensor `lifted` (load_state_dict).
  void SetParam(int lifted, const at::Tensor& value);
  // Adds `grad` to every holder's gradient of parameter `lifted` (a backward that ran outside
  // the engine, e.g. through another mode's graph); while reductions are pending, to the
  // holder that keeps the reduced part (so the sum over holders grows by `grad` once).
  void AddGrad(int lifted, const at::Tensor& grad);
  // Adds this process's share of an unreduced gradient (what Grad returned while reductions
  // were pending, on an engine spanning processes) to one local holder, and makes reductions
  // pending: a job rebuilding its engine puts its accumulated shares back this way. A ZeRO
  // parameter's gradient is never pending: it is added as AddGrad does.
  void AddGradShare(int lifted, const at::Tensor& grad);
  void ZeroGrad(bool set_to_none = false);
  // torch.nn.utils.clip_grad_norm_ over the gradients of `params` (lifted indices, in the
  // client's parameter order, each counted once however many devices hold it); every copy is
  // scaled. Returns the total norm (0 when no parameter has a gradient). FAILED_PRECONDITION
  // while reductions are pending.
  absl::StatusOr<double> ClipGradNorm(const std::vector<int>& params, double max_norm,
                                      double norm_type);
  // ClipGradNorm's halves, for a job whose devices span processes (each part's norms combined
  // with optim/grad_norm.h's CombineNorms, then every part scaled): the gradient norm of each of
  // `params` that has a gradient here, by lifted index in `params`' order (FAILED_PRECONDITION
  // while reductions are pending); and multiplying every copy of their gradients by
  // `coefficient`.
  absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> GradNorms(
      const std::vector<int>& params, double norm_type) const;
  void ScaleGrads(const std::vector<int>& params, const at::Tensor& coefficient);

  // One optimizer per device over its parameters, `groups` listing lifted indices per param
  // group (every device has every group, possibly empty), made with `hypers` per group (what a
  // kind reads at construction, such as Adagrad's initial_accumulator_value; empty: the kind's
  // defaults). `scripted`: kScripted's update (each device loads its own copy). Replaces any
  // previous one.
  absl::Status SetOptimizer(OptimizerKind kind, const std::vector<std::vector<int>>& groups,
                            const std::vector<HyperParams>& hypers = {},
                            std::shared_ptr<const ScriptedUpdate> scripted = nullptr);
  // One optimizer step on every device (replicas update identically: their gradients are
  // all-reduced). FAILED_PRECONDITION without SetOptimizer, or while reductions are pending.
  // With loss scaling, an overflowed step is skipped (OK; loss_scaler().skipped_steps() counts
  // it) and the scale updated; collective over every process's engine then. An offloaded,
  // streamed device's step returns once its parameters uploaded whole are stepped and goes on
  // beside the next Forward, block by block ahead of it; every other call that reads or writes
  // parameters, gradients or optimizer state waits for it first (a failure of that part is
  // returned by the next call with a status).
  absl::Status Step(const std::vector<HyperParams>& hypers);
  const LossScaler& loss_scaler() const;
  // Per lifted parameter, its optimizer state (keys as Optimizer::NamedState's after the
  // "<index>."), copied from its owner; and the reverse, into every holder.
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> OptimizerState() const;
  // The same state as pieces, for checkpoints: ZeRO's shards are not assembled. A piece is a
  // parameter's whole state tensor (`slice` false: its shape), or, for a ZeRO parameter's
  // per-element state, the part of it one replica's shard holds: elements [offset, offset +
  // value.numel()) of the flattened whole (`slice` true). Host copies.
  struct StatePiece {
    int lifted = -1;
    std::string key;
    at::Tensor value;
    int64_t offset = 0;
    bool slice = false;
  };
  std::vector<StatePiece> OptimizerStatePieces() const;
  // Reads for a checkpoint that do not hold training up. Between BeginAsyncReads and
  // EndAsyncReads, ParamAt and OptimizerStatePieces copy a CUDA device's tensors into
  // page-locked host memory on a side stream, after the work queued on the device so far, and
  // return before the copies end; the host tensors hold their values once the function
  // EndAsyncReads returns has run (on any thread). The devices' next writes of parameters and
  // optimizer state (Step, SetParam, LoadOptimizerState) wait for the copies on the device, not
  // on the host, so the next forwards and backwards run meanwhile. Buffers are not covered (a
  // forward writes BatchNorm's running statistics): read them before BeginAsyncReads. On other
  // devices the reads are the ordinary ones, and the function does nothing.
  void BeginAsyncReads();
  std::function<void()> EndAsyncReads();
  absl::Status LoadOptimizerState(
      const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state);
  // p -= lr * grad on every device's copy of every parameter that has a gradient (tests).
  void ApplySgd(double lr);

  // Bytes the engine holds on `device`: parameters, gradients, buffers, optimizer state.
  int64_t DeviceBytes(int device) const;
  // The bytes of each copy from this process's CUDA devices a checkpoint makes, in order: the
  // value of each parameter of `lifted` (ParamAt: its master), then the optimizer's state
  // (OptimizerStatePieces). Not gradients, reduction buffers or low-precision copies. What the
  // host memory made ready for checkpoints is sized by (PinnedArena::SpanOf).
  std::vector<int64_t> CheckpointCudaReads(const std::vector<int>& lifted) const;
  // The most device `device` held at once during any step since the engine was made (or
  // ResetPeakDeviceBytes): what it held when the step began plus the high-water mark of its
  // worker's LibTorch allocations during the step (activations, workspaces, transfers), and at
  // least DeviceBytes. 0 for a device this process does not run.
  int64_t PeakDeviceBytes(int device) const;
  // Offload's streaming on `device` (a plan device index of this process): its blocks (1 when it
  // does not stream), and the most bytes of streamed parameters it has held at once.
  int StreamedBlocks(int device) const;
  int64_t StreamedPeakBytes(int device) const;
  // With offload's streaming: the bytes of trainable parameters `device` keeps on the device
  // (EngineOptions::offload_block_bytes); 0 where none.
  int64_t KeptOnDeviceBytes(int device) const;
  void ResetPeakDeviceBytes();
  // Of `device`'s gradient buckets over its stage's replicas (the all-reduce's and ZeRO's
  // reduce-scatter's), {how many the last reduction found started during the backward, i.e.
  // overlapped with it; how many there are}. {0, 0} for a device without replicas or not run
  // by this process. Diagnostics and tests.
  std::pair<int, int> OverlappedBuckets(int device) const;

  class Impl;

 private:
  explicit PipelineEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PIPELINE_ENGINE_H_
