#include "daemon/server/job_part_service.h"

#include <spdlog/spdlog.h>

#include "daemon/common/tensor_codec.h"
#include "daemon/server/optimizer_state_codec.h"
#include "daemon/server/rpc_status.h"

namespace rannc {
namespace {

constexpr size_t kChunkBytes = 4 << 20;

}  // namespace

absl::StatusOr<std::string> CreatePartJob(const v1::JobSpec& spec, const v1::PartSpec& part,
                                          const std::string& model_bytes,
                                          const DaemonFacts& facts, JobManager* jobs,
                                          comm::Store* store) {
  absl::StatusOr<JobSettings> settings = PartSettings(spec, part, facts);
  if (!settings.ok()) return settings.status();
  if (store != nullptr) settings->engine_store = store;
  std::vector<at::Tensor> examples;
  for (int i = 0; i < spec.example_inputs_size(); ++i) {
    absl::StatusOr<at::Tensor> t = DecodeTensor(spec.example_inputs(i), "example input");
    if (!t.ok()) return t.status();
    examples.push_back(std::move(*t));
  }
  const std::string id = jobs->NewJobId();
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create(id, std::move(*settings), model_bytes, examples);
  if (!job.ok()) return job.status();
  spdlog::info("created part {} of a job led by {} ('{}')", id, part.store_address(),
               spec.name());
  jobs->Add(JobManager::Share(std::move(*job)));
  return id;
}

grpc::Status JobPartServiceImpl::CreatePart(grpc::ServerContext* context,
                                            grpc::ServerReader<v1::CreatePartRequest>* reader,
                                            v1::CreatePartResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/CreatePart");
  if (!denied.ok()) return denied;
  v1::CreatePartRequest request;
  if (!reader->Read(&request) || !request.has_header()) {
    return FailRpc("CreatePart", absl::InvalidArgumentError(
        "CreatePart must start with a header, then the model's bytes"));
  }
  const v1::CreatePartRequest::Header header = request.header();
  std::string model;
  model.reserve(std::min<uint64_t>(header.spec().model_bytes(), uint64_t{1} << 30));
  while (reader->Read(&request)) model += request.model_chunk();
  absl::StatusOr<std::string> id =
      CreatePartJob(header.spec(), header.part(), model, facts_, jobs_, store_);
  if (!id.ok()) return FailRpc("CreatePart", id.status());
  response->set_part_id(*id);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::DeletePart(grpc::ServerContext* context, const v1::PartRef* ref,
                                            v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/DeletePart");
  if (!denied.ok()) return denied;
  absl::Status status = jobs_->Remove(ref->part_id());
  if (!status.ok()) return FailRpc("DeletePart", status);
  spdlog::info("deleted part {}", ref->part_id());
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::Forward(grpc::ServerContext* context,
                                         const v1::PartForwardRequest* request,
                                         v1::PartForwardResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/Forward");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part Forward", job.status());
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < request->inputs_size(); ++i) {
    absl::StatusOr<at::Tensor> t = DecodeTensor(request->inputs(i), "input");
    if (!t.ok()) return FailRpc("part Forward", t.status());
    inputs.push_back(std::move(*t));
  }
  absl::StatusOr<std::vector<at::Tensor>> outputs = (*job)->Forward(
      0, inputs, request->requires_grad(), request->delay_grad_allreduce());
  if (!outputs.ok()) return FailRpc("part Forward", outputs.status());
  for (const at::Tensor& t : *outputs) {
    absl::Status encoded = EncodeTensor(t, response->add_outputs());
    if (!encoded.ok()) return FailRpc("part Forward", encoded);
  }
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::Backward(grpc::ServerContext* context,
                                          const v1::PartBackwardRequest* request, v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/Backward");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part Backward", job.status());
  OutputGrads grads;
  for (const v1::OutputGrad& g : request->grads()) {
    absl::StatusOr<at::Tensor> t = DecodeTensor(g.grad(), "an output's gradient");
    if (!t.ok()) return FailRpc("part Backward", t.status());
    grads.emplace_back(g.output_index(), std::move(*t));
  }
  absl::Status status = (*job)->Backward(0, grads, request->retain_graph(),
                                         request->delay_grad_allreduce());
  if (!status.ok()) return FailRpc("part Backward", status);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::RunOp(const char* rpc, const std::string& part_id,
                                       const JobOp& op, NamedTensors* out) {
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(part_id);
  if (!job.ok()) return FailRpc(rpc, job.status());
  absl::StatusOr<NamedTensors> ran = (*job)->Run(0, op);
  if (!ran.ok()) return FailRpc(rpc, ran.status());
  if (out != nullptr) *out = std::move(*ran);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::Step(grpc::ServerContext* context,
                                      const v1::PartStepRequest* request,
                                      v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/Step");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part Step", job.status());
  JobOp op;
  op.kind = JobOp::Kind::kStep;
  for (const v1::HyperParams& h : request->groups()) {
    op.hypers.push_back(FromProto(h, (*job)->optimizer_kind()));
  }
  return RunOp("part Step", request->part_id(), op);
}

grpc::Status JobPartServiceImpl::AllReduceGrads(grpc::ServerContext* context,
                                                const v1::PartRef* ref,
                                                v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/AllReduceGrads");
  if (!denied.ok()) return denied;
  JobOp op;
  op.kind = JobOp::Kind::kAllReduceGrads;
  return RunOp("part AllReduceGrads", ref->part_id(), op);
}

grpc::Status JobPartServiceImpl::ZeroGrad(grpc::ServerContext* context,
                                          const v1::PartZeroGradRequest* request, v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/ZeroGrad");
  if (!denied.ok()) return denied;
  JobOp op;
  op.kind = JobOp::Kind::kZeroGrad;
  op.set_to_none = request->set_to_none();
  return RunOp("part ZeroGrad", request->part_id(), op);
}

grpc::Status JobPartServiceImpl::RecreateCommunicators(grpc::ServerContext* context,
                                                       const v1::PartRef* ref, v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/RecreateCommunicators");
  if (!denied.ok()) return denied;
  JobOp op;
  op.kind = JobOp::Kind::kRecreateCommunicators;
  return RunOp("part RecreateCommunicators", ref->part_id(), op);
}

grpc::Status JobPartServiceImpl::GradNorms(grpc::ServerContext* context,
                                           const v1::GradNormsRequest* request,
                                           v1::GradNormsResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/GradNorms");
  if (!denied.ok()) return denied;
  JobOp op;
  op.kind = JobOp::Kind::kGradNorms;
  op.norm_type = request->norm_type();
  NamedTensors norms;
  grpc::Status status = RunOp("part GradNorms", request->part_id(), op, &norms);
  if (!status.ok()) return status;
  for (const auto& [name, norm] : norms) {
    response->add_names(name);
    absl::Status encoded = EncodeTensor(norm, response->add_norms());
    if (!encoded.ok()) return FailRpc("part GradNorms", encoded);
  }
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::ScaleGrads(grpc::ServerContext* context,
                                            const v1::ScaleGradsRequest* request, v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/ScaleGrads");
  if (!denied.ok()) return denied;
  absl::StatusOr<at::Tensor> coefficient =
      DecodeTensor(request->coefficient(), "clip coefficient");
  if (!coefficient.ok()) return FailRpc("part ScaleGrads", coefficient.status());
  JobOp op;
  op.kind = JobOp::Kind::kScaleGrads;
  op.coefficient = *coefficient;
  return RunOp("part ScaleGrads", request->part_id(), op);
}

grpc::Status JobPartServiceImpl::GetTensor(grpc::ServerContext* context,
                                           const v1::PartTensorRequest* request,
                                           v1::PartTensorResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/GetTensor");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part GetTensor", job.status());
  absl::StatusOr<std::optional<at::Tensor>> t =
      (*job)->GetTensor(request->name(), request->grad());
  if (!t.ok()) return ToGrpcStatus(t.status());  // NOT_FOUND is an answer here: held elsewhere
  response->set_has_value(t->has_value());
  if (t->has_value()) {
    absl::Status encoded = EncodeTensor(**t, response->mutable_tensor());
    if (!encoded.ok()) return FailRpc("part GetTensor", encoded);
  }
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::LoadState(grpc::ServerContext* context,
                                           grpc::ServerReader<v1::LoadPartStateRequest>* reader,
                                           v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/LoadState");
  if (!denied.ok()) return denied;
  v1::LoadPartStateRequest request;
  if (!reader->Read(&request) || request.part_id().empty()) {
    return FailRpc("part LoadState", absl::InvalidArgumentError(
        "LoadState must start with the part's id, then the chunks"));
  }
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request.part_id());
  if (!job.ok()) return FailRpc("part LoadState", job.status());
  StateDictAssembler assembler;
  absl::Status status;
  while (reader->Read(&request)) {
    if (status.ok()) status = assembler.Add(request.chunk());  // drain the stream either way
  }
  if (!status.ok()) return FailRpc("part LoadState", status);
  absl::StatusOr<std::map<std::string, at::Tensor>> state = assembler.Finish();
  if (!state.ok()) return FailRpc("part LoadState", state.status());
  std::vector<std::string> missing, unexpected;
  status = (*job)->LoadStateDict(*state, /*strict=*/false, &missing, &unexpected);
  if (!status.ok()) return FailRpc("part LoadState", status);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::OptimizerState(grpc::ServerContext* context,
                                                const v1::PartRef* ref,
                                                grpc::ServerWriter<v1::StateDictChunk>* writer) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/OptimizerState");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->part_id());
  if (!job.ok()) return FailRpc("part OptimizerState", job.status());
  absl::StatusOr<std::vector<OptimizerEntry>> state = (*job)->OptimizerState();
  if (!state.ok()) return FailRpc("part OptimizerState", state.status());
  absl::Status written = EncodeOptimizerState(
      *state, kChunkBytes, [&](const v1::StateDictChunk& c) { return writer->Write(c); });
  if (!written.ok()) return FailRpc("part OptimizerState", written);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::LoadOptimizerState(
    grpc::ServerContext* context, grpc::ServerReader<v1::LoadPartOptimizerStateRequest>* reader,
    v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/LoadOptimizerState");
  if (!denied.ok()) return denied;
  v1::LoadPartOptimizerStateRequest request;
  if (!reader->Read(&request) || request.part_id().empty()) {
    return FailRpc("part LoadOptimizerState", absl::InvalidArgumentError(
        "LoadOptimizerState must start with the part's id, then the chunks"));
  }
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request.part_id());
  if (!job.ok()) return FailRpc("part LoadOptimizerState", job.status());
  OptimizerStateAssembler assembler;
  absl::Status status;
  while (reader->Read(&request)) {
    if (status.ok()) status = assembler.Add(std::move(*request.mutable_chunk()));  // drain
  }
  absl::StatusOr<std::vector<OptimizerEntry>> state =
      status.ok() ? assembler.Finish() : absl::StatusOr<std::vector<OptimizerEntry>>(status);
  if (state.ok()) status = (*job)->LoadOptimizerState(*state);
  if (!state.ok()) status = state.status();
  if (!status.ok()) return FailRpc("part LoadOptimizerState", status);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::Undeploy(grpc::ServerContext* context, const v1::PartRef* ref,
                                          v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/Undeploy");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->part_id());
  if (!job.ok()) return FailRpc("part Undeploy", job.status());
  (*job)->Undeploy();
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::StartCheckpointShare(grpc::ServerContext* context,
                                                      const v1::PartCheckpointRequest* request,
                                                      v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/StartCheckpointShare");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part StartCheckpointShare", job.status());
  absl::Status started = (*job)->StartCheckpointShare(request->directory(),
                                                      request->file_prefix(), request->step());
  if (!started.ok()) return FailRpc("part StartCheckpointShare", started);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::CheckpointShare(grpc::ServerContext* context,
                                                 const v1::PartCheckpointRef* ref,
                                                 v1::CheckpointShare* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/CheckpointShare");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->part_id());
  if (!job.ok()) return FailRpc("part CheckpointShare", job.status());
  absl::StatusOr<v1::CheckpointShare> share = (*job)->CheckpointShare(ref->step());
  if (!share.ok()) return FailRpc("part CheckpointShare", share.status());
  *response = std::move(*share);
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::RestoreLossScaler(grpc::ServerContext* context,
                                                   const v1::PartLossScalerRequest* request,
                                                   v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/RestoreLossScaler");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(request->part_id());
  if (!job.ok()) return FailRpc("part RestoreLossScaler", job.status());
  (*job)->RestoreLossScaler(request->scale(), static_cast<int>(request->good_steps()),
                            static_cast<int>(request->skipped_steps()));
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::AbortStep(grpc::ServerContext* context, const v1::PartRef* ref,
                                           v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/AbortStep");
  if (!denied.ok()) return denied;
  absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Get(ref->part_id());
  if (!job.ok()) return FailRpc("part AbortStep", job.status());
  (*job)->coordinator().AbortStep();
  return grpc::Status::OK;
}

grpc::Status JobPartServiceImpl::FindJob(grpc::ServerContext* context,
                                         const v1::FindJobRequest* request,
                                         v1::Empty*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.JobPartService/FindJob");
  if (!denied.ok()) return denied;
  if (jobs_->FindJoinable(request->name(), static_cast<int>(request->client_world()))) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such job here");
}

}  // namespace rannc
