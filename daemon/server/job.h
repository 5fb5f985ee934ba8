// A job: one submitted model with its parameters, optimizer and graphs, owned by the daemon.
// The job decides; the gRPC service only translates (STYLE.md habit 5). Inputs and outputs are
// at::Tensors on the host; names, shapes and errors are checked here so every client gets the
// same answers.
//
// Execution: the model is planned at creation (or a saved deployment is adopted) and runs on
// the plan's devices through a PipelineEngine, which holds the device copies of parameters,
// gradients, buffers and optimizer state. The ParamStore is the host master: it is brought up
// to date from the devices when the client reads state and when the job is undeployed, and the
// engine is rebuilt from it (with the optimizer state kept aside) at the next forward. A graph
// for another mode than the one planned (eval, say) runs whole on the host over the synced
// store, its gradients handed to the engine.
//
// Lifecycle (JobState): kDeployed -> (Undeploy) -> kUndeployed -> (Forward) -> kDeployed.
// A failed forward or backward (a bad input, a lost transfer) goes to the caller and loses
// nothing: parameters, buffers, accumulated gradients and optimizer state are taken back from
// the devices and the engine is rebuilt at the next forward.
//
// Gradient accumulation (pyrannc.delay_grad_allreduce): a forward or backward called with
// `delay_grad_allreduce` leaves its gradients unreduced over the replicas (PipelineEngine's
// SetDelayGradReduction) until AllReduceGrads. Meanwhile reading a gradient gives the reduced
// value (over several daemons, the parts reduce first), and Step and ClipGradNorm fail with
// FAILED_PRECONDITION asking for allreduce_grads().
//
// Thread-safety: every public method locks the job's mutex, so concurrent RPCs on one job are
// serialized; different jobs run independently.
#ifndef RANNC_DAEMON_SERVER_JOB_H_
#define RANNC_DAEMON_SERVER_JOB_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/comm/factory.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/optim/optimizer.h"
#include "daemon/planner/planner.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/runtime/autocast.h"
#include "daemon/runtime/loss_scale.h"
#include "daemon/runtime/model_runner.h"
#include "daemon/runtime/param_store.h"
#include "daemon/runtime/pipeline_engine.h"
#include "daemon/server/client_ranks.h"
#include "rannc/v1/training.grpc.pb.h"

namespace rannc {

enum class JobState { kDeployed, kUndeployed };
const char* JobStateName(JobState state);

struct OptimizerConfig {
  bool enabled = false;
  OptimizerKind kind = OptimizerKind::kSgd;
  // Parameter names (any alias) per group; an empty list with `enabled` is one group of all.
  std::vector<std::vector<std::string>> group_params;
  std::vector<HyperParams> group_hyper;
};

// The RaNNCModule options that change how a job runs.
struct JobConfig {
  std::string name;
  ModelMode mode;                     // the mode the model was traced in
  OptimizerConfig optimizer;
  bool check_unused_values = true;    // reject unused inputs and parameters, as RaNNC does
  // enable_zero: gradients and optimizer state sharded over each stage's replicas
  // (EngineOptions::zero), and planned so. The job also runs with it (and offload) when its plan
  // has it: planned so because nothing fit without (PlannerConfig::auto_memory), or loaded.
  bool zero = false;
  // offload_params: parameters and optimizer state in host memory, brought to the devices for
  // each step (EngineOptions::offload), and planned so.
  bool offload = false;
  // enable_apex_amp: the forwards of the model (validation, planning, the stages, other modes)
  // compute in this dtype; the parameters, their gradients and the optimizer state stay fp32
  // (the masters). How much of the forward runs in it is the config key amp_level: O1 (the
  // default) runs under autocast; O2 (`amp_o2`) rewrites the graph so that the whole forward
  // does, parameters and floating inputs cast on entry (graph/low_precision.h), without autocast.
  AmpDtype amp;
  bool amp_o2 = false;
  // The autocast the model's forwards run under: `amp` at O1, none at O2.
  AmpDtype autocast() const { return amp_o2 ? AmpDtype() : amp; }
  // Loss scaling (EngineOptions::loss_scaler): config keys loss_scale, loss_scale_init,
  // loss_scale_window; dynamic by default with fp16.
  LossScaleOptions loss_scale;
  std::vector<std::string> input_names;
  // The daemon's device names, by the plan's device index; empty: "<type>:<index>" for
  // plan_target's devices.
  std::vector<std::string> device_names;
  // Where the engine runs each of the plan's devices (EngineOptions::placement): this daemon's
  // CUDA devices where it owns GPUs; empty: every device on the CPU.
  std::vector<c10::Device> placement;
  comm::Backend backend = comm::Backend::kUcx;

  // Planning: the devices to plan for (the daemon's, or any for a dry run), the job's planner
  // keys, and the daemon's profile cache (not owned; null: no caching).
  planner::PlanTarget plan_target;
  planner::PlannerConfig planner;
  planner::ProfileCache* profile_cache = nullptr;
  std::string load_deployment;  // a serialized Deployment to use instead of planning
  std::string created_by;       // recorded in deployments, e.g. "ranncd 0.1.0"

  // Client processes of the job (JobOptions.client_world) and how their batches combine.
  int client_world = 1;
  bool gather_inputs = true;
  std::chrono::milliseconds client_timeout = std::chrono::minutes(5);
  // JobOptions.lease_ms: the job is deleted once no call has named it for this long (Touch,
  // LeaseExpired); zero: never.
  std::chrono::milliseconds lease{0};

  // A job over several daemons (docs/cluster.md): the plan's devices this daemon runs (empty:
  // all), where the parts' communicators meet (this daemon's own store when it leads, else the
  // leader's address), and the group name every part uses.
  std::vector<int> local_devices;
  comm::Store* engine_store = nullptr;
  std::string engine_store_address;
  std::string engine_group;
  bool is_part = false;  // created by a leading daemon: reads of tensors held elsewhere fail
  // Leader only: the other daemons and the plan's device indices each owns, and the JobSpec to
  // create their parts with (this daemon's own address as the store).
  struct Member {
    std::string address;
    std::vector<int> devices;
  };
  std::vector<Member> members;
  std::string self_address;
  v1::JobSpec spec;  // the client's, for the members' parts
};

struct JobSummary {
  std::string id;
  std::string name;
  JobState state;
  int64_t num_params = 0;
  int64_t steps = 0;
  int64_t forwards = 0;
  std::vector<std::string> devices;
  // Per device above: bytes the job holds there (parameters, gradients, buffers, optimizer
  // state); zeros once undeployed.
  std::vector<int64_t> device_bytes;
  // Per device: the most held at once during a step since the job was last deployed.
  std::vector<int64_t> peak_device_bytes;
  double loss_scale = 1;
  int64_t skipped_steps = 0;
  std::chrono::system_clock::time_point created;
};

struct StateEntry {
  std::string name;
  at::Tensor tensor;  // a copy, safe to encode after the job's lock is released
  bool is_buffer = false;
};

// One output of the model for the example inputs (CreateJobResponse.outputs).
struct OutputSpec {
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;
};

// Where Job::Create spent its time, for the daemon's CreateJob log line (seconds each).
struct CreateTimings {
  double import_s = 0;  // loading the TorchScript archive, lifting its tensors
  double ir_s = 0;      // building the IR (which probes the model)
  double plan_s = 0;    // planning, or checking a loaded deployment
  double place_s = 0;   // placing parameters (and optimizer state) on the devices
};

class Job {
 public:
  // Imports `model_bytes` (with `sent` in place of its stand-ins: see ImportTorchScript), checks it against `config`, and runs it once on `example_inputs`
  // (no gradients, buffers restored afterwards) to validate it and learn its outputs.
  // INVALID_ARGUMENT for a bad model or one that fails on the example inputs.
  // Then builds the model's IR and plans it for config.plan_target (or checks and adopts
  // config.load_deployment): RESOURCE_EXHAUSTED when no plan fits the devices.
  ~Job();

  static absl::StatusOr<std::unique_ptr<Job>> Create(std::string id, JobConfig config,
                                                     const std::string& model_bytes,
                                                     const std::vector<at::Tensor>& example_inputs,
                                                     const SentTensors& sent = {});

  // A dry run: the same checks and planning as Create, for config.plan_target, with no job.
  static absl::StatusOr<v1::Deployment> PlanOnly(const JobConfig& config,
                                                 const std::string& model_bytes,
                                                 const std::vector<at::Tensor>& example_inputs,
                                                 const SentTensors& sent = {});

  const std::string& id() const { return id_; }
  // The dtype and shape of each (flattened) output for the example inputs, from the IR's
  // example run; parameters and buffers with their aliases (names and shapes: the values live
  // on the devices; read them with GetTensor or StateDict).
  const std::vector<OutputSpec>& output_specs() const { return output_specs_; }
  const CreateTimings& create_timings() const { return create_timings_; }
  const ParamStore& params() const { return store_; }
  const std::vector<std::string>& devices() const { return devices_; }
  // The job's plan (planned at creation or loaded from a deployment file).
  const v1::Deployment& deployment() const { return deployment_; }

  absl::Status AddMode(const ModelMode& mode, const std::string& model_bytes);
  // Returns whether the job has a graph for `mode`.
  bool SetMode(const ModelMode& mode);

  // `delay_grad_allreduce`: see the header comment; with requires_grad it decides for the
  // gradients a fused forward computes (PipelineEngine::fused).
  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad,
                                                  bool delay_grad_allreduce = false);

  // The same calls from one of several client ranks (JobConfig::client_world): each waits for
  // every rank's call and the operation runs once (see training.proto's JobOptions). With one
  // client rank they are the calls above.
  absl::StatusOr<std::vector<at::Tensor>> Forward(int client_rank,
                                                  const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad,
                                                  bool delay_grad_allreduce = false);
  absl::Status Backward(int client_rank,
                        const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                        bool retain_graph, bool delay_grad_allreduce = false);
  absl::Status Step(int client_rank, const std::vector<HyperParams>& hypers);
  absl::Status AllReduceGrads(int client_rank);
  absl::Status ZeroGrad(int client_rank, bool set_to_none);
  absl::StatusOr<double> ClipGradNorm(int client_rank, double max_norm, double norm_type);
  const std::string& name() const { return config_.name; }
  bool amp() const { return config_.amp.has_value(); }
  // A daemon running a part of this job, or leading it, is gone (cluster::Cluster::OnMemberDown):
  // the step in progress fails at once, and every later call fails with UNAVAILABLE naming it.
  // Returns whether this job is a part that daemon led (nothing can use it any more: the caller
  // deletes it). No-op for a job that did not use that daemon. Callable from any thread,
  // without the job's lock.
  bool MemberLost(const std::string& address, const std::string& reason);
  // On a part: the leading daemon failed the step in progress (a bad input found elsewhere, say);
  // its waits are abandoned at once. Callable from any thread, without the job's lock.
  void AbortStep();
  // On a part, the two halves of ClipGradNorm the leading daemon combines: the gradient norms
  // of the parameters this daemon holds, by name; and scaling every gradient copy here.
  absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> GradNorms(double norm_type);
  absl::Status ScaleGrads(const at::Tensor& coefficient);
  int client_world() const { return config_.client_world; }
  // The client's lease (JobConfig::lease): every call naming the job renews it
  // (JobManager::Get). Callable from any thread, without the job's lock.
  void Touch();
  std::chrono::milliseconds IdleFor(std::chrono::steady_clock::time_point now) const;
  bool LeaseExpired(std::chrono::steady_clock::time_point now) const;
  std::chrono::milliseconds lease() const { return config_.lease; }
  absl::Status Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                        bool retain_graph, bool delay_grad_allreduce = false);
  absl::Status Step(const std::vector<HyperParams>& hypers);
  // pyrannc's allreduce_grads(): reduces what delayed backwards accumulated, on every daemon of
  // the job. OK, doing nothing, when nothing is pending.
  absl::Status AllReduceGrads();
  void ZeroGrad(bool set_to_none);
  // torch.nn.utils.clip_grad_norm_ over every parameter: returns the total norm.
  absl::StatusOr<double> ClipGradNorm(double max_norm, double norm_type);

  // A copy of a parameter/buffer (or its gradient; nullopt when the gradient is None).
  absl::StatusOr<std::optional<at::Tensor>> GetTensor(const std::string& name, bool grad);
  // Copies of every state_dict entry, in PyTorch's order, aliases included.
  std::vector<StateEntry> StateDict();
  absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& state, bool strict,
                             std::vector<std::string>* missing,
                             std::vector<std::string>* unexpected);
  // Brings the host master up to date and frees every device's copies (optimizer state is
  // kept on the host); the next Forward deploys again.
  void Undeploy();
  // pyrannc.recreate_all_communicators(): rebuilds the engine (and with it every communicator)
  // from the devices' current state; over several daemons, every part's at once.
  absl::Status RecreateCommunicators();
  JobSummary Summary();

 private:
  Job(std::string id, JobConfig config);

  // Builds the engine from the host master (parameters, buffers, gradients, optimizer state).
  absl::Status Deploy();
  absl::Status EnsureDeployed();
  // Copies the engine's parameters and buffers (and gradients, with `grads`) into the store.
  // Without `grads`, when leading parts, the values they hold are fetched too, deployed or not.
  void SyncStore(bool grads);
  // Takes this daemon's values back from the engine into the store and frees the devices.
  void ReleaseEngine();
  // Whether this daemon's devices hold lifted tensor `lifted` (always, for a job on one daemon).
  bool Held(int lifted) const;
  // Gradients of delayed backwards are not reduced yet (on the engine, or parked as shares).
  bool GradsPending() const;
  // AllReduceGrads under the job's lock.
  absl::Status ReduceGradsLocked();
  // On a part, a step's failure to reach a peer (UNAVAILABLE) is the consequence of a failure
  // elsewhere, which the leader reports: ABORTED, so the leader does not take this daemon for
  // lost. Other statuses, and every status off a part, pass unchanged.
  absl::Status PartStatus(absl::Status status) const;

  // A job over several daemons (docs/cluster.md). The leader creates the members' parts (their
  // engines meet this daemon's while it deploys). OnParts makes one call of this job on every
  // part at once while `local` runs here (a part deploys when the call finds it undeployed, so
  // `local` deploys too: EnsureDeployed). A part that cannot be reached loses the job
  // (MemberLost); any other failure, here or on a part, aborts the step everywhere at once, and
  // every daemon's engine is released, losing nothing, to be rebuilt by the next call.
  struct Part {
    std::string address, job_id;
    std::unique_ptr<v1::TrainingService::Stub> stub;
  };
  using PartCall = std::function<grpc::Status(Part&, grpc::ClientContext&)>;
  absl::Status CreateParts(const std::string& model_bytes,
                           const std::vector<at::Tensor>& example_inputs);
  absl::Status OnParts(const PartCall& call, const std::function<absl::Status()>& local);
  // Fails the step in progress here and on every part (AbortStep), at most once per step.
  void AbortEverywhere();
  // Every part releases its engine (Undeploy), as this daemon has.
  void UndeployParts();
  // Makes the same JobRef call (DeleteJob, AbortStep, Undeploy) on every part at once, waiting
  // at most `deadline` for each; the answers are ignored.
  using PartNotice = grpc::Status (v1::TrainingService::Stub::*)(grpc::ClientContext*,
                                                                 const v1::JobRef&, v1::Empty*);
  void TellParts(PartNotice notice, std::chrono::seconds deadline);
  // Sends state_dict entries to every part (each takes those it holds).
  absl::Status PushToParts(const std::map<std::string, at::Tensor>& state);
  // A tensor (or its gradient) held by another daemon's part.
  absl::StatusOr<at::Tensor> PartTensor(const std::string& name, bool grad);
  // ClipGradNorm over the parts: their norms combined here, then every copy scaled.
  absl::StatusOr<double> ClipOverParts(double max_norm, double norm_type);
  // The parameters whose gradients clip_grad_norm takes, as lifted indices in the client's order.
  std::vector<int> ClippedParams() const;
  // The plan's device indices, ascending.
  std::vector<int> deployment_devices() const;

  const std::string id_;
  const JobConfig config_;
  const std::chrono::system_clock::time_point created_;
  // When a call last named the job (steady clock, nanoseconds since its epoch).
  std::atomic<int64_t> touched_ns_;
  std::vector<std::string> devices_;
  std::vector<InputSignature> signature_;
  v1::Deployment deployment_;
  // The memory switches the engine runs with: the config's, and those the plan needs.
  bool zero_ = false;
  bool offload_ = false;

  std::mutex mu_;
  JobState state_ = JobState::kDeployed;
  ModelMode mode_;
  ParamStore store_;
  std::unique_ptr<ModelRunner> runner_;  // validation and modes other than the planned one
  std::unique_ptr<IrGraph> ir_;          // of the planned mode's graph; outlives engine_
  std::vector<int> lifted_of_entry_;     // per store entry: its IR lifted index, or -1
  std::unique_ptr<PipelineEngine> engine_;  // null while undeployed
  bool engine_forward_ = true;           // the last forward ran on the engine (not runner_)
  std::vector<std::vector<int>> optimizer_groups_;  // lifted indices per param group
  std::unique_ptr<ClientRendezvous> client_ranks_;  // with several client ranks
  std::vector<Part> parts_;                         // the members' parts, when leading
  std::unique_ptr<comm::Store> part_store_;         // the leader's store, when a part
  int deployments_ = 0;                             // engines built so far
  std::vector<bool> held_;                          // by lifted index: see Held()
  // Cancels the current engine's step in progress (one per engine: set when a part is lost or
  // a step is aborted). Guarded by lost_mu_, as is lost_.
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  std::mutex lost_mu_;
  absl::Status lost_;
  std::atomic<bool> aborting_{false};  // AbortEverywhere ran during the current OnParts
  absl::Status Lost();
  // Samples each client rank gave the last collective forward (to split its outputs).
  std::vector<int64_t> rank_rows_;
  // The store's gradients are this daemon's shares of unreduced ones (an engine spanning
  // daemons released with reductions pending): Deploy puts them back as shares.
  bool grad_shares_ = false;
  // Optimizer state while undeployed, by lifted index.
  std::map<int, std::vector<std::pair<std::string, at::Tensor>>> parked_optimizer_state_;
  // The loss scaler's state while no engine holds it (undeployed), and each engine's start.
  LossScaler parked_loss_scaler_;
  std::vector<OutputSpec> output_specs_;
  CreateTimings create_timings_;
  int64_t steps_ = 0;
  int64_t forwards_ = 0;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_H_
