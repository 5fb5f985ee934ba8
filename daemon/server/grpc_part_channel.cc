#include "daemon/server/grpc_part_channel.h"

#include <chrono>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/security/auth.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/optimizer_state_codec.h"

namespace rannc {
namespace {

// Reads and writes that take longer than this find the member lost by heartbeats first
// (Coordinator::OnParts cancels them); the deadline only bounds a call nobody cancels.
constexpr std::chrono::minutes kCallDeadline(30);
// A part's write of its share of a checkpoint (hundreds of GB, on slow shared storage).
constexpr std::chrono::hours kWriteDeadline(6);
constexpr size_t kChunkBytes = 4 << 20;

class GrpcPartChannel final : public PartChannel {
 public:
  GrpcPartChannel(std::string address, std::string part_id,
                  std::shared_ptr<v1::JobPartService::Stub> stub)
      : PartChannel(std::move(address)), part_id_(std::move(part_id)), stub_(std::move(stub)) {}

  absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad,
                                                  bool delay_grad_allreduce) override {
    v1::PartForwardRequest request;
    request.set_part_id(part_id_);
    request.set_requires_grad(requires_grad);
    request.set_delay_grad_allreduce(delay_grad_allreduce);
    for (const at::Tensor& t : inputs) {
      absl::Status encoded = EncodeTensor(t, request.add_inputs(), nullptr);
      if (!encoded.ok()) return encoded;
    }
    v1::PartForwardResponse response;
    absl::Status s = Call([&](grpc::ClientContext* c) {
      return stub_->Forward(c, request, &response);
    });
    if (!s.ok()) return s;
    std::vector<at::Tensor> out;
    for (const v1::Tensor& t : response.outputs()) {
      absl::StatusOr<at::Tensor> decoded = DecodeTensor(t, "a part's output", nullptr);
      if (!decoded.ok()) return decoded.status();
      out.push_back(std::move(*decoded));
    }
    return out;
  }

  absl::Status Backward(const OutputGrads& grads, bool retain_graph,
                        bool delay_grad_allreduce) override {
    v1::PartBackwardRequest request;
    request.set_part_id(part_id_);
    request.set_retain_graph(retain_graph);
    request.set_delay_grad_allreduce(delay_grad_allreduce);
    for (const auto& [index, grad] : grads) {
      v1::OutputGrad* g = request.add_grads();
      g->set_output_index(static_cast<uint32_t>(index));
      absl::Status encoded = EncodeTensor(grad, g->mutable_grad(), nullptr);
      if (!encoded.ok()) return encoded;
    }
    v1::Empty empty;
    return Call([&](grpc::ClientContext* c) { return stub_->Backward(c, request, &empty); });
  }

  absl::StatusOr<NamedTensors> Run(const JobOp& op) override {
    v1::PartRef ref;
    ref.set_part_id(part_id_);
    v1::Empty empty;
    switch (op.kind) {
      case JobOp::Kind::kStep: {
        v1::PartStepRequest request;
        request.set_part_id(part_id_);
        for (const HyperParams& h : op.hypers) *request.add_groups() = ToProto(h);
        return Done(Call([&](grpc::ClientContext* c) { return stub_->Step(c, request, &empty); }));
      }
      case JobOp::Kind::kAllReduceGrads:
        return Done(Call([&](grpc::ClientContext* c) {
          return stub_->AllReduceGrads(c, ref, &empty);
        }));
      case JobOp::Kind::kZeroGrad: {
        v1::PartZeroGradRequest request;
        request.set_part_id(part_id_);
        request.set_set_to_none(op.set_to_none);
        return Done(
            Call([&](grpc::ClientContext* c) { return stub_->ZeroGrad(c, request, &empty); }));
      }
      case JobOp::Kind::kRecreateCommunicators:
        return Done(Call([&](grpc::ClientContext* c) {
          return stub_->RecreateCommunicators(c, ref, &empty);
        }));
      case JobOp::Kind::kGradNorms: {
        v1::GradNormsRequest request;
        request.set_part_id(part_id_);
        request.set_norm_type(op.norm_type);
        v1::GradNormsResponse response;
        absl::Status s =
            Call([&](grpc::ClientContext* c) { return stub_->GradNorms(c, request, &response); });
        if (!s.ok()) return s;
        if (response.norms_size() != response.names_size()) {
          return absl::InternalError(absl::StrCat("daemon ", address(), " sent malformed norms"));
        }
        NamedTensors norms;
        for (int i = 0; i < response.names_size(); ++i) {
          absl::StatusOr<at::Tensor> norm = DecodeTensor(response.norms(i), "a norm", nullptr);
          if (!norm.ok()) return norm.status();
          norms.emplace_back(response.names(i), std::move(*norm));
        }
        return norms;
      }
      case JobOp::Kind::kScaleGrads: {
        v1::ScaleGradsRequest request;
        request.set_part_id(part_id_);
        absl::Status encoded = EncodeTensor(op.coefficient, request.mutable_coefficient());
        if (!encoded.ok()) return encoded;
        return Done(
            Call([&](grpc::ClientContext* c) { return stub_->ScaleGrads(c, request, &empty); }));
      }
    }
    return absl::InvalidArgumentError("unknown job op");
  }

  absl::StatusOr<std::optional<at::Tensor>> GetTensor(const std::string& name,
                                                      bool grad) override {
    v1::PartTensorRequest request;
    request.set_part_id(part_id_);
    request.set_name(name);
    request.set_grad(grad);
    v1::PartTensorResponse response;
    absl::Status s =
        Call([&](grpc::ClientContext* c) { return stub_->GetTensor(c, request, &response); },
             std::chrono::seconds(60));
    if (!s.ok()) return s;
    if (!response.has_value()) return std::optional<at::Tensor>();
    absl::StatusOr<at::Tensor> t = DecodeTensor(response.tensor(), name, nullptr);
    if (!t.ok()) return t.status();
    return std::optional<at::Tensor>(std::move(*t));
  }

  absl::Status LoadState(const std::map<std::string, at::Tensor>& state) override {
    return Call([&](grpc::ClientContext* c) {
      v1::Empty empty;
      std::unique_ptr<grpc::ClientWriter<v1::LoadPartStateRequest>> writer =
          stub_->LoadState(c, &empty);
      v1::LoadPartStateRequest header;
      header.set_part_id(part_id_);
      bool ok = writer->Write(header);
      for (auto it = state.begin(); ok && it != state.end(); ++it) {
        ok = EncodeStateChunks(it->first, it->second, /*is_buffer=*/false, kChunkBytes,
                               [&](const v1::StateDictChunk& chunk) {
                                 v1::LoadPartStateRequest request;
                                 *request.mutable_chunk() = chunk;
                                 return writer->Write(request);
                               }).ok();
      }
      writer->WritesDone();
      return writer->Finish();
    });
  }

  absl::StatusOr<std::vector<OptimizerEntry>> OptimizerState() override {
    v1::PartRef ref;
    ref.set_part_id(part_id_);
    OptimizerStateAssembler assembler;
    absl::Status assembled;
    absl::Status s = Call([&](grpc::ClientContext* c) {
      std::unique_ptr<grpc::ClientReader<v1::StateDictChunk>> reader =
          stub_->OptimizerState(c, ref);
      v1::StateDictChunk chunk;
      while (reader->Read(&chunk)) {
        if (assembled.ok()) assembled = assembler.Add(chunk);
      }
      return reader->Finish();
    });
    if (!s.ok()) return s;
    if (!assembled.ok()) return assembled;
    return assembler.Finish();
  }

  absl::Status LoadOptimizerState(const std::vector<OptimizerEntry>& state) override {
    return Call([&](grpc::ClientContext* c) {
      v1::Empty empty;
      std::unique_ptr<grpc::ClientWriter<v1::LoadPartOptimizerStateRequest>> writer =
          stub_->LoadOptimizerState(c, &empty);
      v1::LoadPartOptimizerStateRequest header;
      header.set_part_id(part_id_);
      if (writer->Write(header)) {
        EncodeOptimizerState(state, kChunkBytes, [&](const v1::StateDictChunk& chunk) {
          v1::LoadPartOptimizerStateRequest request;
          *request.mutable_chunk() = chunk;
          return writer->Write(request);
        }).IgnoreError();  // a closed stream: Finish says why
      }
      writer->WritesDone();
      return writer->Finish();
    });
  }

  absl::Status StartCheckpointShare(const std::string& dir, const std::string& prefix,
                                    int64_t step) override {
    v1::PartCheckpointRequest request;
    request.set_part_id(part_id_);
    request.set_directory(dir);
    request.set_file_prefix(prefix);
    request.set_step(step);
    v1::Empty empty;
    return Call([&](grpc::ClientContext* c) {
      return stub_->StartCheckpointShare(c, request, &empty);
    });
  }

  absl::StatusOr<v1::CheckpointShare> CheckpointShare(int64_t step) override {
    v1::PartCheckpointRef ref;
    ref.set_part_id(part_id_);
    ref.set_step(step);
    v1::CheckpointShare share;
    absl::Status s = Call([&](grpc::ClientContext* c) {
      return stub_->CheckpointShare(c, ref, &share);
    }, kWriteDeadline);
    if (!s.ok()) return s;
    return share;
  }

  absl::Status RestoreLossScaler(double scale, int good_steps, int skipped_steps) override {
    v1::PartLossScalerRequest request;
    request.set_part_id(part_id_);
    request.set_scale(scale);
    request.set_good_steps(good_steps);
    request.set_skipped_steps(skipped_steps);
    v1::Empty empty;
    return Call([&](grpc::ClientContext* c) {
      return stub_->RestoreLossScaler(c, request, &empty);
    });
  }

  void Notify(PartNotice notice, std::chrono::milliseconds deadline) override {
    v1::PartRef ref;
    ref.set_part_id(part_id_);
    v1::Empty empty;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    switch (notice) {
      case PartNotice::kAbortStep: stub_->AbortStep(&context, ref, &empty).ok(); break;
      case PartNotice::kUndeploy: stub_->Undeploy(&context, ref, &empty).ok(); break;
      case PartNotice::kDelete: stub_->DeletePart(&context, ref, &empty).ok(); break;
    }
  }

  void CancelCalls() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (grpc::ClientContext* c : active_) c->TryCancel();
  }

 private:
  // One call with a context CancelCalls can reach; gRPC's status as the part's (UNAVAILABLE:
  // it could not be reached), naming the daemon.
  absl::Status Call(const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
                    std::chrono::seconds deadline = kCallDeadline) {
    // CheckpointShare comes from the checkpoint writer's thread while the job's calls run:
    // active_ is guarded, and gRPC's stubs are thread-safe.
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_.insert(&context);
    }
    const grpc::Status s = rpc(&context);
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_.erase(&context);
    }
    if (s.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("daemon ", address(), ": ", s.error_message()));
  }

  static absl::StatusOr<NamedTensors> Done(const absl::Status& s) {
    if (!s.ok()) return s;
    return NamedTensors();
  }

  const std::string part_id_;
  const std::shared_ptr<v1::JobPartService::Stub> stub_;
  std::mutex mu_;
  std::set<grpc::ClientContext*> active_;
};

}  // namespace

std::shared_ptr<v1::JobPartService::Stub> GrpcPartChannels::Stub(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<v1::JobPartService::Stub>& stub = stubs_[address];
  if (!stub) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub = v1::JobPartService::NewStub(
        security::PeerChannel(address, args));
  }
  return stub;
}

absl::StatusOr<std::unique_ptr<PartChannel>> GrpcPartChannels::CreatePart(
    const std::string& address, const v1::JobSpec& spec, const v1::PartSpec& part,
    const std::string& model_bytes) {
  std::shared_ptr<v1::JobPartService::Stub> stub = Stub(address);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  v1::CreatePartResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::CreatePartRequest>> writer =
      stub->CreatePart(&context, &response);
  v1::CreatePartRequest header;
  *header.mutable_header()->mutable_spec() = spec;
  *header.mutable_header()->mutable_part() = part;
  bool ok = writer->Write(header);
  constexpr size_t kModelChunk = 1 << 20;
  for (size_t off = 0; ok && off < model_bytes.size(); off += kModelChunk) {
    v1::CreatePartRequest chunk;
    chunk.set_model_chunk(model_bytes.substr(off, kModelChunk));
    ok = writer->Write(chunk);
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return std::unique_ptr<PartChannel>(
      new GrpcPartChannel(address, response.part_id(), std::move(stub)));
}

}  // namespace rannc
