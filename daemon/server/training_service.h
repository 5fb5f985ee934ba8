// rannc.v1.TrainingService over gRPC. Translation only: protos in, JobManager/Job calls, protos
// out, absl::Status -> grpc::Status at the boundary (STYLE.md habit 5). Every decision lives in
// Job and JobManager, which are tested without a server.
//
// Thread-safety: gRPC calls the methods from its thread pool; the service holds no mutable
// state of its own beyond the bound address. The JobManager must outlive the service.
#ifndef RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_
#define RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/comm/factory.h"
#include "daemon/common/shm_transfer.h"
#include "daemon/planner/cost_table.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/server/job_manager.h"
#include "rannc/v1/training.grpc.pb.h"

namespace rannc {
namespace cluster {
class Cluster;
}  // namespace cluster

// What GetInfo reports; fixed for the daemon's lifetime.
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

grpc::Status ToGrpcStatus(const absl::Status& status);

// The backend a job's devices talk over: NCCL between GPUs (`cuda`) where the build has it;
// otherwise, and when any of the daemon's `devices` shares its GPU (which NCCL refuses), UCX,
// through host memory for CUDA buffers.
comm::Backend JobBackend(bool cuda, const std::vector<DaemonFacts::Device>& devices);
// The same for a job placed on `placement` (JobConfig::placement): cuda when any device is.
comm::Backend JobBackend(const std::vector<c10::Device>& placement,
                         const std::vector<DaemonFacts::Device>& devices);

// Where the engine runs each of a plan's `num_devices` devices: the daemon's k-th device of
// `devices` (a GPU, or the CPU) is plan device local[k], or k when `local` is empty (the daemon's
// own plan); other daemons' devices are the CPU here (not run by this daemon).
std::vector<c10::Device> Placement(const std::vector<DaemonFacts::Device>& devices,
                                   int num_devices, const std::vector<int>& local);

// The job config CreateJob makes of a client's JobSpec on a daemon with `facts`, before a dry
// run, a part of a cluster job or a cluster's devices change it; the backend is not set
// (JobBackend). benchmarks/job_bench.cc builds its in-process job with it.
absl::StatusOr<JobConfig> JobConfigFromSpec(const v1::JobSpec& spec, const DaemonFacts& facts);

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
  // (JobOptions.lease_ms); the destructor stops it.
  TrainingServiceImpl(DaemonFacts facts, JobManager* jobs);
  ~TrainingServiceImpl() override;

  // The bound address is known only once the server runs (--listen may ask for port 0).
  void set_address(std::string address);
  // Likewise the cluster, which needs that address. GetInfo lists its members once set; the
  // cluster must outlive the service.
  void set_cluster(const cluster::Cluster* cluster);
  // The store this daemon serves (not owned): the rendezvous of jobs it leads over the cluster.
  void set_store(comm::Store* store) { store_ = store; }

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
  grpc::Status SetMode(grpc::ServerContext*, const v1::SetModeRequest*,
                       v1::SetModeResponse*) override;
  grpc::Status Undeploy(grpc::ServerContext*, const v1::JobRef*, v1::Empty*) override;
  grpc::Status RecreateCommunicators(grpc::ServerContext*, const v1::JobRef*,
                                     v1::Empty*) override;
  grpc::Status AbortStep(grpc::ServerContext*, const v1::JobRef*, v1::Empty*) override;

 private:
  // The work of Backward, Step and ZeroGrad, shared with deferred ops (ForwardRequest.before,
  // Flush).
  // `client_rank`: the caller's (JobOptions.client_world).
  absl::Status DoBackward(Job& job, const v1::BackwardRequest& request, int client_rank) const;
  absl::Status DoStep(Job& job, const v1::StepRequest& request, int client_rank) const;
  absl::Status DoZeroGrad(Job& job, const v1::ZeroGradRequest& request, int client_rank) const;
  absl::Status RunDeferred(Job& job, const google::protobuf::RepeatedPtrField<v1::DeferredOp>& ops,
                           int client_rank) const;

  // With a cluster of several daemons, a job runs on all of them: numbers the cluster's devices
  // and fills `config`'s part of the job this daemon leads (docs/cluster.md).
  absl::Status SpanCluster(const std::string& job_id, const v1::JobSpec& spec,
                           JobConfig* config) const;

  // The cluster's other daemons that are UP (none without a cluster), and a cached stub to one.
  // JoinJob asks them for a job it does not have; ClientBarrier meets at the coordinator.
  std::vector<std::string> OtherMembers() const;
  std::string Coordinator() const;  // the rank-0 member's address; empty without a cluster
  v1::TrainingService::Stub* PeerStub(const std::string& address) const;

  // Encodes `tensors` into `out`, into the client's reply region when it offered one.
  absl::Status EncodeReply(const std::vector<at::Tensor>& tensors, const v1::ShmRef& reply_shm,
                           google::protobuf::RepeatedPtrField<v1::Tensor>* out) const;

  const DaemonFacts facts_;
  const ShmDirectory shm_;
  JobManager* const jobs_;
  mutable std::mutex address_mu_;
  std::string address_;
  const cluster::Cluster* cluster_ = nullptr;  // guarded by address_mu_
  comm::Store* store_ = nullptr;
  // CreateJob's answers for jobs with several client ranks, which JoinJob gives the others.
  std::mutex joinable_mu_;
  std::map<std::string, v1::CreateJobResponse> joinable_;  // job id -> answer
  // pyrannc.barrier(): one rendezvous per name and client count.
  std::mutex barriers_mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<ClientRendezvous>> barriers_;
  mutable std::mutex peers_mu_;
  mutable std::map<std::string, std::unique_ptr<v1::TrainingService::Stub>> peers_;
  // The lease reaper (see the constructor).
  void ReapExpiredJobs();
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool stopping_ = false;  // guarded by reaper_mu_
  std::thread reaper_;     // last: starts once everything above is constructed
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_TRAINING_SERVICE_H_
