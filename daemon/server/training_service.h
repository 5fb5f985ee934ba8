// rannc.v1.TrainingService over gRPC: what clients call. Translation only: protos in,
// JobManager/Job calls, protos out, absl::Status -> grpc::Status at the boundary (STYLE.md
// habit 5). Every decision lives in Job, JobManager and job_settings.h (job creation policy and
// placement), which are tested without a server. Daemons call each other through
// JobPartService (job_part_service.h), not here.
//
// Thread-safety: gRPC calls the methods from its thread pool; the service holds no mutable
// state of its own beyond the bound address. The JobManager must outlive the service.
#ifndef RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_
#define RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon/comm/factory.h"
#include "daemon/common/shm_transfer.h"
#include "daemon/planner/cost_table.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/cluster/membership.h"
#include "daemon/common/periodic.h"
#include "daemon/security/auth.h"
#include "daemon/server/call_ledger.h"
#include "daemon/server/detached_jobs.h"
#include "daemon/server/job_manager.h"
#include "daemon/server/job_records.h"
#include "daemon/server/job_registry.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/part_channel.h"
#include "daemon/server/uploads.h"
#include "rannc/v1/job_part.grpc.pb.h"
#include "rannc/v1/training.grpc.pb.h"

namespace rannc {
namespace cluster {
class Cluster;
class Election;
}  // namespace cluster

// Tensors of a request (example inputs, a forward's inputs), out of files under `shm` where
// they name one; errors name each as "`what` #i".
absl::StatusOr<std::vector<at::Tensor>> DecodeAll(
    const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors, const char* what,
    const ShmDirectory& shm);

// JobSpec.model_tensors, decoded on several threads (out of files under `shm` where they name
// one).
absl::StatusOr<SentTensors> DecodeModelTensors(
    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& tensors, const ShmDirectory& shm);

class TrainingServiceImpl final : public v1::TrainingService::Service {
 public:
  // Starts a thread that deletes, once a second, the jobs whose client lease ran out
  // (JobOptions.lease_ms); the destructor stops it. `parts` (not owned) creates the parts of
  // the jobs this daemon leads over a cluster.
  // `records` (not owned; may be disabled) keeps the durable jobs' records (--state-dir).
  TrainingServiceImpl(DaemonFacts facts, JobManager* jobs, PartChannels* parts,
                      JobRecords* records);
  ~TrainingServiceImpl() override;

  // The bound address is known only once the server runs (--listen may ask for port 0).
  void set_address(std::string address);
  // Resubmits the detached jobs a previous run of the daemon left unfinished (DetachedJobs);
  // once the server runs.
  void ResumeDetachedJobs() { detached_->ResubmitRecorded(); }
  // The daemon is stopping: DetachedJobs::Stop (running jobs checkpointed at their step).
  void StopDetachedJobs() { detached_->Stop(); }
  // `rannc submit`'s jobs waiting in the queue (the metrics endpoint's).
  size_t detached_queued() const { return detached_->Queued(); }
  // Likewise the cluster, which needs that address. GetInfo lists its members once set; the
  // cluster must outlive the service.
  void set_cluster(const cluster::Cluster* cluster);
  // The store this daemon serves (not owned): the rendezvous of jobs it leads over the cluster.
  void set_store(comm::Store* store) { store_ = store; }
  // --cluster-store: the cluster's job registry (not owned; outlives the service). Jobs that
  // checkpoint are registered there, and this daemon takes over those whose leader is lost.
  void set_registry(JobRegistry* registry);
  // --cluster-store: the cluster's coordinator election (not owned; outlives the service), which
  // replaces "rank 0 coordinates".
  void set_coordinator_election(const cluster::Election* election, std::string cluster_store);
  // Tokens (security/auth.h; not owned, outlives the service): every call is checked against
  // its rule. Unset, or without --auth-token-file, every call is allowed.
  void set_authorizer(security::Authorizer* auth) { auth_ = auth; }
  // --upload-ttl: an uploaded file no detached job names is removed once it has not been
  // written for this long (checked by the reaper, at most every ttl / 4 and at least every
  // minute). Default 1 h.
  void set_upload_ttl(std::chrono::milliseconds ttl) { upload_ttl_ = ttl; }
  // --queue-aging (DetachedJobs::set_queue_aging).
  void set_queue_aging(std::chrono::milliseconds aging) { detached_->set_queue_aging(aging); }
  // A registered job led here lost a daemon it ran on (Cluster::OnMemberDown): it is brought
  // back from its latest checkpoint over the members that are UP, under a new id (its client
  // follows it with LocateJob), on a thread of its own. Nothing for a job not registered.
  void Recover(const std::string& job_id);

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                       v1::DaemonInfo*) override;
  grpc::Status CreateJob(grpc::ServerContext*, grpc::ServerReader<v1::CreateJobRequest>*,
                         v1::CreateJobResponse*) override;
  grpc::Status AddMode(grpc::ServerContext*, grpc::ServerReader<v1::AddModeRequest>*,
                       v1::AddModeResponse*) override;
  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest*,
                       v1::CreateJobResponse*) override;
  grpc::Status ClientBarrier(grpc::ServerContext*, const v1::ClientBarrierRequest*,
                             v1::Empty*) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::JobRef*, v1::Empty*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::Empty*, v1::ListJobsResponse*) override;
  grpc::Status RenewLeases(grpc::ServerContext*, const v1::RenewLeasesRequest*,
                           v1::RenewLeasesResponse*) override;
  grpc::Status Forward(grpc::ServerContext*, const v1::ForwardRequest*,
                       v1::ForwardResponse*) override;
  grpc::Status Backward(grpc::ServerContext*, const v1::BackwardRequest*, v1::Empty*) override;
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*, v1::Empty*) override;
  grpc::Status ZeroGrad(grpc::ServerContext*, const v1::ZeroGradRequest*, v1::Empty*) override;
  grpc::Status ClipGradNorm(grpc::ServerContext*, const v1::ClipGradNormRequest*,
                            v1::ClipGradNormResponse*) override;
  grpc::Status AllReduceGrads(grpc::ServerContext*, const v1::AllReduceGradsRequest*,
                              v1::Empty*) override;
  grpc::Status Flush(grpc::ServerContext*, const v1::FlushRequest*, v1::Empty*) override;
  grpc::Status GetParam(grpc::ServerContext*, const v1::GetParamRequest*,
                        v1::GetParamResponse*) override;
  grpc::Status StateDict(grpc::ServerContext*, const v1::StateDictRequest*,
                         grpc::ServerWriter<v1::StateDictChunk>*) override;
  grpc::Status LoadStateDict(grpc::ServerContext*, grpc::ServerReader<v1::LoadStateDictRequest>*,
                             v1::LoadStateDictResponse*) override;
  grpc::Status OptimizerState(grpc::ServerContext*, const v1::JobRef*,
                              grpc::ServerWriter<v1::StateDictChunk>*) override;
  grpc::Status LoadOptimizerState(grpc::ServerContext*,
                                  grpc::ServerReader<v1::LoadStateDictRequest>*,
                                  v1::LoadStateDictResponse*) override;
  grpc::Status SetMode(grpc::ServerContext*, const v1::SetModeRequest*,
                       v1::SetModeResponse*) override;
  grpc::Status Undeploy(grpc::ServerContext*, const v1::JobRef*, v1::Empty*) override;
  grpc::Status RecreateCommunicators(grpc::ServerContext*, const v1::JobRef*,
                                     v1::Empty*) override;
  grpc::Status ResumeJob(grpc::ServerContext*, const v1::JobRef*,
                         v1::CreateJobResponse*) override;
  grpc::Status LocateJob(grpc::ServerContext*, const v1::LocateJobRequest*,
                         v1::RegisteredJob*) override;
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest*,
                          v1::CheckpointInfo*) override;
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::CheckpointsRef*,
                               v1::ListCheckpointsResponse*) override;
  grpc::Status ExportCheckpoint(grpc::ServerContext*, const v1::CheckpointsRef*,
                                grpc::ServerWriter<v1::ExportChunk>*) override;
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::DetachedJobSpec*,
                         v1::SubmitJobResponse*) override;
  grpc::Status UploadFile(grpc::ServerContext*, grpc::ServerReader<v1::UploadChunk>*,
                          v1::UploadedFile*) override;
  grpc::Status DetachedJobStatus(grpc::ServerContext*, const v1::JobRef*,
                                 v1::DetachedStatus*) override;
  grpc::Status ListDetachedJobs(grpc::ServerContext*, const v1::Empty*,
                                v1::ListDetachedJobsResponse*) override;
  grpc::Status DetachedJobLogs(grpc::ServerContext*, const v1::DetachedLogsRequest*,
                               grpc::ServerWriter<v1::DetachedLogLine>*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::JobRef*, v1::Empty*) override;

 private:
  // The work of Backward, Step and ZeroGrad, shared with deferred ops (ForwardRequest.before,
  // Flush).
  // `client_rank`: the caller's (JobOptions.client_world).
  absl::Status DoBackward(Job& job, const v1::BackwardRequest& request, int client_rank) const;
  absl::Status DoStep(Job& job, const v1::StepRequest& request, int client_rank) const;
  absl::Status DoZeroGrad(Job& job, const v1::ZeroGradRequest& request, int client_rank) const;
  absl::Status RunDeferred(Job& job, const google::protobuf::RepeatedPtrField<v1::DeferredOp>& ops,
                           int client_rank) const;

  // The cluster's members (none without one), the other daemons that are UP, and cached stubs.
  // JoinJob asks the others for a job it does not have (JobPartService.FindJob); ClientBarrier
  // meets at the coordinator.
  std::vector<cluster::MemberInfo> Members() const;
  std::vector<std::string> OtherMembers() const;
  // Whether the caller may make the call `rpc` on the job `job_id` (or of the name `job_name`):
  // OK, or the status to return, logged without the token (security/auth.h).
  grpc::Status Authorize(const grpc::ServerContext& context, const char* rpc,
                         const std::string& job_id = "", const std::string& job_name = "") const;
  // In two halves, for a stream whose first message names its job: Authenticate before reading
  // it (UNAUTHENTICATED without a valid token), Authorize after.
  security::Caller Authenticate(const grpc::ServerContext& context, const char* rpc,
                                grpc::Status* denied) const;
  grpc::Status Authorize(const security::Caller& caller, const char* rpc,
                         const std::string& job_id, const std::string& job_name = "") const;

  // The coordinator's address: elected in etcd with --cluster-store, else the rank-0 member's;
  // "" for this daemon, and without a cluster. UNAVAILABLE while none is elected.
  absl::StatusOr<std::string> Coordinator() const;
  v1::TrainingService::Stub* PeerStub(const std::string& address) const;
  v1::JobPartService::Stub* PartStub(const std::string& address) const;

  // Runs a mutating call once per CallId (training.proto): a retry of the client's last call is
  // answered from ledger_ with the first attempt's status and `response`. `rpc` names it in
  // logs and for the tests' fault hook (RANNC_TEST_DROP_RESPONSES="Step:2,Forward:5": the 2nd
  // Step and 5th Forward that carry a CallId run, are recorded, and answer UNAVAILABLE, as if
  // the response were lost on the way; unset in use).
  // A replayed answer carries the trailing metadata "rannc-replayed: 1".
  grpc::Status Once(grpc::ServerContext* context, const char* rpc, const v1::CallId& call,
                    google::protobuf::Message* response, const std::function<grpc::Status()>& run);
  bool DropResponse(const char* rpc);

  // A job made from `spec` under `id` (over the cluster when there is one), added to jobs_, and
  // CreateJob's answer for it in `response`. `durable`: a job that checkpoints gets a record
  // (a detached job keeps its own).
  absl::StatusOr<std::shared_ptr<Job>> StartJob(const std::string& id, const v1::JobSpec& spec,
                                                JobSettings settings, const std::string& model,
                                                const std::vector<at::Tensor>& examples,
                                                const SentTensors& sent,
                                                v1::CreateJobResponse* response,
                                                bool durable = true);
  // Durable jobs: the suspended record a new job of `spec`'s name attaches to (the same name
  // and checkpoint directory, no live job), if any.
  std::optional<v1::JobRecord> SuspendedFor(const v1::JobSpec& spec) const;
  // At a lease's end: a durable job writes a last checkpoint and is kept as suspended.
  bool Suspend(Job& job);

  // The cluster's registry (--cluster-store; job_registry.h). A job that checkpoints is
  // registered: this daemon leads its name before it is created (Lead), then writes its record
  // into its checkpoint directory, which every daemon reads, and publishes its entry
  // (Register). A job whose leader is lost is brought back here from its record and latest
  // checkpoint, under a new id, if this daemon wins the race for it (TakeOver). A job deleted
  // or expired leaves the registry (Unregister).
  bool Registers(const v1::JobSpec& spec, const JobSettings& settings) const;
  void Fence(JobSettings* settings) const;  // the fence and step log of a registered job
  absl::Status Register(const Job& job, const v1::JobSpec& spec, const std::string& model,
                        const std::vector<at::Tensor>& examples, const SentTensors& sent);
  void TakeOver(const std::string& name);
  // A job made again from a durable record (`loaded`, with the spec `spec`) under `id`,
  // resumed from its latest checkpoint; `fenced`: a registered job's (Fence). ResumeJob's and
  // Restart's.
  absl::StatusOr<std::shared_ptr<Job>> StartResumed(const std::string& id,
                                                    const JobRecords::Loaded& loaded,
                                                    v1::JobSpec spec, bool fenced,
                                                    v1::CreateJobResponse* response);
  // A job that will not run after all (or runs on under another id): it and its record go.
  void Discard(const std::string& job_id);
  // `job`'s id, resumed step and devices, into its registry entry.
  static void Describe(const Job& job, v1::RegisteredJob* entry);
  // Brings `entry`'s job back here from its record and latest checkpoint under a new id and
  // publishes it (TakeOver and Recover); `lost_leader`: an address to wait to see DOWN first.
  absl::Status Restart(v1::RegisteredJob entry, const std::string& lost_leader,
                       const char* why);
  void Unregister(const std::string& job_id);
  JobRecords& SharedRecords(const std::string& job_dir);

  // The job directory a CheckpointsRef names: a live job's, or a name under a directory.
  absl::StatusOr<std::string> CheckpointsOf(const v1::CheckpointsRef& ref,
                                            std::shared_ptr<Job>* job) const;
  // Encodes `tensors` into `out`, into the client's reply region when it offered one.
  absl::Status EncodeReply(const std::vector<at::Tensor>& tensors, const v1::ShmRef& reply_shm,
                           google::protobuf::RepeatedPtrField<v1::Tensor>* out) const;

  const DaemonFacts facts_;
  const ShmDirectory shm_;
  JobManager* const jobs_;
  PartChannels* const parts_;
  JobRecords* const records_;
  mutable std::mutex address_mu_;
  std::string address_;
  const cluster::Cluster* cluster_ = nullptr;  // guarded by address_mu_
  const cluster::Election* coordinator_election_ = nullptr;  // guarded by address_mu_
  std::string cluster_store_;                                // guarded by address_mu_
  comm::Store* store_ = nullptr;
  // pyrannc.barrier(): one rendezvous per name and client count.
  std::mutex barriers_mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<ClientRendezvous>> barriers_;
  mutable std::mutex peers_mu_;
  mutable std::map<std::string, std::unique_ptr<v1::TrainingService::Stub>> peers_;
  mutable std::map<std::string, std::unique_ptr<v1::JobPartService::Stub>> part_stubs_;
  JobRegistry* registry_ = nullptr;
  security::Authorizer* auth_ = nullptr;
  std::mutex shared_mu_;
  std::map<std::string, std::unique_ptr<JobRecords>> shared_records_;  // by checkpoint job dir
  std::map<std::string, std::chrono::steady_clock::time_point> takeover_after_;  // retry backoff
  std::set<std::string> recovering_;    // job ids being recovered, under shared_mu_
  std::vector<std::thread> recoveries_;  // joined by the destructor
  CallLedger ledger_;
  std::mutex drop_mu_;
  std::map<std::string, std::set<int>> drop_;  // the fault hook's: rpc -> ordinals to drop
  std::map<std::string, int> calls_;           // calls with a CallId so far, per rpc
  std::unique_ptr<Uploads> uploads_;        // UploadFile's files (before detached_: it uses them)
  std::unique_ptr<DetachedJobs> detached_;  // `rannc submit`'s jobs
  std::atomic<std::chrono::milliseconds> upload_ttl_{std::chrono::hours(1)};
  std::chrono::steady_clock::time_point uploads_swept_;  // the reaper's
  // The lease reaper (see the constructor): one round of it.
  void ReapExpiredJobs();
  // The reaper's too, when due: Uploads::RemoveUnused of what no detached job names.
  void RemoveUnusedUploads();
  // What this daemon's devices have free: their memory less the live jobs' plans' estimates.
  std::vector<uint64_t> FreeBytes() const;
  // Why a plan needing `need` bytes per device does not fit FreeBytes() now ("" if it fits).
  std::string ShortOf(const std::vector<uint64_t>& need) const;
  // Admission of a client's job (CreateJob): with other jobs on this daemon (and not in a
  // cluster), the job is planned first and waits, at most its config key admission_wait, until
  // its plan fits what they leave; it then starts with that plan (`settings`' load_deployment).
  // RESOURCE_EXHAUSTED naming the device and the bytes when the wait ends first.
  absl::Status Admit(const std::string& model, const std::vector<at::Tensor>& examples,
                     const SentTensors& sent, JobSettings* settings);
  Periodic reaper_;  // last: starts once everything above is constructed, stops first
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_
