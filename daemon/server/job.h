// A job: one submitted model with its parameters, optimizer and graphs, owned by the daemon.
// The job decides; the gRPC services only translate (STYLE.md habit 5). Inputs and outputs are
// at::Tensors on the host; names, shapes and errors are checked here so every client gets the
// same answers.
//
// A Job is this daemon's share (LocalJob: the host master, the graphs, the engine on this
// daemon's devices) and, over a cluster, the Coordinator that runs the same call on the other
// daemons' parts at once (docs/cluster.md). A part is itself a Job, made by the leading daemon
// (JobPartService), whose Coordinator leads nothing.
//
// Execution: the model is planned at creation (or a saved deployment is adopted) and runs on
// the plan's devices through a PipelineEngine. The host master is brought up to date from the
// devices when the client reads state and when the job is undeployed, and the engine is rebuilt
// from it (with the optimizer state kept aside) at the next forward. A graph for another mode
// than the one planned (eval, say) runs whole on the host over the synced master, its gradients
// handed to the engine.
//
// Lifecycle (JobState): kDeployed -> (Undeploy) -> kUndeployed -> (Forward) -> kDeployed.
// A failed forward or backward (a bad input, a lost transfer) goes to the caller and loses
// nothing: parameters, buffers, accumulated gradients and optimizer state are taken back from
// the devices and the engine is rebuilt at the next forward.
//
// Client ranks (JobSettings::client_world > 1): Forward, Backward, Run and ClipGradNorm are
// collective; each waits for every rank's call and the operation runs once (see training.proto's
// JobOptions). With one client rank, `client_rank` is 0.
//
// Gradient accumulation (pyrannc.delay_grad_allreduce): a forward or backward called with
// `delay_grad_allreduce` leaves its gradients unreduced over the replicas (PipelineEngine's
// SetDelayGradReduction) until JobOp::kAllReduceGrads. Meanwhile reading a gradient gives the
// reduced value (over several daemons, the parts reduce first), and the optimizer step and
// ClipGradNorm fail with FAILED_PRECONDITION asking for allreduce_grads().
//
// Thread-safety: every call locks the job's mutex, so concurrent RPCs on one job are
// serialized; different jobs run independently. coordinator()'s MemberLost and AbortStep may
// come from any thread while a call runs.
#ifndef RANNC_DAEMON_SERVER_JOB_H_
#define RANNC_DAEMON_SERVER_JOB_H_

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/runtime/model_runner.h"
#include "daemon/runtime/param_store.h"
#include "daemon/server/client_ranks.h"
#include "daemon/server/coordinator.h"
#include "daemon/server/job_metrics.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/local_job.h"
#include "daemon/server/part_channel.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

enum class JobState { kDeployed, kUndeployed };
const char* JobStateName(JobState state);

// What a job is, fixed at its creation.
struct JobInfo {
  std::string id;
  std::string name;
  int client_world = 1;
  bool amp = false;
  std::chrono::milliseconds lease{0};  // JobSettings::lease
  std::chrono::system_clock::time_point created;
  // The plan's devices' names, in the plan's device order.
  std::vector<std::string> devices;
  // The job's plan (planned at creation or loaded from a deployment file).
  v1::Deployment plan;
  // The dtype, shape and batch dimension of each (flattened) output for the example inputs,
  // from the IR's example run.
  std::vector<OutputSpec> outputs;
  // Where creation spent its time, for the daemon's CreateJob log line (seconds each).
  double import_s = 0;  // loading the TorchScript archive, lifting its tensors
  double ir_s = 0;      // building the IR (which probes the model)
  double plan_s = 0;    // planning, or checking a loaded deployment
  double place_s = 0;   // placing parameters (and optimizer state) on the devices
};

struct JobSummary {
  JobState state;
  int64_t num_params = 0;
  int64_t steps = 0;
  int64_t forwards = 0;
  // Per device of JobInfo::devices: bytes the job holds there (parameters, gradients, buffers,
  // optimizer state); zeros once undeployed.
  std::vector<int64_t> device_bytes;
  // Per device: the most held at once during a step since the job was last deployed.
  std::vector<int64_t> peak_device_bytes;
  double loss_scale = 1;
  int64_t skipped_steps = 0;
};

// One checkpoint written (or being written) by Checkpoint.
struct CheckpointInfo {
  int64_t step = 0;
  std::string path;        // its directory
  bool committed = false;  // false: threads are writing it
  uint64_t bytes = 0;      // of its tensor files, once committed
  int64_t created_unix_ms = 0;
  // The job was held this long: copying its state to host memory, and waiting for the previous
  // write when one was still in flight.
  double blocked_s = 0;
  double write_s = 0;      // writing and committing, once committed
};

struct StateEntry {
  std::string name;
  at::Tensor tensor;  // a copy, safe to encode after the job's lock is released
  bool is_buffer = false;
};

class Job {
 public:
  // Imports `model_bytes` (with `sent` in place of its stand-ins: see ImportTorchScript), checks
  // it against `settings`, builds its IR and plans it for settings.plan_target (or checks and
  // adopts settings.load_deployment), and deploys it; over a cluster (settings.members), with a
  // part on each member (`channels`, not owned, outlives the job). INVALID_ARGUMENT for a bad
  // model or one that fails on the example inputs; RESOURCE_EXHAUSTED when no plan fits.
  static absl::StatusOr<std::unique_ptr<Job>> Create(std::string id, JobSettings settings,
                                                     const std::string& model_bytes,
                                                     const std::vector<at::Tensor>& example_inputs,
                                                     const SentTensors& sent = {},
                                                     PartChannels* channels = nullptr);
  ~Job();

  const JobInfo& info() const { return info_; }
  OptimizerKind optimizer_kind() const { return settings_.optimizer.kind; }
  // The parameters and buffers with their aliases (names and shapes: the values live on the
  // devices; read them with GetTensor or StateDict).
  const ParamStore& params() const { return local_->params(); }
  Coordinator& coordinator() { return coordinator_; }

  absl::Status AddMode(const ModelMode& mode, const std::string& model_bytes);
  // Returns whether the job has a graph for `mode`, which the next forwards run.
  bool SetMode(const ModelMode& mode);

  // `delay_grad_allreduce`: see the header comment; with requires_grad it decides for the
  // gradients a fused forward computes (PipelineEngine::fused).
  absl::StatusOr<std::vector<at::Tensor>> Forward(int client_rank,
                                                  const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad,
                                                  bool delay_grad_allreduce = false);
  absl::Status Backward(int client_rank, const OutputGrads& output_grads, bool retain_graph,
                        bool delay_grad_allreduce = false);
  // The optimizer step, allreduce_grads(), zero_grad(), recreate_all_communicators(), and on a
  // part clip_grad_norm's rounds (JobOp). kAllReduceGrads is OK, doing nothing, when nothing is
  // pending.
  absl::StatusOr<NamedTensors> Run(int client_rank, const JobOp& op);
  // torch.nn.utils.clip_grad_norm_ over every parameter: returns the total norm.
  absl::StatusOr<double> ClipGradNorm(int client_rank, double max_norm, double norm_type);

  // A copy of a parameter/buffer (or its gradient; nullopt when the gradient is None).
  absl::StatusOr<std::optional<at::Tensor>> GetTensor(const std::string& name, bool grad);
  // Copies of every state_dict entry, in PyTorch's order, aliases included.
  std::vector<StateEntry> StateDict();
  absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& state, bool strict,
                             std::vector<std::string>* missing,
                             std::vector<std::string>* unexpected);
  // The optimizer's state, torch.optim's per parameter (by name) and key, from every daemon of
  // the job; loading replaces it everywhere (LocalJob::LoadOptimizerState).
  absl::StatusOr<std::vector<OptimizerEntry>> OptimizerState();
  absl::Status LoadOptimizerState(const std::vector<OptimizerEntry>& state);
  // Brings the host master up to date and frees every device's copies (optimizer state is
  // kept on the host); the next Forward deploys again.
  void Undeploy();
  JobSummary Summary();
  // The job's measurements (job_metrics.h), read without waiting for a call in progress.
  JobMetrics::Snapshot Measure() const;

  // Checkpoints (docs/checkpoints.md; JobSettings::checkpoints). Checkpoint copies the job's
  // state (parameters, buffers, optimizer state, step counters, the loss scaler, the RNG) to
  // host memory now and writes it on a thread (every checkpoint_every steps too, after the
  // step); over several daemons each daemon copies and writes its own share at once, and this
  // one commits the whole. With `wait`, it returns once committed. FAILED_PRECONDITION without a
  // checkpoint_dir; a failed write is the status with `wait`, else checkpoint_error().
  absl::StatusOr<CheckpointInfo> Checkpoint(bool wait);
  // The job's committed checkpoints, oldest first, then the one being written (committed
  // false); and the last write's failure ("" none).
  std::vector<CheckpointInfo> Checkpoints();
  std::string checkpoint_error() const;
  // The config key checkpoint_dir, and the directory of this job's checkpoints under it ("" for
  // both without one).
  const std::string& checkpoint_dir() const { return settings_.checkpoints.dir; }
  std::string checkpoint_job_dir() const;
  // The step of the checkpoint the job was created from (config key resume), or -1.
  int64_t resumed_step() const { return resumed_step_; }
  // A part's share of its leader's checkpoint (PartChannel::StartCheckpointShare): the tensors
  // this daemon writes copied to host memory now, and written into `dir` on the writer's
  // thread; CheckpointShare waits for that write (FAILED_PRECONDITION when the last share
  // written here is not of `step`).
  absl::Status StartCheckpointShare(const std::string& dir, const std::string& prefix,
                                    int64_t step);
  absl::StatusOr<v1::CheckpointShare> CheckpointShare(int64_t step);
  // A part of a job resumed from a checkpoint: its engine takes the leader's loss scaler state.
  void RestoreLossScaler(double scale, int good_steps, int skipped_steps);

 private:
  Job(std::string id, JobSettings settings, PartChannels* channels);

  // Each *Locked is its *Unmeasured, timed for metrics_.
  absl::StatusOr<std::vector<at::Tensor>> ForwardLocked(const std::vector<at::Tensor>& inputs,
                                                        bool requires_grad,
                                                        bool delay_grad_allreduce);
  absl::StatusOr<std::vector<at::Tensor>> ForwardUnmeasured(const std::vector<at::Tensor>& inputs,
                                                            bool requires_grad,
                                                            bool delay_grad_allreduce);
  absl::Status BackwardLocked(const OutputGrads& output_grads, bool retain_graph,
                              bool delay_grad_allreduce);
  absl::Status BackwardUnmeasured(const OutputGrads& output_grads, bool retain_graph,
                                  bool delay_grad_allreduce);
  absl::StatusOr<NamedTensors> RunLocked(const JobOp& op);
  absl::StatusOr<NamedTensors> RunUnmeasured(const JobOp& op);
  absl::StatusOr<double> ClipLocked(double max_norm, double norm_type);
  absl::StatusOr<double> ClipUnmeasured(double max_norm, double norm_type);
  absl::Status LoadStateLocked(const std::map<std::string, at::Tensor>& state, bool strict,
                               std::vector<std::string>* missing,
                               std::vector<std::string>* unexpected);
  absl::StatusOr<std::vector<OptimizerEntry>> OptimizerStateLocked();
  absl::Status LoadOptimizerStateLocked(const std::vector<OptimizerEntry>& state);
  // job_checkpoint.cc: the snapshot handed to the writer; the state of a checkpoint loaded at
  // creation (settings_.checkpoints.resume).
  absl::StatusOr<CheckpointInfo> CheckpointLocked(bool wait);
  // This daemon's share of a checkpoint, copied to host memory: the parameters, buffers and
  // optimizer state it writes (LocalJob::Saves). The parameters' and optimizer state's copies
  // from CUDA devices run on while training goes on: `ready` waits for them
  // (LocalJob::BeginAsyncReads).
  struct Share {
    std::vector<checkpoint::Piece> pieces;
    std::function<void()> ready;
  };
  absl::StatusOr<Share> ShareLocked();
  absl::Status CopyShareLocked(Share* out);  // ShareLocked's, may throw
  void RestoreLossScalerLocked(double scale, int good_steps, int skipped_steps);
  // checkpoint_every's: a checkpoint that cannot be taken or written fails no step; the job
  // keeps training, and the failure is logged and reported (checkpoint_error).
  void CheckpointAfterStep();
  // A job created from a checkpoint (settings_.checkpoints.resume): ReadResume finds and reads
  // it (on a thread of its own while the job is made: the files' reading overlaps import,
  // planning and placement); Resume loads what it read into the job.
  struct ResumeRead {
    std::string key;  // "resume=latest", "resume=<step>"
    absl::Status status;  // of finding or reading it
    bool none_yet = false;  // resume=latest before the first checkpoint: the job starts afresh
    v1::CheckpointManifest manifest;
    checkpoint::Contents contents;
    double read_s = 0;
  };
  static ResumeRead ReadResume(const JobSettings::Checkpoints& c, const std::string& job_name);
  absl::Status Resume(ResumeRead read);
  // Reads a tensor another daemon's part holds (null when none does: a part, or one daemon).
  RemoteRead Remote();
  std::vector<int> OutputBatchDims() const;

  const JobSettings settings_;
  JobInfo info_;
  std::mutex mu_;
  JobState state_ = JobState::kDeployed;
  std::unique_ptr<LocalJob> local_;
  // Destroyed first: the parts are deleted before this daemon's engine goes.
  Coordinator coordinator_;
  std::unique_ptr<ClientRendezvous> client_ranks_;  // with several client ranks
  // Samples each client rank gave the last collective forward (to split its outputs).
  std::vector<int64_t> rank_rows_;
  int64_t steps_ = 0;
  void LogStep();  // appends step steps_ to the step log (JobSettings::step_log_daemon)
  int64_t forwards_ = 0;
  // The hyper-parameters of the last step, per param group (a scheduler's), for checkpoints.
  std::vector<HyperParams> last_hypers_;
  int64_t resumed_step_ = -1;
  mutable std::mutex error_mu_;
  std::string snapshot_error_;  // the last checkpoint_every snapshot's failure ("" none)
  JobMetrics metrics_;
  std::shared_ptr<const EngineCounters> counters_;  // local_'s, set at creation
  // A call's end for metrics_: its time since `start`, the job's state and memory; and, after
  // a step's Measured, the iteration's end (MeasuredStep).
  void Measured(std::chrono::steady_clock::time_point start, JobMetrics::Call call);
  void MeasuredForward(const std::vector<at::Tensor>& inputs);
  void MeasuredStep();
  void MeasuredMemory();
  // Declared last: destroyed first, waiting for a write in flight while the job is whole.
  checkpoint::CheckpointWriter writer_;
};

// The job directory of the checkpoints of the job named `name` under `checkpoint_dir`
// (INVALID_ARGUMENT for a name no directory can have), and its committed checkpoints, oldest
// first: of a job that is gone, or runs elsewhere.
absl::StatusOr<std::string> CheckpointJobDir(const std::string& checkpoint_dir,
                                             const std::string& name);
std::vector<CheckpointInfo> ListCheckpointsIn(const std::string& job_dir);
// Checkpoint `step` of `job_dir` (<= 0: the newest) as one file that plain torch.load opens
// ({'model': ..., 'optimizer': ...}); `exported` gets its step. NOT_FOUND for a step it does
// not hold, DATA_LOSS for a damaged file.
absl::StatusOr<std::vector<char>> ExportCheckpointIn(const std::string& job_dir, int64_t step,
                                                     int64_t* exported);

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_H_
