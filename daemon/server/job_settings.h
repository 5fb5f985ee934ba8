// What a job runs with (JobSettings), and the policy that makes it from a client's JobSpec on
// this daemon: its devices, the memory switches and AMP, the planner's keys, and, over a
// cluster, which daemon runs which of the plan's devices. No gRPC here: the services call these
// functions, and tests call them without a server.
//
//   absl::StatusOr<JobSettings> s = JobSettingsFromSpec(spec, facts);   // CreateJob
//   absl::Status spanned = SpanCluster(job_id, spec, members, facts, store, &*s);
//   s->backend = JobBackend(s->placement, facts.devices);
//
// Everything here is a pure function of its arguments; thread-safe.
#ifndef RANNC_DAEMON_SERVER_JOB_SETTINGS_H_
#define RANNC_DAEMON_SERVER_JOB_SETTINGS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cluster/membership.h"
#include "daemon/comm/factory.h"
#include "daemon/comm/store.h"
#include "daemon/optim/optimizer.h"
#include "daemon/planner/links.h"
#include "daemon/planner/planner.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/runtime/autocast.h"
#include "daemon/runtime/loss_scale.h"
#include "daemon/runtime/model_runner.h"
#include "daemon/runtime/numerics.h"
#include "rannc/v1/job_part.pb.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// What GetInfo reports and what jobs are made for; fixed for the daemon's lifetime.
// The most client ranks a job may have (JobOptions.client_world, JoinJob's and ClientBarrier's
// client_world): RaNNC's client processes are one per GPU, and a rendezvous of client ranks
// keeps a slot per rank (a request naming 2^30 of them asked for gigabytes).
inline constexpr uint32_t kMaxClientWorld = 4096;

// INVALID_ARGUMENT naming `what` when `world` exceeds kMaxClientWorld.
absl::Status CheckClientWorld(uint32_t world, const std::string& what);

struct DaemonFacts {
  std::string version;
  std::string torch_version;
  std::string hostname;
  uint64_t max_message_bytes = 0;
  std::string shm_dir;
  struct Device {
    std::string name;
    std::string type;
    uint64_t memory_bytes = 0;
    int cuda_index = -1;  // the GPU, for a CUDA device
    bool shared = false;  // one of several devices on its GPU (--devices cuda:I/N)
  };
  std::vector<Device> devices;
  planner::Links links;                             // for the planner's cost model
  planner::ProfileCache* profile_cache = nullptr;   // owned by the Daemon
};

struct OptimizerConfig {
  bool enabled = false;
  OptimizerKind kind = OptimizerKind::kSgd;
  std::shared_ptr<const ScriptedUpdate> scripted;  // kScripted's update, checked
  // The keys of a param's state: OptimizerStateKeys(kind), or the scripted update's.
  const std::vector<std::string>& StateKeys() const {
    return scripted != nullptr ? scripted->state_keys : OptimizerStateKeys(kind);
  }
  // For checkpoints, plans and messages: OptimizerKindName(kind), or the scripted update's name.
  std::string Name() const {
    return scripted != nullptr ? scripted->name : OptimizerKindName(kind);
  }
  // Parameter names (any alias) per group; an empty list with `enabled` is one group of all.
  std::vector<std::vector<std::string>> group_params;
  std::vector<HyperParams> group_hyper;
};

// The RaNNCModule options that change how a job runs, resolved for this daemon.
struct JobSettings {
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
  // Config key amp_cast_group_bytes: at O2, the stages' casts of their parameters made in
  // groups of this many bytes (EngineOptions::amp_cast_group_bytes); 0: as the graph has them.
  int64_t amp_cast_group_bytes = int64_t{256} << 20;
  // Config key outputs_before_backward (EngineOptions::outputs_before_backward).
  bool outputs_before_backward = true;
  // RaNNC's allreduce_amp_master_params: True, the replicas all-reduce the fp32 masters'
  // gradients; False (RaNNC's default), at O2 they all-reduce them as `amp` (what Apex's fp16
  // model gradients are), half the bytes. At O1 the forward reads fp32 parameters: fp32 always.
  bool allreduce_amp_master_params = false;
  // The dtype the replicas all-reduce gradients as (EngineOptions::grad_wire_dtype).
  AmpDtype grad_wire_dtype() const {
    return amp_o2 && !allreduce_amp_master_params ? amp : AmpDtype();
  }
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
  // JobOptions.lease_ms: the job is deleted once no call has named it for this long
  // (JobManager); zero: never.
  std::chrono::milliseconds lease{0};
  // Config key admission_wait: how long a client's job waits for other jobs to leave its plan
  // the memory it needs (TrainingServiceImpl::Admit).
  std::chrono::milliseconds admission_wait = std::chrono::seconds(30);
  // The client's PyTorch numeric switches (TF32, cuDNN, deterministic algorithms), which the
  // job holds while it lives (LocalJob: a NumericsLease).
  NumericSettings numerics;

  // Checkpoints (docs/checkpoints.md), from the config keys of the same names: written under
  // `<dir>/<name>/` (dir empty: none), every `every` optimizer steps (0: when asked), the newest
  // `keep` kept (0: all). `resume`: the job starts from the checkpoint of this step, 0 for the
  // newest if there is one (config key resume=latest|STEP), -1 afresh.
  struct Checkpoints {
    std::string dir;
    int every = 0;
    int keep = 3;
    int64_t resume = -1;
  };
  Checkpoints checkpoints;
  // A job in the cluster's registry (server/job_registry.h): `fence` says whether this daemon
  // surely still leads it, checked before each optimizer step and checkpoint commit; and each
  // step applied is appended to the job's step log (<checkpoint job dir>/steps.log:
  // "<unix ms> <daemon> <job id> <step>"), so that who applied which step can be checked.
  std::function<absl::Status()> fence;
  std::string step_log_daemon;  // the daemon's address; empty: no step log

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
  v1::JobSpec spec;  // the client's (for the members' parts, and checkpoints' manifests)
};

// The settings CreateJob makes of a client's JobSpec on a daemon with `facts`, before a dry
// run, a part of a cluster job or a cluster's devices change them; the backend is not set
// (JobBackend). INVALID_ARGUMENT naming the key or option that is wrong.
absl::StatusOr<JobSettings> JobSettingsFromSpec(const v1::JobSpec& spec, const DaemonFacts& facts);

// The config key checkpoint_dir of `spec` as JobSettings::checkpoints.dir has it ("~/" expanded;
// "" unset): where a job's, or a durable job record's, checkpoints are.
std::string CheckpointDirOf(const v1::JobSpec& spec);

// A dry run (JobSpec.dry_run): plan for those devices instead of this daemon's.
absl::Status ApplyDryRun(const v1::PlanTarget& dry, JobSettings* settings);

// This daemon's part of a job another daemon leads: the spec's settings, run on `part`'s devices.
absl::StatusOr<JobSettings> PartSettings(const v1::JobSpec& spec, const v1::PartSpec& part,
                                         const DaemonFacts& facts);

// With a cluster of several daemons, a job runs on all that are UP: numbers the cluster's
// devices (by member rank, then each member's order) and fills `settings`' part of the job this
// daemon leads; `store` is this daemon's (the parts' rendezvous). UNAVAILABLE while a member
// has not been heard from; DOWN members are left out (`left_out` says which). Nothing changes
// with fewer than two members UP.
absl::Status SpanCluster(const std::string& job_id, const v1::JobSpec& spec,
                         std::vector<cluster::MemberInfo> members, const DaemonFacts& facts,
                         comm::Store* store, JobSettings* settings,
                         std::vector<std::string>* left_out);

// The backend a job's devices talk over: NCCL between GPUs (`cuda`) where the build has it;
// otherwise, and when any of the daemon's `devices` shares its GPU (which NCCL refuses), UCX,
// through host memory for CUDA buffers.
comm::Backend JobBackend(bool cuda, const std::vector<DaemonFacts::Device>& devices);
// The same for a job placed on `placement` (JobSettings::placement): cuda when any device is.
comm::Backend JobBackend(const std::vector<c10::Device>& placement,
                         const std::vector<DaemonFacts::Device>& devices);

// Where the engine runs each of a plan's `num_devices` devices: the daemon's k-th device of
// `devices` (a GPU, or the CPU) is plan device local[k], or k when `local` is empty (the daemon's
// own plan); other daemons' devices are the CPU here (not run by this daemon).
std::vector<c10::Device> Placement(const std::vector<DaemonFacts::Device>& devices,
                                   int num_devices, const std::vector<int>& local);

// The daemon's kind for a wire optimizer type; INVALID_ARGUMENT for OPTIMIZER_NONE or an
// unknown one.
absl::StatusOr<OptimizerKind> OptimizerKindOf(v1::OptimizerType type);

// The wire's forms of a mode and of a param group's hyper-parameters (the optional fields a
// client left unset take torch.optim's defaults for `kind`).
ModelMode FromProto(const v1::Mode& mode);
HyperParams FromProto(const v1::HyperParams& h, OptimizerKind kind);
v1::HyperParams ToProto(const HyperParams& h);

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_SETTINGS_H_
