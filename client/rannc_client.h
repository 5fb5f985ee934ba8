// rannc::Client: the C++ SDK of ranncd. One Client is one gRPC channel to one daemon and exposes
// rannc.v1.TrainingService with plain C++ types: tensors are HostTensors (raw bytes, no
// LibTorch), streams (model upload, state_dict) are chunked and reassembled here, and every
// failure is an absl::Status whose code is the gRPC code and whose message is the daemon's,
// prefixed with the RPC's name.
//
// Thread-safety: all methods may be called from any number of threads at once (the gRPC stub
// is thread-safe; the only mutable state is the call numbering below, behind a mutex). The
// daemon orders the calls of one job; callers that interleave forward/backward of one job from
// several threads get the daemon's ordering, not a guaranteed one.
//
// Exactly-once calls (training.proto's CallId): the mutating calls (Forward, Backward, Step,
// ZeroGrad, ClipGradNorm, Checkpoint, LoadStateDict, LoadOptimizerState) carry a CallId, and one
// whose answer is lost (UNAVAILABLE or DEADLINE_EXCEEDED) is sent again with the same CallId:
// the daemon answers a repeat of a client id's last call from its record instead of applying it
// twice. Retries back off from 50 ms, doubling up to 2 s, for at most
// ClientOptions::call_retry_timeout after the first failure; then the call fails with the last
// cause. An error the daemon answers from its record (trailing metadata "rannc-replayed") is the
// call's own and is returned at once. Streamed loads send their whole stream again.
// The daemon keeps one call per client id, so a client id must have one call in flight at a
// time: each (Client, thread) pair numbers its calls under a client id of its own (random 128-bit
// hex, made on the thread's first mutating call; seq 1, 2, ...), kept in a mutex-guarded map of
// the Client keyed by std::thread::id. Threads therefore never wait for each other's calls (no
// call is serialized), and a thread's calls are sequential by nature. A std::thread::id reused by
// a later thread continues the numbering of the finished one, which is equally correct.
//
// Lifetimes: a Client owns its channel; jobs belong to the daemon and outlive the Client unless
// deleted with DeleteJob. Arguments are copied or consumed before a method returns.
//
// Example:
//   rannc::Client client("127.0.0.1:7411");
//   RETURN_IF_ERROR(client.WaitUntilReady(absl::Seconds(10)));
//   rannc::JobConfig config;
//   config.name = "mlp";
//   config.optimizer.set_type(rannc::v1::SGD);  // no groups: one group of all parameters
//   config.example_inputs = {rannc::HostTensor::FromVector<float>(x, {4, 8})};
//   absl::StatusOr<rannc::v1::CreateJobResponse> job = client.CreateJob(model_bytes, config);
//   std::cout << job->plan_summary();  // the daemon's plan: pipeline stages and devices
//   absl::StatusOr<rannc::ForwardResult> out = client.Forward(job->job_id(), inputs);
//   RETURN_IF_ERROR(client.Backward(job->job_id(), {{0, rannc::HostTensor::Scalar(1.0f)}}));
//   rannc::v1::HyperParams sgd;
//   sgd.set_lr(0.1);
//   RETURN_IF_ERROR(client.Step(job->job_id(), {sgd}));
//   RETURN_IF_ERROR(client.DeleteJob(job->job_id()));
#ifndef RANNC_CLIENT_RANNC_CLIENT_H_
#define RANNC_CLIENT_RANNC_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/chunking.h"
#include "client/host_tensor.h"
#include "rannc/v1/training.grpc.pb.h"

namespace rannc {

class Periodic;  // daemon/common/periodic.h

struct ClientOptions {
  // Largest message the channel sends or accepts, in bytes. Generous, so that the daemon's
  // --max-message-size is the limit that applies. Default 1 GiB.
  int max_message_bytes = 1 << 30;
  // Model bytes per CreateJob/AddMode chunk. Default 1 MiB (the protocol's bound).
  size_t model_chunk_bytes = 1 << 20;
  // Tensor bytes per LoadStateDict chunk. Default 4 MiB.
  size_t state_dict_chunk_bytes = 4 << 20;
  // Deadline for each RPC; infinite (the default) because a first forward may plan for minutes.
  absl::Duration rpc_timeout = absl::InfiniteDuration();
  // Reconnect backoff: the first wait and the longest, so that WaitUntilReady notices a starting
  // daemon quickly. Defaults 100 ms and 1 s (gRPC's own are 1 s and 120 s).
  int initial_reconnect_backoff_ms = 100;
  int max_reconnect_backoff_ms = 1000;
  // How long one connection attempt (TCP connect, TLS handshake) may take before gRPC abandons
  // it ("tcp handshaker shutdown") and fails the calls waiting on it that are not
  // wait-for-ready. gRPC takes it from GRPC_ARG_MIN_RECONNECT_BACKOFF_MS; set to the 100 ms
  // backoff, as it was, an attempt on a loaded machine missed it. Default 20 s (gRPC's own).
  int connect_attempt_timeout_ms = 20000;
  // How long a mutating call whose answer was lost (UNAVAILABLE, DEADLINE_EXCEEDED) is retried
  // with the same CallId, counted from its first failure (see "Exactly-once calls" above; the
  // same bound as pyrannc's client config key call_retry_timeout). An attempt under way when it
  // passes still runs to its end (or rpc_timeout). Default 30 s; zero: no retries.
  absl::Duration call_retry_timeout = absl::Seconds(30);
  // Called before each retry with the RPC's name and the failure retried (e.g. to log it); must
  // not call the Client (from this thread: its calls would overtake the one being retried).
  // Default none.
  std::function<void(absl::string_view rpc, const absl::Status& cause)> on_retry;
  // TLS (a daemon started with --tls-cert): the CA to verify the daemon with, and a client
  // certificate and key to present (optional). All empty, the default: plain text. The same as
  // the client config keys tls_ca, tls_cert and tls_key (RANNC_TLS_CA, ...).
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  // The token every call carries (a daemon with --auth-token-file): the admin's, or a job's
  // (CreateJobResponse.job_token). Empty, the default: none. The client config key `token`.
  std::string token;
};

// What CreateJob needs besides the model bytes: JobSpec with HostTensor example inputs.
struct JobConfig {
  std::string name;                   // label for `rannc jobs`; default empty
  v1::Mode mode;                      // set_training(true) etc.; all false by default (eval)
  v1::OptimizerSpec optimizer;        // OPTIMIZER_NONE by default: forward/backward only
  v1::JobOptions options;             // default: all off; the fields below override its own
  std::vector<HostTensor> example_inputs;  // the first batch
  std::vector<std::string> input_names;    // optional, for the daemon's error messages
  // A serialized v1::Deployment (a deployment file's bytes) to run instead of planning.
  // Default empty: the daemon plans. Non-empty replaces options.load_deployment.
  std::string load_deployment;
  // Planner and job config keys (JobOptions.config), e.g. {"partition_num", "2"},
  // {"schedule", "gpipe"}; see docs/planner.md. Default empty: the daemon's defaults. Merged
  // over options.config, these winning.
  std::map<std::string, std::string> config;
  // Plan only: with dry_run.num_devices() > 0 the daemon plans for that many devices of
  // dry_run.device_memory_bytes() each (0: its own devices' budget) at batch_size() (0: the
  // example batch), creates no job, and answers with deployment and plan_summary and an empty
  // job_id. Default: num_devices 0, a normal job.
  v1::PlanTarget dry_run;
};

struct ForwardResult {
  std::vector<HostTensor> outputs;  // flattened, in the traced order
  uint64_t forward_id = 0;
};

struct OutputGrad {
  uint32_t output_index = 0;
  HostTensor grad;
};

struct LoadStateDictResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

// Failover (ranncd --cluster-store; docs/cluster.md): a job that checkpoints is in the
// cluster's registry, and when the daemon leading it is lost another daemon takes it over from
// its latest checkpoint under a new id (or its leader brings it back so after losing a part).
// Its calls then fail (UNAVAILABLE, or NOT_FOUND for the old id); Moved says where it went:
//
//   rannc::Client client("10.0.0.1:7411,10.0.0.2:7411");   // the daemons it may move to
//   absl::Status s = client.Step(job_id, {sgd});
//   if (!s.ok()) {
//     absl::StatusOr<std::optional<v1::RegisteredJob>> moved = client.Moved(job_id, "gpt");
//     if (moved.ok() && moved->has_value()) {
//       rannc::Client there((*moved)->leader());   // drive it there, under its new id,
//       job_id = (*moved)->job_id();               // from its checkpoint's step:
//       step = std::max<int64_t>((*moved)->resumed_step(), 0);
//     }
//   }
class Client {
 public:
  // Connects lazily to `address` ("host:port", or any gRPC target such as "unix:/path"). A
  // comma-separated list names daemons of one cluster: the Client talks to the first, and
  // LocateJob asks the others too (ConnectAny picks the first that answers instead).
  explicit Client(const std::string& address, const ClientOptions& options = {});
  // A Client of the first of `addresses` ("a:1,b:2") that answers GetInfo, asking each in turn
  // (a second at a time) for up to `timeout`: UNAVAILABLE naming each when none does.
  static absl::StatusOr<std::unique_ptr<Client>> ConnectAny(const std::string& addresses,
                                                            absl::Duration timeout,
                                                            const ClientOptions& options = {});
  // Uses an existing channel, e.g. an in-process one in tests.
  Client(std::shared_ptr<grpc::Channel> channel, std::string address,
         const ClientOptions& options = {});
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& address() const { return address_; }
  // Every daemon this Client knows: its own first, then the others its address listed.
  const std::vector<std::string>& addresses() const { return addresses_; }

  // Blocks until the daemon answers GetInfo or `timeout` passes (DEADLINE_EXCEEDED, naming the
  // address). A daemon that is still starting, or stopping (it cancels the call), is retried,
  // not reported.
  absl::Status WaitUntilReady(absl::Duration timeout) const;

  absl::StatusOr<v1::DaemonInfo> GetInfo() const;
  absl::StatusOr<std::vector<v1::JobSummary>> ListJobs() const;

  // Uploads a TorchScript module (torch.jit.save's bytes) with its spec, in chunks. The
  // response carries the job's plan (deployment, plan_summary); with config.dry_run it carries
  // only the plan and no job is created.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(std::string_view model_bytes,
                                                  const JobConfig& config) const;
  // The same with a ready-made proto spec; model_bytes in `spec` is filled in here.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(std::string_view model_bytes,
                                                  v1::JobSpec spec) const;
  // Adds the graph traced in another mode (e.g. eval) to a job.
  absl::Status AddMode(const std::string& job_id, const v1::Mode& mode,
                       std::string_view model_bytes) const;
  absl::Status DeleteJob(const std::string& job_id) const;
  // Brings back a suspended job (ranncd --state-dir; `job`: its id or name) from its latest
  // checkpoint, under its id and held by no client; NOT_FOUND when there is none.
  absl::StatusOr<v1::CreateJobResponse> ResumeJob(const std::string& job) const;
  // Where the job `name` runs now (ranncd --cluster-store), from the cluster's registry, asked
  // of each daemon this Client knows (its own first) until one answers: NOT_FOUND when the job
  // is not registered, FAILED_PRECONDITION from a daemon without a registry.
  absl::StatusOr<v1::RegisteredJob> LocateJob(const std::string& name) const;
  // The registry's entry of the job `name` if it runs under another id than `job_id` now (it
  // moved: see "Failover" above); nullopt while it has not (or is not registered).
  absl::StatusOr<std::optional<v1::RegisteredJob>> Moved(const std::string& job_id,
                                                         const std::string& name) const;
  // Renews the client's lease on these jobs (JobOptions.lease_ms); returns the ids the daemon
  // does not know (deleted, or expired). Any call naming a job renews it too; LeaseKeeper
  // renews from a thread.
  absl::StatusOr<std::vector<std::string>> RenewLeases(
      const std::vector<std::string>& job_ids) const;

  // requires_grad=false is torch.no_grad(): the daemon keeps no graph for Backward.
  absl::StatusOr<ForwardResult> Forward(const std::string& job_id,
                                        const std::vector<HostTensor>& inputs,
                                        bool requires_grad = true) const;
  // Gradients of the last forward's outputs; outputs not listed get none.
  absl::Status Backward(const std::string& job_id, const std::vector<OutputGrad>& grads,
                        bool retain_graph = false) const;
  // One HyperParams per param group, in CreateJob's group order.
  absl::Status Step(const std::string& job_id, const std::vector<v1::HyperParams>& groups) const;
  absl::Status ZeroGrad(const std::string& job_id, bool set_to_none = false) const;
  // Returns the total norm before clipping.
  absl::StatusOr<double> ClipGradNorm(const std::string& job_id, double max_norm,
                                      double norm_type = 2.0) const;

  absl::StatusOr<HostTensor> GetParam(const std::string& job_id, const std::string& name,
                                      bool amp_master_param = false) const;
  // std::nullopt when the gradient is None.
  absl::StatusOr<std::optional<HostTensor>> GetParamGrad(const std::string& job_id,
                                                         const std::string& name,
                                                         bool amp_master_param = false) const;

  // Parameters and buffers by name, reassembled from the stream.
  absl::StatusOr<NamedTensors> StateDict(const std::string& job_id,
                                         bool amp_master_params = false) const;
  // Sends `state` in chunks of at most options.state_dict_chunk_bytes; names in `buffers` are
  // marked as buffers.
  absl::StatusOr<LoadStateDictResult> LoadStateDict(
      const std::string& job_id, const NamedTensors& state, bool strict = true,
      const std::set<std::string>& buffers = {}) const;

  // The optimizer's state as torch.optim's state_dict() keeps it: parameter name -> key ("step",
  // "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer") -> tensor; empty before the
  // first step. LoadOptimizerState replaces it (parameters it leaves out start afresh);
  // INVALID_ARGUMENT, changing nothing, for an unknown parameter or key or a wrong shape.
  using OptimizerState = std::map<std::string, NamedTensors>;
  absl::StatusOr<OptimizerState> GetOptimizerState(const std::string& job_id) const;
  absl::Status LoadOptimizerState(const std::string& job_id, const OptimizerState& state) const;

  // Returns whether the job already holds a graph for `mode` (if not, AddMode it before the
  // next Forward).
  absl::StatusOr<bool> SetMode(const std::string& job_id, const v1::Mode& mode) const;
  absl::Status Undeploy(const std::string& job_id) const;
  absl::Status RecreateCommunicators(const std::string& job_id) const;

  // Checkpoints. A job writes them under <checkpoint_dir>/<job name>/ (config key
  // checkpoint_dir; a job without one gets FAILED_PRECONDITION); the directory is the daemon's,
  // on its file system.
  //
  // Writes a checkpoint of the job now, at the boundary of the call it waits for. With `wait` it
  // returns once the checkpoint is committed; without, once its tensors are copied to host
  // memory (committed false, write_s 0): training goes on while the daemon writes them, and a
  // failed write shows in ListCheckpoints' error.
  absl::StatusOr<v1::CheckpointInfo> Checkpoint(const std::string& job_id,
                                                bool wait = true) const;
  // The checkpoints of a live job (ref.job_id), or of any job by name (ref.job_name under
  // ref.checkpoint_dir: after the job is gone, or one of another daemon), oldest first; error
  // holds a live job's last failed asynchronous write.
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::CheckpointsRef& ref) const;
  // Writes checkpoint ref.step (0 or less: the newest) as one file that plain torch.load opens
  // ({'model': state_dict, 'optimizer': optimizer state_dict}) to `out_path`, and returns the
  // step written. The bytes go to out_path + ".tmp", renamed to out_path once all of them came,
  // so out_path is never left half-written (on failure the .tmp file is removed). NOT_FOUND
  // when there is no such checkpoint; DATA_LOSS when the stream ends short of (or beyond) the
  // total_bytes it announced; a local file error is the errno's code, naming the path.
  absl::StatusOr<int64_t> ExportCheckpoint(const v1::CheckpointsRef& ref,
                                           const std::string& out_path) const;

  // Detached jobs (docs/detached.md): the daemon trains them on its own. SubmitJob returns the
  // job's id once the daemon has checked the spec (its files are the daemon's).
  absl::StatusOr<std::string> SubmitJob(const v1::DetachedJobSpec& spec) const;
  absl::StatusOr<v1::DetachedStatus> DetachedJobStatus(const std::string& job_id) const;
  // Every detached job the daemon knows (ListDetachedJobs' order: running, queued, ended).
  absl::StatusOr<std::vector<v1::DetachedStatus>> ListDetachedJobs() const;
  // Calls `line` for each log line numbered above `after_seq`; with `follow`, until the job
  // ends, or `stop` (polled every 100 ms from another thread; may be null) says so. Not bounded
  // by the RPC timeout.
  absl::Status DetachedJobLogs(const std::string& job_id, int64_t after_seq, bool follow,
                               const std::function<void(const v1::DetachedLogLine&)>& line,
                               const std::function<bool()>& stop = nullptr) const;
  absl::Status CancelJob(const std::string& job_id) const;
  // Sends the file at `local_path` to the daemon (UploadFile), for a job to be submitted;
  // returns its path there. Not bounded by the RPC timeout (a dataset may be large). An error
  // reading the file names it.
  absl::StatusOr<std::string> UploadFile(const std::string& local_path) const;

 private:
  void Prepare(grpc::ClientContext* context) const;
  // This thread's client id on this Client and its next sequence number.
  v1::CallId NextCallId() const;
  // Runs `attempt` (one call of the RPC `rpc`, its request holding a fixed CallId) with a fresh,
  // Prepare'd context per attempt until the daemon answers, retrying a lost answer as the
  // header describes. OK, or the failure Convert'ed (after retries: saying how many).
  absl::Status CallOnce(absl::string_view rpc,
                        const std::function<grpc::Status(grpc::ClientContext*)>& attempt) const;
  // FromGrpcStatus, naming the daemon's address when it cannot be reached.
  absl::Status Convert(absl::string_view rpc, const grpc::Status& status) const;
  // The tensors a StateDictChunk stream carries, by name; with `keyed` (optimizer state) by
  // "param[key]" (no parameter name holds a '['). Errors name `rpc`.
  absl::StatusOr<NamedTensors> ReadStateStream(absl::string_view rpc,
                                               grpc::ClientContext* context,
                                               grpc::ClientReader<v1::StateDictChunk>* reader,
                                               bool keyed) const;

  std::string address_;
  std::vector<std::string> addresses_;  // address_ first
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TrainingService::Stub> stub_;

  struct CallSequence {
    std::string client_id;  // empty until the thread's first mutating call
    uint64_t seq = 0;       // the last sequence number sent
  };
  mutable std::mutex calls_mu_;
  mutable std::map<std::thread::id, CallSequence> calls_;  // guarded by calls_mu_
};

// Keeps a leased job (JobOptions.lease_ms) alive while it lives: renews the lease every fifth of
// `lease` from a thread of its own, so a long pause between calls (or one long call) does not
// let the daemon delete the job; once the keeper (or the whole process) is gone, the daemon
// deletes the job when its lease runs out. Must not outlive `client`.
//
//   config.options.set_lease_ms(300000);
//   absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(model, config);
//   rannc::LeaseKeeper keeper(client, job->job_id(), absl::Minutes(5));
class LeaseKeeper {
 public:
  LeaseKeeper(const Client& client, std::string job_id, absl::Duration lease);
  ~LeaseKeeper();

  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

 private:
  // One renewal; the Periodic's thread only.
  void Renew();

  const Client& client_;
  const std::string job_id_;
  bool gone_ = false;                  // the daemon no longer knows the job; renewer_'s thread
  std::unique_ptr<Periodic> renewer_;  // last: stops first
};

// Maps a gRPC status to an absl::Status with the same code, "RPC: message" as the message.
absl::Status FromGrpcStatus(absl::string_view rpc, const grpc::Status& status);

}  // namespace rannc

#endif  // RANNC_CLIENT_RANNC_CLIENT_H_
