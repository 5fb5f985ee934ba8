#include "client/rannc_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/periodic.h"
#include "daemon/security/auth.h"
#include "daemon/security/tls.h"

namespace rannc {
namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(options.max_message_bytes);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  // gRPC's "min reconnect backoff" is each connection attempt's deadline, not a wait.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, options.connect_attempt_timeout_ms);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, options.initial_reconnect_backoff_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, options.max_reconnect_backoff_ms);
  const security::TlsFiles tls{options.tls_cert, options.tls_key, options.tls_ca};
  return security::TokenChannel(
      address, security::ChannelCredentials(tls, std::chrono::seconds(60)), args, options.token);
}

// Writes `first` (the spec or header), then `model_bytes` as model_chunk messages. A failed
// Write means the daemon ended the stream; the caller's Finish() says why.
template <typename Request>
void WriteModelStream(grpc::ClientWriter<Request>* writer, Request first,
                      std::string_view model_bytes, size_t chunk_bytes) {
  bool open = writer->Write(first);
  for (std::string_view piece : SplitBytes(model_bytes, chunk_bytes)) {
    if (!open) break;
    first.set_model_chunk(piece.data(), piece.size());
    open = writer->Write(first);
  }
  if (open) writer->WritesDone();
}

// A failed file operation on the client's side: the errno's code, "ExportCheckpoint: cannot
// <what> <path>: <strerror>".
absl::Status FileError(const std::string& what, const std::string& path, int error_number) {
  return absl::Status(absl::ErrnoToStatusCode(error_number),
                      absl::StrCat("ExportCheckpoint: cannot ", what, " ", path, ": ",
                                   std::strerror(error_number)));
}

// A fresh client id for CallId: 128 random bits in hex.
std::string RandomClientId() {
  std::random_device device;
  auto word = [&device] {
    return (static_cast<uint64_t>(device()) << 32) | static_cast<uint64_t>(device());
  };
  const uint64_t high = word();
  const uint64_t low = word();
  return absl::StrCat(absl::Hex(high, absl::kZeroPad16), absl::Hex(low, absl::kZeroPad16));
}

// The daemon's mark on an answer it gave from its record of the call (a retry's).
constexpr char kReplayedKey[] = "rannc-replayed";

}  // namespace

absl::Status FromGrpcStatus(absl::string_view rpc, const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share the canonical numbering.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(rpc, ": ", status.error_message()));
}

namespace {

std::vector<std::string> SplitAddresses(const std::string& addresses) {
  std::vector<std::string> out;
  for (absl::string_view a : absl::StrSplit(addresses, ',', absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(a));
  }
  if (out.empty()) out.push_back(addresses);
  return out;
}

}  // namespace

Client::Client(const std::string& address, const ClientOptions& options)
    : Client(MakeChannel(SplitAddresses(address)[0], options), address, options) {}

Client::Client(std::shared_ptr<grpc::Channel> channel, std::string address,
               const ClientOptions& options)
    : addresses_(SplitAddresses(address)),
      options_(options),
      channel_(std::move(channel)),
      stub_(v1::TrainingService::NewStub(channel_)) {
  address_ = addresses_[0];
}

absl::StatusOr<std::unique_ptr<Client>> Client::ConnectAny(const std::string& addresses,
                                                           absl::Duration timeout,
                                                           const ClientOptions& options) {
  const std::vector<std::string> all = SplitAddresses(addresses);
  const absl::Time deadline = absl::Now() + timeout;
  std::string failures;
  while (true) {
    failures.clear();
    for (size_t i = 0; i < all.size(); ++i) {
      // This one first, then the others, for LocateJob.
      std::string ordered = all[i];
      for (size_t j = 0; j < all.size(); ++j) {
        if (j != i) absl::StrAppend(&ordered, ",", all[j]);
      }
      auto client = std::make_unique<Client>(ordered, options);
      absl::Status ready = client->WaitUntilReady(
          std::max(std::min(absl::Seconds(1), deadline - absl::Now()), absl::Milliseconds(1)));
      if (ready.ok()) return client;
      absl::StrAppend(&failures, failures.empty() ? "" : "; ", ready.message());
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("no ranncd of ", addresses, " answered: ", failures));
    }
  }
}

Client::~Client() = default;

void Client::Prepare(grpc::ClientContext* context) const {
  if (options_.rpc_timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  }
}

v1::CallId Client::NextCallId() const {
  std::lock_guard<std::mutex> lock(calls_mu_);
  CallSequence& calls = calls_[std::this_thread::get_id()];
  if (calls.client_id.empty()) calls.client_id = RandomClientId();
  v1::CallId id;
  id.set_client_id(calls.client_id);
  id.set_seq(++calls.seq);
  return id;
}

absl::Status Client::CallOnce(
    absl::string_view rpc,
    const std::function<grpc::Status(grpc::ClientContext*)>& attempt) const {
  absl::Time first_failure;
  absl::Time deadline;
  absl::Duration delay = absl::Milliseconds(50);
  int retries = 0;
  while (true) {
    grpc::ClientContext context;  // one per attempt: a context cannot be reused
    Prepare(&context);
    const grpc::Status s = attempt(&context);
    if (s.ok()) return absl::OkStatus();
    const bool lost = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    const bool replayed = context.GetServerTrailingMetadata().count(kReplayedKey) > 0;
    const absl::Time now = absl::Now();
    if (lost && !replayed) {
      if (retries == 0) {
        first_failure = now;
        deadline = now + options_.call_retry_timeout;
      }
      if (now + delay < deadline) {
        if (options_.on_retry) options_.on_retry(rpc, Convert(rpc, s));
        absl::SleepFor(delay);
        delay = std::min(2 * delay, absl::Seconds(2));
        ++retries;
        continue;
      }
    }
    absl::Status failed = Convert(rpc, s);
    if (retries == 0) return failed;
    return absl::Status(failed.code(),
                        absl::StrCat(failed.message(), " (after ", retries, " retries over ",
                                     absl::FormatDuration(absl::Trunc(now - first_failure,
                                                                      absl::Milliseconds(1))),
                                     "; the call was applied once at most)"));
  }
}

absl::Status Client::Convert(absl::string_view rpc, const grpc::Status& status) const {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat(rpc, ": cannot reach ranncd at ", address_, ": ",
                                               status.error_message()));
  }
  return FromGrpcStatus(rpc, status);
}

absl::Status Client::WaitUntilReady(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  grpc::Status last;
  while (true) {
    grpc::ClientContext context;
    // Waits through connection failures (a daemon still starting) instead of failing at once.
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(deadline));
    v1::DaemonInfo info;
    last = stub_->GetInfo(&context, v1::GetInfoRequest(), &info);
    if (last.ok()) return absl::OkStatus();
    // A stopping daemon cancels the calls it has: it is going, and may come back.
    const bool transient = last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           last.error_code() == grpc::StatusCode::CANCELLED;
    if (!transient && last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return Convert("GetInfo", last);
    }
    if (absl::Now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("ranncd at ", address_,
                                                  " did not become ready within ",
                                                  absl::FormatDuration(timeout), " (last: ",
                                                  last.error_message(), ")"));
}

absl::StatusOr<v1::RegisteredJob> Client::LocateJob(const std::string& name) const {
  v1::LocateJobRequest request;
  request.set_name(name);
  std::string unreachable;
  for (size_t i = 0; i < addresses_.size(); ++i) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::RegisteredJob entry;
    grpc::Status s;
    if (i == 0) {
      s = stub_->LocateJob(&context, request, &entry);
    } else {
      auto stub = v1::TrainingService::NewStub(MakeChannel(addresses_[i], options_));
      s = stub->LocateJob(&context, request, &entry);
    }
    if (s.ok()) return entry;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
        s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return FromGrpcStatus("LocateJob", s);
    }
    absl::StrAppend(&unreachable, unreachable.empty() ? "" : "; ", addresses_[i], ": ",
                    s.error_message());
  }
  return absl::UnavailableError(
      absl::StrCat("LocateJob: no ranncd answered (", unreachable, ")"));
}

absl::StatusOr<std::optional<v1::RegisteredJob>> Client::Moved(const std::string& job_id,
                                                               const std::string& name) const {
  absl::StatusOr<v1::RegisteredJob> entry = LocateJob(name);
  if (entry.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
  if (!entry.ok()) return entry.status();
  if (entry->job_id() == job_id || entry->leader().empty()) return std::nullopt;
  return *entry;
}

absl::StatusOr<v1::DaemonInfo> Client::GetInfo() const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::DaemonInfo info;
  grpc::Status s = stub_->GetInfo(&context, v1::GetInfoRequest(), &info);
  if (!s.ok()) return Convert("GetInfo", s);
  return info;
}

absl::StatusOr<std::vector<v1::JobSummary>> Client::ListJobs() const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListJobsResponse response;
  grpc::Status s = stub_->ListJobs(&context, v1::Empty(), &response);
  if (!s.ok()) return Convert("ListJobs", s);
  return std::vector<v1::JobSummary>(response.jobs().begin(), response.jobs().end());
}

absl::StatusOr<v1::CreateJobResponse> Client::CreateJob(std::string_view model_bytes,
                                                        const JobConfig& config) const {
  v1::JobSpec spec;
  spec.set_name(config.name);
  *spec.mutable_mode() = config.mode;
  *spec.mutable_optimizer() = config.optimizer;
  *spec.mutable_options() = config.options;
  if (!config.load_deployment.empty()) {
    spec.mutable_options()->set_load_deployment(config.load_deployment);
  }
  for (const auto& [key, value] : config.config) {
    (*spec.mutable_options()->mutable_config())[key] = value;
  }
  // Left unset when empty, so a daemon that predates dry runs sees exactly the old spec.
  if (config.dry_run.ByteSizeLong() > 0) *spec.mutable_dry_run() = config.dry_run;
  for (const HostTensor& input : config.example_inputs) {
    if (absl::Status s = input.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("CreateJob: example input #",
                                                     spec.example_inputs_size(), ": ",
                                                     s.message()));
    }
    ToProto(input, spec.add_example_inputs());
  }
  for (const std::string& name : config.input_names) spec.add_input_names(name);
  return CreateJob(model_bytes, std::move(spec));
}

absl::StatusOr<v1::CreateJobResponse> Client::CreateJob(std::string_view model_bytes,
                                                        v1::JobSpec spec) const {
  spec.set_model_bytes(model_bytes.size());
  grpc::ClientContext context;
  Prepare(&context);
  v1::CreateJobResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::CreateJobRequest>> writer =
      stub_->CreateJob(&context, &response);
  v1::CreateJobRequest request;
  *request.mutable_spec() = std::move(spec);
  WriteModelStream(writer.get(), std::move(request), model_bytes, options_.model_chunk_bytes);
  grpc::Status s = writer->Finish();
  if (!s.ok()) return Convert("CreateJob", s);
  return response;
}

absl::Status Client::AddMode(const std::string& job_id, const v1::Mode& mode,
                             std::string_view model_bytes) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::AddModeResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AddModeRequest>> writer =
      stub_->AddMode(&context, &response);
  v1::AddModeRequest request;
  request.mutable_header()->set_job_id(job_id);
  *request.mutable_header()->mutable_mode() = mode;
  request.mutable_header()->set_model_bytes(model_bytes.size());
  WriteModelStream(writer.get(), std::move(request), model_bytes, options_.model_chunk_bytes);
  return Convert("AddMode", writer->Finish());
}

absl::StatusOr<std::vector<std::string>> Client::RenewLeases(
    const std::vector<std::string>& job_ids) const {
  grpc::ClientContext context;
  Prepare(&context);
  // A renewal is quick; a daemon that does not answer must not hold a LeaseKeeper for long.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  if (options_.rpc_timeout == absl::InfiniteDuration() ||
      options_.rpc_timeout > absl::Seconds(10)) {
    context.set_deadline(absl::ToChronoTime(deadline));
  }
  v1::RenewLeasesRequest request;
  for (const std::string& id : job_ids) request.add_job_ids(id);
  v1::RenewLeasesResponse response;
  grpc::Status s = stub_->RenewLeases(&context, request, &response);
  if (!s.ok()) return Convert("RenewLeases", s);
  return std::vector<std::string>(response.unknown().begin(), response.unknown().end());
}

LeaseKeeper::LeaseKeeper(const Client& client, std::string job_id, absl::Duration lease)
    : client_(client), job_id_(std::move(job_id)) {
  const auto every = std::chrono::milliseconds(std::max<int64_t>(
      100, absl::ToInt64Milliseconds(lease) / 5));
  renewer_ = std::make_unique<Periodic>(every, [this] { Renew(); });
}

LeaseKeeper::~LeaseKeeper() = default;

void LeaseKeeper::Renew() {
  if (gone_) return;  // nothing to keep
  // A failed renewal is tried again next round; the job's lease outlasts several rounds.
  absl::StatusOr<std::vector<std::string>> unknown = client_.RenewLeases({job_id_});
  gone_ = unknown.ok() && !unknown->empty();
}

absl::Status Client::DeleteJob(const std::string& job_id) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef request;
  request.set_job_id(job_id);
  v1::Empty response;
  return Convert("DeleteJob", stub_->DeleteJob(&context, request, &response));
}

absl::StatusOr<v1::CreateJobResponse> Client::ResumeJob(const std::string& job) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef request;
  request.set_job_id(job);
  v1::CreateJobResponse response;
  absl::Status status = Convert("ResumeJob", stub_->ResumeJob(&context, request, &response));
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<ForwardResult> Client::Forward(const std::string& job_id,
                                              const std::vector<HostTensor>& inputs,
                                              bool requires_grad) const {
  v1::ForwardRequest request;
  request.set_job_id(job_id);
  request.set_requires_grad(requires_grad);
  for (const HostTensor& input : inputs) {
    if (absl::Status s = input.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: input #", request.inputs_size(), ": ", s.message()));
    }
    ToProto(input, request.add_inputs());
  }
  *request.mutable_call() = NextCallId();
  v1::ForwardResponse response;
  absl::Status s = CallOnce("Forward", [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->Forward(context, request, &response);
  });
  if (!s.ok()) return s;
  ForwardResult result;
  result.forward_id = response.forward_id();
  for (const v1::Tensor& output : response.outputs()) {
    absl::StatusOr<HostTensor> t = FromProto(output);
    if (!t.ok()) return t.status();
    result.outputs.push_back(*std::move(t));
  }
  return result;
}

absl::Status Client::Backward(const std::string& job_id, const std::vector<OutputGrad>& grads,
                              bool retain_graph) const {
  v1::BackwardRequest request;
  request.set_job_id(job_id);
  request.set_retain_graph(retain_graph);
  for (const OutputGrad& grad : grads) {
    if (absl::Status s = grad.grad.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Backward: grad of output #", grad.output_index, ": ", s.message()));
    }
    v1::OutputGrad* g = request.add_grads();
    g->set_output_index(grad.output_index);
    ToProto(grad.grad, g->mutable_grad());
  }
  *request.mutable_call() = NextCallId();
  v1::Empty response;
  return CallOnce("Backward", [&](grpc::ClientContext* context) {
    return stub_->Backward(context, request, &response);
  });
}

absl::Status Client::Step(const std::string& job_id,
                          const std::vector<v1::HyperParams>& groups) const {
  v1::StepRequest request;
  request.set_job_id(job_id);
  request.mutable_groups()->Add(groups.begin(), groups.end());
  *request.mutable_call() = NextCallId();
  v1::Empty response;
  return CallOnce("Step", [&](grpc::ClientContext* context) {
    return stub_->Step(context, request, &response);
  });
}

absl::Status Client::ZeroGrad(const std::string& job_id, bool set_to_none) const {
  v1::ZeroGradRequest request;
  request.set_job_id(job_id);
  request.set_set_to_none(set_to_none);
  *request.mutable_call() = NextCallId();
  v1::Empty response;
  return CallOnce("ZeroGrad", [&](grpc::ClientContext* context) {
    return stub_->ZeroGrad(context, request, &response);
  });
}

absl::StatusOr<double> Client::ClipGradNorm(const std::string& job_id, double max_norm,
                                            double norm_type) const {
  v1::ClipGradNormRequest request;
  request.set_job_id(job_id);
  request.set_max_norm(max_norm);
  request.set_norm_type(norm_type);
  *request.mutable_call() = NextCallId();
  v1::ClipGradNormResponse response;
  absl::Status s = CallOnce("ClipGradNorm", [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->ClipGradNorm(context, request, &response);
  });
  if (!s.ok()) return s;
  return response.total_norm();
}

absl::StatusOr<HostTensor> Client::GetParam(const std::string& job_id, const std::string& name,
                                            bool amp_master_param) const {
  v1::GetParamRequest request;
  request.set_job_id(job_id);
  request.set_name(name);
  request.set_amp_master_param(amp_master_param);
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetParamResponse response;
  grpc::Status s = stub_->GetParam(&context, request, &response);
  if (!s.ok()) return Convert("GetParam", s);
  if (!response.has_value()) {
    return absl::InternalError(
        absl::StrCat("GetParam: the daemon returned no value for parameter '", name, "'"));
  }
  return FromProto(response.tensor());
}

absl::StatusOr<std::optional<HostTensor>> Client::GetParamGrad(const std::string& job_id,
                                                               const std::string& name,
                                                               bool amp_master_param) const {
  v1::GetParamRequest request;
  request.set_job_id(job_id);
  request.set_name(name);
  request.set_grad(true);
  request.set_amp_master_param(amp_master_param);
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetParamResponse response;
  grpc::Status s = stub_->GetParam(&context, request, &response);
  if (!s.ok()) return Convert("GetParam", s);
  if (!response.has_value()) return std::optional<HostTensor>();
  absl::StatusOr<HostTensor> t = FromProto(response.tensor());
  if (!t.ok()) return t.status();
  return std::optional<HostTensor>(*std::move(t));
}

absl::StatusOr<NamedTensors> Client::ReadStateStream(
    absl::string_view rpc, grpc::ClientContext* context,
    grpc::ClientReader<v1::StateDictChunk>* reader, bool keyed) const {
  HostStateDictAssembler assembler;
  v1::StateDictChunk chunk;
  absl::Status assembled;
  while (reader->Read(&chunk)) {
    if (keyed) chunk.set_name(absl::StrCat(chunk.name(), "[", chunk.state_key(), "]"));
    assembled = assembler.Add(chunk);
    if (!assembled.ok()) {
      context->TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (!assembled.ok()) {
    return absl::Status(assembled.code(), absl::StrCat(rpc, ": ", assembled.message()));
  }
  if (!s.ok()) return Convert(rpc, s);
  absl::StatusOr<NamedTensors> state = std::move(assembler).Finish();
  if (!state.ok()) {
    return absl::Status(state.status().code(), absl::StrCat(rpc, ": ", state.status().message()));
  }
  return state;
}

absl::StatusOr<NamedTensors> Client::StateDict(const std::string& job_id,
                                               bool amp_master_params) const {
  v1::StateDictRequest request;
  request.set_job_id(job_id);
  request.set_amp_master_params(amp_master_params);
  grpc::ClientContext context;
  Prepare(&context);
  std::unique_ptr<grpc::ClientReader<v1::StateDictChunk>> reader =
      stub_->StateDict(&context, request);
  return ReadStateStream("StateDict", &context, reader.get(), /*keyed=*/false);
}

absl::StatusOr<LoadStateDictResult> Client::LoadStateDict(
    const std::string& job_id, const NamedTensors& state, bool strict,
    const std::set<std::string>& buffers) const {
  for (const auto& [name, tensor] : state) {
    if (absl::Status s = tensor.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadStateDict: entry '", name, "': ", s.message()));
    }
  }
  v1::LoadStateDictRequest header;
  header.mutable_header()->set_job_id(job_id);
  header.mutable_header()->set_strict(strict);
  *header.mutable_header()->mutable_call() = NextCallId();
  v1::LoadStateDictResponse response;
  // A retry sends the whole stream again, under the same CallId.
  absl::Status s = CallOnce("LoadStateDict", [&](grpc::ClientContext* context) {
    response.Clear();
    std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer =
        stub_->LoadStateDict(context, &response);
    v1::LoadStateDictRequest request = header;
    bool open = writer->Write(request);
    for (const auto& [name, tensor] : state) {
      if (!open) break;
      for (v1::StateDictChunk& chunk : ToStateDictChunks(name, tensor, buffers.count(name) > 0,
                                                         options_.state_dict_chunk_bytes)) {
        *request.mutable_chunk() = std::move(chunk);
        open = writer->Write(request);
        if (!open) break;
      }
    }
    if (open) writer->WritesDone();
    return writer->Finish();
  });
  if (!s.ok()) return s;
  LoadStateDictResult result;
  result.missing_keys.assign(response.missing_keys().begin(), response.missing_keys().end());
  result.unexpected_keys.assign(response.unexpected_keys().begin(),
                                response.unexpected_keys().end());
  return result;
}

absl::StatusOr<Client::OptimizerState> Client::GetOptimizerState(
    const std::string& job_id) const {
  v1::JobRef request;
  request.set_job_id(job_id);
  grpc::ClientContext context;
  Prepare(&context);
  std::unique_ptr<grpc::ClientReader<v1::StateDictChunk>> reader =
      stub_->OptimizerState(&context, request);
  absl::StatusOr<NamedTensors> flat =
      ReadStateStream("OptimizerState", &context, reader.get(), /*keyed=*/true);
  if (!flat.ok()) return flat.status();
  OptimizerState state;
  for (auto& [joined, tensor] : *flat) {
    const size_t cut = joined.rfind('[');
    state[joined.substr(0, cut)][joined.substr(cut + 1, joined.size() - cut - 2)] =
        std::move(tensor);
  }
  return state;
}

absl::Status Client::LoadOptimizerState(const std::string& job_id,
                                        const OptimizerState& state) const {
  for (const auto& [name, entries] : state) {
    for (const auto& [key, tensor] : entries) {
      if (absl::Status s = tensor.Validate(); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "LoadOptimizerState: '", key, "' of '", name, "': ", s.message()));
      }
    }
  }
  v1::LoadStateDictRequest header;
  header.mutable_header()->set_job_id(job_id);
  *header.mutable_header()->mutable_call() = NextCallId();
  v1::LoadStateDictResponse response;
  // A retry sends the whole stream again, under the same CallId.
  return CallOnce("LoadOptimizerState", [&](grpc::ClientContext* context) {
    response.Clear();
    std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer =
        stub_->LoadOptimizerState(context, &response);
    v1::LoadStateDictRequest request = header;
    bool open = writer->Write(request);
    for (auto it = state.begin(); open && it != state.end(); ++it) {
      for (const auto& [key, tensor] : it->second) {
        for (v1::StateDictChunk& chunk :
             ToStateDictChunks(it->first, tensor, false, options_.state_dict_chunk_bytes)) {
          chunk.set_state_key(key);
          *request.mutable_chunk() = std::move(chunk);
          open = writer->Write(request);
          if (!open) break;
        }
        if (!open) break;
      }
    }
    if (open) writer->WritesDone();
    return writer->Finish();
  });
}

absl::StatusOr<bool> Client::SetMode(const std::string& job_id, const v1::Mode& mode) const {
  v1::SetModeRequest request;
  request.set_job_id(job_id);
  *request.mutable_mode() = mode;
  grpc::ClientContext context;
  Prepare(&context);
  v1::SetModeResponse response;
  grpc::Status s = stub_->SetMode(&context, request, &response);
  if (!s.ok()) return Convert("SetMode", s);
  return response.has_graph();
}

absl::Status Client::Undeploy(const std::string& job_id) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef request;
  request.set_job_id(job_id);
  v1::Empty response;
  return Convert("Undeploy", stub_->Undeploy(&context, request, &response));
}

absl::Status Client::RecreateCommunicators(const std::string& job_id) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef request;
  request.set_job_id(job_id);
  v1::Empty response;
  return Convert("RecreateCommunicators",
                 stub_->RecreateCommunicators(&context, request, &response));
}

absl::StatusOr<v1::CheckpointInfo> Client::Checkpoint(const std::string& job_id,
                                                      bool wait) const {
  v1::CheckpointRequest request;
  request.set_job_id(job_id);
  request.set_wait(wait);
  *request.mutable_call() = NextCallId();
  v1::CheckpointInfo info;
  absl::Status s = CallOnce("Checkpoint", [&](grpc::ClientContext* context) {
    info.Clear();
    return stub_->Checkpoint(context, request, &info);
  });
  if (!s.ok()) return s;
  return info;
}

absl::StatusOr<v1::ListCheckpointsResponse> Client::ListCheckpoints(
    const v1::CheckpointsRef& ref) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListCheckpointsResponse response;
  grpc::Status s = stub_->ListCheckpoints(&context, ref, &response);
  if (!s.ok()) return Convert("ListCheckpoints", s);
  return response;
}

absl::StatusOr<std::string> Client::SubmitJob(const v1::DetachedJobSpec& spec) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::SubmitJobResponse response;
  grpc::Status s = stub_->SubmitJob(&context, spec, &response);
  if (!s.ok()) return Convert("SubmitJob", s);
  return response.job_id();
}

absl::StatusOr<v1::DetachedStatus> Client::DetachedJobStatus(const std::string& job_id) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef ref;
  ref.set_job_id(job_id);
  v1::DetachedStatus response;
  grpc::Status s = stub_->DetachedJobStatus(&context, ref, &response);
  if (!s.ok()) return Convert("DetachedJobStatus", s);
  return response;
}

absl::StatusOr<std::vector<v1::DetachedStatus>> Client::ListDetachedJobs() const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListDetachedJobsResponse response;
  grpc::Status s = stub_->ListDetachedJobs(&context, v1::Empty(), &response);
  if (!s.ok()) return Convert("ListDetachedJobs", s);
  return std::vector<v1::DetachedStatus>(response.jobs().begin(), response.jobs().end());
}

absl::StatusOr<std::string> Client::UploadFile(const std::string& local_path) const {
  std::FILE* file = std::fopen(local_path.c_str(), "rb");
  if (file == nullptr) {
    return absl::Status(absl::ErrnoToStatusCode(errno),
                        absl::StrCat("UploadFile: cannot open ", local_path, ": ",
                                     std::strerror(errno)));
  }
  std::fseek(file, 0, SEEK_END);
  const long size = std::ftell(file);
  std::fseek(file, 0, SEEK_SET);
  grpc::ClientContext context;  // no deadline: the bytes take what they take
  v1::UploadedFile response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadChunk>> writer =
      stub_->UploadFile(&context, &response);
  v1::UploadChunk chunk;
  chunk.set_name(local_path.substr(local_path.find_last_of('/') + 1));
  chunk.set_size(size > 0 ? static_cast<uint64_t>(size) : 0);
  std::string buffer(std::min<size_t>(options_.max_message_bytes / 2, size_t{4} << 20), '\0');
  bool open = true, read_error = false;
  while (open) {
    const size_t n = std::fread(buffer.data(), 1, buffer.size(), file);
    if (n == 0 && std::ferror(file)) read_error = true;
    chunk.set_data(buffer.data(), n);
    open = writer->Write(chunk);
    chunk.clear_name();
    chunk.clear_size();
    if (n < buffer.size()) break;
  }
  std::fclose(file);
  if (open) writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (read_error) {
    return absl::DataLossError(absl::StrCat("UploadFile: reading ", local_path, " failed"));
  }
  if (!s.ok()) return Convert("UploadFile", s);
  return response.path();
}

absl::Status Client::DetachedJobLogs(const std::string& job_id, int64_t after_seq, bool follow,
                                     const std::function<void(const v1::DetachedLogLine&)>& line,
                                     const std::function<bool()>& stop) const {
  grpc::ClientContext context;  // no deadline: a followed log lasts as long as its job
  v1::DetachedLogsRequest request;
  request.set_job_id(job_id);
  request.set_after_seq(after_seq);
  request.set_follow(follow);
  std::unique_ptr<grpc::ClientReader<v1::DetachedLogLine>> reader =
      stub_->DetachedJobLogs(&context, request);
  std::atomic<bool> done{false};
  std::thread watcher;
  if (stop) {
    watcher = std::thread([&] {
      while (!done) {
        if (stop()) {
          context.TryCancel();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  v1::DetachedLogLine got;
  while (reader->Read(&got)) line(got);
  grpc::Status s = reader->Finish();
  done = true;
  if (watcher.joinable()) watcher.join();
  if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
    return Convert("DetachedJobLogs", s);
  }
  return absl::OkStatus();
}

absl::Status Client::CancelJob(const std::string& job_id) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::JobRef ref;
  ref.set_job_id(job_id);
  v1::Empty response;
  grpc::Status s = stub_->CancelJob(&context, ref, &response);
  if (!s.ok()) return Convert("CancelJob", s);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Client::ExportCheckpoint(const v1::CheckpointsRef& ref,
                                                 const std::string& out_path) const {
  const std::string tmp_path = out_path + ".tmp";
  // Opened before asking, so that an unwritable path fails before the daemon reads anything.
  std::FILE* file = std::fopen(tmp_path.c_str(), "wb");
  if (file == nullptr) return FileError("write", tmp_path, errno);

  grpc::ClientContext context;
  Prepare(&context);
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader =
      stub_->ExportCheckpoint(&context, ref);
  auto data_loss = [](const std::string& what) {
    return absl::DataLossError(absl::StrCat("ExportCheckpoint: ", what));
  };
  absl::Status failed;  // the first failure on our side; the stream is cancelled then
  bool any = false;
  uint64_t total = 0;
  uint64_t received = 0;
  int64_t step = 0;
  v1::ExportChunk chunk;
  while (reader->Read(&chunk)) {
    if (!any) {
      any = true;
      total = chunk.total_bytes();
      step = chunk.step();
    } else if (chunk.total_bytes() != total || chunk.step() != step) {
      failed = data_loss(absl::StrCat("the stream changed from step ", step, " (", total,
                                      " bytes) to step ", chunk.step(), " (",
                                      chunk.total_bytes(), " bytes) midway"));
    }
    const size_t size = chunk.data().size();
    if (failed.ok() && received + size > total) {
      failed = data_loss(absl::StrCat("received more than the ", total, " bytes announced"));
    }
    if (failed.ok() && size > 0 && std::fwrite(chunk.data().data(), 1, size, file) != size) {
      failed = FileError("write", tmp_path, errno);
    }
    if (!failed.ok()) {
      context.TryCancel();
      break;
    }
    received += size;
  }
  grpc::Status s = reader->Finish();
  if (failed.ok() && !s.ok()) failed = Convert("ExportCheckpoint", s);
  if (failed.ok() && !any) failed = data_loss("the daemon sent no data");
  if (failed.ok() && received != total) {
    failed = data_loss(absl::StrCat("received ", received, " of the ", total,
                                    " bytes of step ", step));
  }
  if (std::fclose(file) != 0 && failed.ok()) failed = FileError("write", tmp_path, errno);
  if (failed.ok() && std::rename(tmp_path.c_str(), out_path.c_str()) != 0) {
    failed = FileError(absl::StrCat("rename ", tmp_path, " to"), out_path, errno);
  }
  if (!failed.ok()) {
    std::remove(tmp_path.c_str());
    return failed;
  }
  return step;
}

}  // namespace rannc
