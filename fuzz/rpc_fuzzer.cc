// Fuzz target: the request validation of the training service's RPCs, against a real daemon. At start-up the target starts a Daemon in this process (--devices cpu:1, loopback, no
// state directory, no profile cache) and creates one training job on it through the C++ SDK
// (the mlp fixture, SGD): the live job. Each input is one call: its first byte picks the method,
// the rest is the method's request (protobuf bytes, as a client would send). A request that
// names no job is given the live job's id (or name), so that the calls reach the job's own checks
// (inputs' shapes and dtypes against the model, gradients against the last forward, parameter
// names, optimizer hyper-parameters, modes, checkpoints without a directory, ...). DeleteJob and
// Undeploy of the live job are skipped: the other calls keep a job to work on. Each call has a
// 2 s deadline. Every path must end in a status: no crash, hang or undefined behaviour, and the
// daemon serves on.
//
// The streaming calls too: for one that streams requests (CreateJob, AddMode, LoadStateDict,
// LoadOptimizerState) the rest of the input is up to 16 requests, each a 2-byte little-endian
// length and its bytes, sent in order (the handlers' order checks: a header first, chunks of
// one tensor in order, sizes against what the header said); a job a CreateJob made is deleted
// after it, and AddMode goes to a job that does not exist (a successful one would grow the live
// job each time; importing is the torchscript_import target's). For one that streams answers
// (StateDict, OptimizerState, ExportCheckpoint, DetachedJobLogs) the rest is its request, and
// every answer is read. Left out: UploadFile (it leaves files) and SubmitJob (it starts
// detached jobs that read files).
//
// The fixture is read from the target's runfiles (fuzz/runfiles.h). Seeds:
// fuzz/make_seeds.py (one or more requests per method); RANNC_FUZZ_VERBOSE=1 prints each call's
// status, to see what an input reaches.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "client/rannc_client.h"
#include "daemon/config/options.h"
#include "daemon/daemon.h"
#include "fuzz/runfiles.h"
#include "rannc/v1/training.grpc.pb.h"
#include "tests/fixtures/fixture.h"

namespace {

namespace v1 = rannc::v1;

struct Harness {
  std::unique_ptr<rannc::Daemon> daemon;
  std::unique_ptr<v1::TrainingService::Stub> stub;
  std::string job_id;  // the live job
};

Harness& TheDaemon() {
  static Harness* h = [] {
    auto* h = new Harness;  // the fuzzer's lifetime
    std::vector<std::string> args = {"ranncd",       "--listen",        "127.0.0.1:0",
                                     "--devices",    "cpu:1",           "--state-dir",
                                     "none",         "--profile-cache", "none",
                                     "--links",      "p2p=5GB/s"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    absl::StatusOr<rannc::DaemonOptions> options = rannc::LoadDaemonOptions(
        static_cast<int>(argv.size()), argv.data(), {}, rannc::kRanncVersion);
    if (!options.ok()) std::abort();
    absl::StatusOr<std::unique_ptr<rannc::Daemon>> daemon = rannc::Daemon::Start(*options);
    if (!daemon.ok()) std::abort();
    h->daemon = std::move(*daemon);
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateChannel(h->daemon->address(), grpc::InsecureChannelCredentials());
    h->stub = v1::TrainingService::NewStub(channel);

    rannc::testing::Fixture mlp;
    rannc::fuzz::InRunfiles([&] { mlp = rannc::testing::LoadFixture("mlp"); });
    rannc::Client client(channel, h->daemon->address());
    rannc::JobConfig config;
    config.name = "fuzz";
    config.mode.set_training(true);
    config.optimizer.set_type(v1::SGD);
    std::vector<float> x(5 * 6, 0.5f);
    config.example_inputs = {rannc::HostTensor::FromVector<float>(x, {5, 6}),
                             rannc::HostTensor::FromVector<int64_t>({0, 1, 2, 0, 1}, {5})};
    absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(mlp.model_bytes, config);
    if (!job.ok()) std::abort();
    h->job_id = job->job_id();
    return h;
  }();
  return *h;
}

// The live job's id where the request names none.
void Live(std::string* job_id) {
  if (job_id->empty()) *job_id = TheDaemon().job_id;
}

template <typename Request, typename Response, typename Method>
void Call(const std::string& body, Method method, void (*fill)(Request*) = nullptr) {
  Request request;
  if (!request.ParseFromString(body)) return;
  if (fill != nullptr) fill(&request);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  Response response;
  const grpc::Status status = (TheDaemon().stub.get()->*method)(&context, request, &response);
  if (std::getenv("RANNC_FUZZ_VERBOSE") != nullptr) {  // for checking what seeds reach
    std::fprintf(stderr, "%s: %d %s\n", Request::descriptor()->name().c_str(),
                 static_cast<int>(status.error_code()), status.error_message().c_str());
  }
}

template <typename Request>
void WithJob(Request* r) {
  Live(r->mutable_job_id());
}

// JoinJob and ClientBarrier name a job; their waits are cut to half a second (the daemon would
// otherwise hold a thread for as long as the request says).
template <typename Request>
void ByName(Request* r) {
  if (r->name().empty()) r->set_name("fuzz");
  if (r->timeout_ms() > 500) r->set_timeout_ms(500);
}

void JobRefNotLive(v1::JobRef* r) {
  Live(r->mutable_job_id());
  if (r->job_id() == TheDaemon().job_id) r->set_job_id("not-the-live-job");
}

void Verbose(const char* name, const grpc::Status& status) {
  if (std::getenv("RANNC_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr, "%s: %d %s\n", name, static_cast<int>(status.error_code()),
                 status.error_message().c_str());
  }
}

// The requests of a client-streaming call: up to 16, each a 2-byte little-endian length and
// that many bytes of `body` (a request that does not parse ends the list).
template <typename Request>
std::vector<Request> Requests(const std::string& body) {
  std::vector<Request> out;
  size_t at = 0;
  while (out.size() < 16 && body.size() - at >= 2) {
    const size_t n = static_cast<uint8_t>(body[at]) | static_cast<uint8_t>(body[at + 1]) << 8;
    at += 2;
    Request r;
    if (n > body.size() - at || !r.ParseFromString(body.substr(at, n))) break;
    out.push_back(std::move(r));
    at += n;
  }
  return out;
}

template <typename Request, typename Response, typename Method>
grpc::Status ClientStream(const std::string& body, Method method, void (*fill)(Request*),
                          Response* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  auto writer = (TheDaemon().stub.get()->*method)(&context, response);
  for (Request& r : Requests<Request>(body)) {
    fill(&r);
    if (!writer->Write(r)) break;  // the daemon answered already
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  Verbose(Request::descriptor()->name().c_str(), status);
  return status;
}

template <typename Request, typename Answer, typename Method>
void ServerStream(const std::string& body, Method method, void (*fill)(Request*)) {
  Request request;
  if (!request.ParseFromString(body)) return;
  fill(&request);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  auto reader = (TheDaemon().stub.get()->*method)(&context, request);
  Answer answer;
  while (reader->Read(&answer)) {
  }
  Verbose(Request::descriptor()->name().c_str(), reader->Finish());
}

void NoFill(v1::CreateJobRequest*) {}

void AddModeNotLive(v1::AddModeRequest* r) {
  if (r->has_header()) r->mutable_header()->set_job_id("not-the-live-job");
}

void LoadWithJob(v1::LoadStateDictRequest* r) {
  if (r->has_header()) Live(r->mutable_header()->mutable_job_id());
}

void CreateJob(const std::string& body) {
  v1::CreateJobResponse made;
  const grpc::Status status = ClientStream<v1::CreateJobRequest>(
      body, &v1::TrainingService::Stub::CreateJob, NoFill, &made);
  if (!status.ok() || made.job_id().empty()) return;
  grpc::ClientContext context;  // a job made is deleted: each input starts from the live one
  v1::JobRef ref;
  ref.set_job_id(made.job_id());
  v1::Empty empty;
  (void)TheDaemon().stub->DeleteJob(&context, ref, &empty);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs each string field that is not UTF-8: most mutated inputs, at a cost per run.
  google::protobuf::SetLogHandler(nullptr);
  spdlog::set_level(spdlog::level::off);  // every refused call is logged
  rannc::fuzz::FindRunfiles((*argv)[0]);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  using S = v1::TrainingService::Stub;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 30) {
    case 0: Call<v1::GetInfoRequest, v1::DaemonInfo>(body, &S::GetInfo); break;
    case 1:
      Call<v1::JoinJobRequest, v1::CreateJobResponse>(body, &S::JoinJob,
                                                      ByName<v1::JoinJobRequest>);
      break;
    case 2:
      Call<v1::ClientBarrierRequest, v1::Empty>(body, &S::ClientBarrier,
                                                ByName<v1::ClientBarrierRequest>);
      break;
    case 3: Call<v1::Empty, v1::ListJobsResponse>(body, &S::ListJobs); break;
    case 4: Call<v1::RenewLeasesRequest, v1::RenewLeasesResponse>(body, &S::RenewLeases); break;
    case 5:
      Call<v1::ForwardRequest, v1::ForwardResponse>(body, &S::Forward,
                                                    WithJob<v1::ForwardRequest>);
      break;
    case 6:
      Call<v1::BackwardRequest, v1::Empty>(body, &S::Backward, WithJob<v1::BackwardRequest>);
      break;
    case 7: Call<v1::StepRequest, v1::Empty>(body, &S::Step, WithJob<v1::StepRequest>); break;
    case 8:
      Call<v1::ZeroGradRequest, v1::Empty>(body, &S::ZeroGrad, WithJob<v1::ZeroGradRequest>);
      break;
    case 9:
      Call<v1::ClipGradNormRequest, v1::ClipGradNormResponse>(
          body, &S::ClipGradNorm, WithJob<v1::ClipGradNormRequest>);
      break;
    case 10:
      Call<v1::AllReduceGradsRequest, v1::Empty>(body, &S::AllReduceGrads,
                                                 WithJob<v1::AllReduceGradsRequest>);
      break;
    case 11: Call<v1::FlushRequest, v1::Empty>(body, &S::Flush, WithJob<v1::FlushRequest>); break;
    case 12:
      Call<v1::GetParamRequest, v1::GetParamResponse>(body, &S::GetParam,
                                                      WithJob<v1::GetParamRequest>);
      break;
    case 13:
      Call<v1::SetModeRequest, v1::SetModeResponse>(body, &S::SetMode,
                                                    WithJob<v1::SetModeRequest>);
      break;
    case 14:
      Call<v1::JobRef, v1::Empty>(body, &S::RecreateCommunicators, WithJob<v1::JobRef>);
      break;
    case 15: Call<v1::LocateJobRequest, v1::RegisteredJob>(body, &S::LocateJob); break;
    case 16:
      Call<v1::CheckpointRequest, v1::CheckpointInfo>(body, &S::Checkpoint,
                                                      WithJob<v1::CheckpointRequest>);
      break;
    case 17:
      Call<v1::CheckpointsRef, v1::ListCheckpointsResponse>(body, &S::ListCheckpoints,
                                                            WithJob<v1::CheckpointsRef>);
      break;
    case 18:
      Call<v1::JobRef, v1::DetachedStatus>(body, &S::DetachedJobStatus, WithJob<v1::JobRef>);
      break;
    case 19: Call<v1::JobRef, v1::Empty>(body, &S::DeleteJob, JobRefNotLive); break;
    case 20: Call<v1::JobRef, v1::Empty>(body, &S::Undeploy, JobRefNotLive); break;
    // The streaming calls.
    case 21: CreateJob(body); break;
    case 22: {
      v1::AddModeResponse r;
      (void)ClientStream<v1::AddModeRequest>(body, &S::AddMode, AddModeNotLive, &r);
      break;
    }
    case 23:
      ServerStream<v1::StateDictRequest, v1::StateDictChunk>(body, &S::StateDict,
                                                             WithJob<v1::StateDictRequest>);
      break;
    case 24: {
      v1::LoadStateDictResponse r;
      (void)ClientStream<v1::LoadStateDictRequest>(body, &S::LoadStateDict, LoadWithJob, &r);
      break;
    }
    case 25:
      ServerStream<v1::JobRef, v1::StateDictChunk>(body, &S::OptimizerState,
                                                   WithJob<v1::JobRef>);
      break;
    case 26: {
      v1::LoadStateDictResponse r;
      (void)ClientStream<v1::LoadStateDictRequest>(body, &S::LoadOptimizerState, LoadWithJob,
                                                   &r);
      break;
    }
    case 27:
      ServerStream<v1::CheckpointsRef, v1::ExportChunk>(body, &S::ExportCheckpoint,
                                                        WithJob<v1::CheckpointsRef>);
      break;
    case 28:
      ServerStream<v1::DetachedLogsRequest, v1::DetachedLogLine>(
          body, &S::DetachedJobLogs, WithJob<v1::DetachedLogsRequest>);
      break;
    case 29: Call<v1::Empty, v1::ListDetachedJobsResponse>(body, &S::ListDetachedJobs); break;
  }
  return 0;
}
