// One daemon's share of a job: the host master of its parameters and buffers (ParamStore), the
// model's graphs (the planned mode's IR, other modes' on a ModelRunner), and the engine that
// runs this daemon's devices of the plan, with what waits on the host while it is released
// (optimizer state, the loss scaler, accumulated gradients). A job on one daemon is all here;
// over a cluster, the Job's Coordinator adds the other daemons' shares.
//
// The engine is built from the host master (Deploy, at the next call after a Release) and gives
// it back when released: a failed step releases it, losing nothing, and the next call rebuilds
// it. While deployed, the master keeps no copy of what the engine holds (ThinStore): reads
// (Read, Values) copy from the engine.
//
// Not thread-safe: the owning Job serializes every call under its lock.
#ifndef RANNC_DAEMON_SERVER_LOCAL_JOB_H_
#define RANNC_DAEMON_SERVER_LOCAL_JOB_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/comm/store.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/runtime/loss_scale.h"
#include "daemon/runtime/model_runner.h"
#include "daemon/runtime/numerics.h"
#include "daemon/runtime/param_store.h"
#include "daemon/runtime/pinned_arena.h"
#include "daemon/runtime/pipeline_engine.h"
#include "daemon/server/job_model.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/part_channel.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

// One output of the model for the example inputs (CreateJobResponse.outputs).
struct OutputSpec {
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;
  int batch_dim = -1;  // the dimension of the samples, -1: none (a loss)
};

// Reads a tensor held by another daemon (the Coordinator's ReadTensor); null on one daemon.
using RemoteRead = std::function<absl::StatusOr<std::optional<at::Tensor>>(const std::string&)>;

class LocalJob {
 public:
  // The job's model, checked and planned (job_model.h): INVALID_ARGUMENT for a bad model or
  // optimizer, RESOURCE_EXHAUSTED when no plan fits. Not deployed yet. `settings` outlives it;
  // `new_cancel` gives each engine its cancel flag (Coordinator::NewCancelFlag).
  // `made` gets the plan, the outputs' specs and the IR's and planner's seconds.
  struct Made {
    v1::Deployment plan;
    std::vector<OutputSpec> output_specs;
    double ir_s = 0;
    double plan_s = 0;
  };
  static absl::StatusOr<std::unique_ptr<LocalJob>> Create(
      const JobSettings& settings, const ImportedModel& model,
      const std::vector<at::Tensor>& example_inputs,
      std::function<std::shared_ptr<std::atomic<bool>>()> new_cancel, Made* made);

  // The host master: names, aliases, shapes. Its values are current only while released: read
  // them through Read or Values.
  const ParamStore& params() const { return store_; }
  // INVALID_ARGUMENT unless `inputs` match the example inputs (count, dtypes, shapes, ranges).
  absl::Status CheckInputs(const std::vector<at::Tensor>& inputs) const;
  // The graph for another mode than the planned one (eval, say); whether one exists for `mode`
  // (SetMode: the mode the next Forward runs).
  absl::Status AddMode(const ModelMode& mode, ImportedModel model);
  bool SetMode(const ModelMode& mode);

  // Builds the engine when released. Every call below that needs it deploys first.
  absl::Status EnsureDeployed();
  // Takes this daemon's values back from the engine into the master and frees the devices.
  void Release();

  // A forward: the planned mode's on the engine (this daemon's share of the outputs, over a
  // cluster), another mode's whole on the host over the master (values held elsewhere read with
  // `remote`), its updated buffers given back to the devices and returned in `buffers`.
  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad, bool delay_grad_allreduce,
                                                  const RemoteRead& remote,
                                                  std::map<std::string, at::Tensor>* buffers);
  absl::Status Backward(const OutputGrads& grads, bool retain_graph, bool delay_grad_allreduce);
  // ZeroGrad zeroes the master's gradients too.
  absl::StatusOr<NamedTensors> Run(const JobOp& op);
  // torch.nn.utils.clip_grad_norm_ over every parameter, on one daemon.
  absl::StatusOr<double> ClipGradNorm(double max_norm, double norm_type);

  struct Flags {
    bool deployed = false;       // an engine holds the devices
    bool zero = false;           // optimizer state sharded over replicas (ZeRO)
    bool planned_mode = true;    // the current mode is the one planned (it runs on the engine)
    bool engine_forward = true;  // the last forward ran on the engine, not on the host
    bool grads_pending = false;  // delayed backwards' gradients are not reduced yet
  };
  Flags flags() const;

  // A copy of a parameter or buffer (or its gradient; nullopt when None); NOT_FOUND when
  // another daemon holds it. Values copies every entry's current value, in the master's entry
  // order (with `remote`, those held elsewhere too; without, the master's copy of them); Load
  // sets entries (those held here go to the devices).
  absl::StatusOr<std::optional<at::Tensor>> Read(const std::string& name, bool grad);
  std::vector<at::Tensor> Values(const RemoteRead& remote);
  // Whether this daemon writes entry `name` (a parameter or buffer) and its optimizer state in
  // its share of a checkpoint: over several daemons each entry is written by exactly one
  // (PipelineEngine::Saves; the leading daemon writes those no device holds); on one daemon,
  // every entry. Known once the engine was first built.
  bool Saves(const std::string& name) const;
  absl::Status Load(const std::map<std::string, at::Tensor>& state, bool strict,
                    std::vector<std::string>* missing, std::vector<std::string>* unexpected);

  // The optimizer's state for the parameters this daemon holds (ZeRO shards assembled), in the
  // store's order; empty before the first step. Load replaces it: the parameters `state` leaves
  // out start afresh, as in a new torch.optim optimizer. INVALID_ARGUMENT, changing nothing,
  // for a name that is no parameter of an optimizer group, a key the optimizer does not keep,
  // or a shape other than the parameter's.
  std::vector<OptimizerEntry> OptimizerState();
  // The same for a checkpoint, ZeRO's shards unassembled (PipelineEngine::OptimizerStatePieces):
  // a piece is a parameter's whole state tensor, or elements [offset, offset + numel) of it.
  struct OptimizerPiece {
    OptimizerEntry entry;
    int64_t offset = 0;
    bool slice = false;
  };
  std::vector<OptimizerPiece> OptimizerStatePieces();
  // Reads of a checkpoint that do not hold training up (PipelineEngine::BeginAsyncReads): the
  // parameters and optimizer state read in between are valid once the returned function has
  // run. Buffers are read before.
  // Makes host memory ready for the checkpoints' copies from CUDA devices (pinned_arena.h),
  // sized by what the devices hold now, on a thread of its own: after the first optimizer step
  // of a job that checkpoints. Nothing without CUDA devices, or when done already.
  void PrepareCheckpointMemory();
  void BeginAsyncReads();
  std::function<void()> EndAsyncReads();
  // With `check_only`, the checks and nothing else.
  absl::Status LoadOptimizerState(const std::vector<OptimizerEntry>& state,
                                  bool check_only = false);

  // What the job's engines have done here (data-plane bytes, compute and schedule time).
  std::shared_ptr<const EngineCounters> counters() const { return counters_; }
  // Per plan device: bytes held now and the most held at once since deployed (zeros released);
  // the loss scaler's state.
  void Usage(std::vector<int64_t>* bytes, std::vector<int64_t>* peak, LossScaler* scaler) const;
  // Replaces the loss scaler's state (from a checkpoint); the engine, if deployed, is released
  // first and rebuilt with it by the next call.
  void RestoreLossScaler(const LossScaler& scaler);

 private:
  LocalJob(const JobSettings& settings,
           std::function<std::shared_ptr<std::atomic<bool>>()> new_cancel);

  absl::Status Deploy();
  // After Deploy: the store keeps no copy of the parameters this daemon's engine holds. With
  // offload they share the engine's host masters' memory; the others (thin_entries_) are
  // dropped (ParamStore::Drop) until SyncStore restores them (another mode's forward, Release).
  void ThinStore();
  // Drops thin_entries_ again, unless another mode's graph awaits its backward (it saved the
  // store's tensors).
  void DropStoreCopies();
  // Copies the engine's parameters and buffers (and gradients, with `grads`) into the store.
  void SyncStore(bool grads, const RemoteRead& remote);
  // Whether this daemon's devices hold lifted tensor `lifted` (always, for a job on one daemon).
  bool Held(int lifted) const;
  bool spans_daemons() const { return settings_.is_part || !settings_.members.empty(); }
  int LiftedOf(const ParamStore::Entry& entry) const;
  bool planned_mode() const;
  using ByLifted = std::map<int, std::vector<std::pair<std::string, at::Tensor>>>;
  // `state` checked, as the engine takes it: this daemon's parameters' entries by lifted index.
  absl::StatusOr<ByLifted> OptimizerStateByLifted(const std::vector<OptimizerEntry>& state) const;
  void ZeroGrad(bool set_to_none);
  // The parameters clip_grad_norm takes (lifted indices, the client's order); their norms and
  // scaling by the coefficient.
  std::vector<int> ClippedParams() const;
  absl::StatusOr<NamedTensors> GradNorms(double norm_type);
  absl::Status ScaleGrads(const at::Tensor& coefficient);

  const JobSettings& settings_;
  const std::function<std::shared_ptr<std::atomic<bool>>()> new_cancel_;
  ModelMode mode_;
  ParamStore store_;
  std::vector<InputSignature> signature_;
  v1::Deployment plan_;
  // The memory switches the engine runs with: the settings', and those the plan needs.
  bool zero_ = false;
  bool offload_ = false;
  std::unique_ptr<NumericsLease> numerics_;  // the client's numeric settings, held
  std::unique_ptr<ModelRunner> runner_;  // validation and modes other than the planned one
  std::unique_ptr<IrGraph> ir_;          // of the planned mode's graph; outlives engine_
  std::vector<int> lifted_of_entry_;     // per store entry: its IR lifted index, or -1
  std::vector<std::vector<int>> optimizer_groups_;  // lifted indices per param group
  std::unique_ptr<PipelineEngine> engine_;  // null while released
  std::vector<size_t> thin_entries_;  // store entries without a copy while deployed (ThinStore)
  // Outlives the engines: the checkpoints' host memory stays ready across redeployments.
  std::shared_ptr<PinnedArena> checkpoint_memory_ = std::make_shared<PinnedArena>();
  // Every engine of the job counts into these (the job's metrics).
  const std::shared_ptr<EngineCounters> counters_ = std::make_shared<EngineCounters>();
  bool engine_forward_ = true;
  std::unique_ptr<comm::Store> part_store_;  // the leader's store, when a part
  int deployments_ = 0;                      // engines built so far
  std::vector<bool> held_;                   // by lifted index: see Held()
  std::vector<bool> saved_;                  // by lifted index: PipelineEngine::Saves
  // The store's gradients are this daemon's shares of unreduced ones (an engine spanning
  // daemons released with reductions pending): Deploy puts them back as shares.
  bool grad_shares_ = false;
  // Optimizer state while released, by lifted index; the loss scaler's state likewise.
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> parked_optimizer_state_;
  LossScaler parked_loss_scaler_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_LOCAL_JOB_H_
