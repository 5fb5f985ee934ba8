// rannc.v1.JobPartService over gRPC: this daemon's parts of jobs that other daemons lead
// (job_part.proto). Translation only: protos in, Job calls on the part (a Job in the
// JobManager, made with PartSettings), protos out. The FakePartChannels of the C++ tests call the
// same Job methods directly.
//
// Thread-safety: gRPC calls the methods from its thread pool; the service holds no mutable state.
// The JobManager must outlive the service.
#ifndef RANNC_DAEMON_SERVER_JOB_PART_SERVICE_H_
#define RANNC_DAEMON_SERVER_JOB_PART_SERVICE_H_

#include "daemon/security/auth.h"
#include "daemon/server/job_manager.h"
#include "daemon/server/job_settings.h"
#include "rannc/v1/job_part.grpc.pb.h"

namespace rannc {

// Creates the part that `spec` and `part` describe from `model_bytes` in `jobs`, and returns its
// id: what CreatePart does, for the service and for tests' in-process daemons.
absl::StatusOr<std::string> CreatePartJob(const v1::JobSpec& spec, const v1::PartSpec& part,
                                          const std::string& model_bytes,
                                          const DaemonFacts& facts, JobManager* jobs,
                                          comm::Store* store = nullptr);

class JobPartServiceImpl final : public v1::JobPartService::Service {
 public:
  JobPartServiceImpl(const DaemonFacts& facts, JobManager* jobs) : facts_(facts), jobs_(jobs) {}
  // The cluster's shared rendezvous store (ranncd --cluster-store), which the parts' engines
  // meet their leader's in instead of the store the leader serves; set before serving.
  void set_store(comm::Store* store) { store_ = store; }
  // Tokens (security/auth.h; not owned): every call must come from another daemon (its
  // certificate, or the admin token). Unset: every call is allowed.
  void set_authorizer(const security::Authorizer* auth) { auth_ = auth; }

  grpc::Status CreatePart(grpc::ServerContext*, grpc::ServerReader<v1::CreatePartRequest>*,
                          v1::CreatePartResponse*) override;
  grpc::Status DeletePart(grpc::ServerContext*, const v1::PartRef*, v1::Empty*) override;
  grpc::Status Forward(grpc::ServerContext*, const v1::PartForwardRequest*,
                       v1::PartForwardResponse*) override;
  grpc::Status Backward(grpc::ServerContext*, const v1::PartBackwardRequest*,
                        v1::Empty*) override;
  grpc::Status Step(grpc::ServerContext*, const v1::PartStepRequest*, v1::Empty*) override;
  grpc::Status AllReduceGrads(grpc::ServerContext*, const v1::PartRef*, v1::Empty*) override;
  grpc::Status ZeroGrad(grpc::ServerContext*, const v1::PartZeroGradRequest*,
                        v1::Empty*) override;
  grpc::Status GradNorms(grpc::ServerContext*, const v1::GradNormsRequest*,
                         v1::GradNormsResponse*) override;
  grpc::Status ScaleGrads(grpc::ServerContext*, const v1::ScaleGradsRequest*,
                          v1::Empty*) override;
  grpc::Status GetTensor(grpc::ServerContext*, const v1::PartTensorRequest*,
                         v1::PartTensorResponse*) override;
  grpc::Status LoadState(grpc::ServerContext*, grpc::ServerReader<v1::LoadPartStateRequest>*,
                         v1::Empty*) override;
  grpc::Status OptimizerState(grpc::ServerContext*, const v1::PartRef*,
                              grpc::ServerWriter<v1::StateDictChunk>*) override;
  grpc::Status LoadOptimizerState(grpc::ServerContext*,
                                  grpc::ServerReader<v1::LoadPartOptimizerStateRequest>*,
                                  v1::Empty*) override;
  grpc::Status Undeploy(grpc::ServerContext*, const v1::PartRef*, v1::Empty*) override;
  grpc::Status RecreateCommunicators(grpc::ServerContext*, const v1::PartRef*,
                                     v1::Empty*) override;
  grpc::Status AbortStep(grpc::ServerContext*, const v1::PartRef*, v1::Empty*) override;
  grpc::Status FindJob(grpc::ServerContext*, const v1::FindJobRequest*, v1::Empty*) override;
  grpc::Status StartCheckpointShare(grpc::ServerContext*, const v1::PartCheckpointRequest*,
                                    v1::Empty*) override;
  grpc::Status CheckpointShare(grpc::ServerContext*, const v1::PartCheckpointRef*,
                               v1::CheckpointShare*) override;
  grpc::Status RestoreLossScaler(grpc::ServerContext*, const v1::PartLossScalerRequest*,
                                 v1::Empty*) override;

 private:
  grpc::Status RunOp(const char* rpc, const std::string& part_id, const JobOp& op,
                     NamedTensors* out = nullptr);

  const DaemonFacts facts_;
  JobManager* const jobs_;
  comm::Store* store_ = nullptr;
  const security::Authorizer* auth_ = nullptr;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_PART_SERVICE_H_
