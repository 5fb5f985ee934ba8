// Drives rannc::Client against an in-process fake TrainingService, so that chunking, tensor
// conversion and status mapping are tested without a daemon (see client_integration_test for
// the real one).
#include "client/rannc_client.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

namespace rannc {
namespace {

class FakeTrainingService final : public v1::TrainingService::Service {
 public:
  // What the fake saw; guarded by mu.
  std::mutex mu;
  v1::JobSpec spec;
  std::vector<size_t> model_chunk_sizes;
  std::string model;
  std::vector<v1::StateDictChunk> loaded_chunks;
  std::string loaded_job;
  // What StateDict streams back.
  NamedTensors state;
  size_t state_chunk_bytes = 5;

  // Exactly-once calls. The CallIds Forward, ZeroGrad and LoadStateDict got, one per attempt;
  // the number of chunks each LoadStateDict attempt brought.
  std::vector<v1::CallId> forward_calls, zero_grad_calls, load_calls;
  std::vector<size_t> load_chunk_counts;
  // How many of the next Forward and LoadStateDict answers are lost (UNAVAILABLE after running).
  int forward_drops = 0;
  int load_drops = 0;
  // ZeroGrad's next answers (OK once none is left), each with or without the daemon's
  // "answered from the record" mark.
  struct Answer {
    grpc::Status status;
    bool replayed = false;
  };
  std::deque<Answer> zero_grad_answers;

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                       v1::DaemonInfo* info) override {
    info->set_version("fake");
    info->set_num_jobs(1);
    return grpc::Status::OK;
  }

  grpc::Status CreateJob(grpc::ServerContext*, grpc::ServerReader<v1::CreateJobRequest>* reader,
                         v1::CreateJobResponse* response) override {
    std::lock_guard<std::mutex> lock(mu);
    v1::CreateJobRequest request;
    if (!reader->Read(&request) || !request.has_spec()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec must come first");
    }
    spec = request.spec();
    model.clear();
    model_chunk_sizes.clear();
    while (reader->Read(&request)) {
      if (request.part_case() != v1::CreateJobRequest::kModelChunk) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "second spec");
      }
      model_chunk_sizes.push_back(request.model_chunk().size());
      model += request.model_chunk();
    }
    if (model.size() != spec.model_bytes()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model_bytes mismatch");
    }
    response->set_job_id("job-1");
    response->add_devices("cpu:0");
    return grpc::Status::OK;
  }

  grpc::Status Forward(grpc::ServerContext*, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override {
    if (request->job_id() != "job-1") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no job '" + request->job_id() + "'");
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      forward_calls.push_back(request->call());
      if (forward_drops > 0) {
        --forward_drops;
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "answer lost");
      }
    }
    // Doubles each float32 input, so that the test sees bytes travel both ways.
    for (const v1::Tensor& in : request->inputs()) {
      HostTensor t = *FromProto(in);
      std::vector<float> v = *t.ToVector<float>();
      for (float& x : v) x *= 2;
      ToProto(HostTensor::FromVector(v, t.shape), response->add_outputs());
    }
    response->set_forward_id(request->requires_grad() ? 7 : 8);
    return grpc::Status::OK;
  }

  grpc::Status Backward(grpc::ServerContext*, const v1::BackwardRequest*, v1::Empty*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "backward before forward: call Forward first");
  }

  grpc::Status GetParam(grpc::ServerContext*, const v1::GetParamRequest* request,
                        v1::GetParamResponse* response) override {
    if (request->grad()) return grpc::Status::OK;  // gradient is None
    ToProto(HostTensor::FromVector<float>({1, 2}), response->mutable_tensor());
    response->set_has_value(true);
    return grpc::Status::OK;
  }

  grpc::Status StateDict(grpc::ServerContext*, const v1::StateDictRequest*,
                         grpc::ServerWriter<v1::StateDictChunk>* writer) override {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [name, tensor] : state) {
      for (const v1::StateDictChunk& c : ToStateDictChunks(name, tensor, name == "running_mean",
                                                           state_chunk_bytes)) {
        writer->Write(c);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status LoadStateDict(grpc::ServerContext*,
                             grpc::ServerReader<v1::LoadStateDictRequest>* reader,
                             v1::LoadStateDictResponse* response) override {
    std::lock_guard<std::mutex> lock(mu);
    v1::LoadStateDictRequest request;
    if (!reader->Read(&request) || !request.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "header must come first");
    }
    loaded_job = request.header().job_id();
    load_calls.push_back(request.header().call());
    loaded_chunks.clear();
    while (reader->Read(&request)) loaded_chunks.push_back(request.chunk());
    load_chunk_counts.push_back(loaded_chunks.size());
    if (load_drops > 0) {
      --load_drops;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "answer lost");
    }
    response->add_missing_keys("bias");
    return grpc::Status::OK;
  }

  grpc::Status ZeroGrad(grpc::ServerContext* context, const v1::ZeroGradRequest* request,
                        v1::Empty*) override {
    std::lock_guard<std::mutex> lock(mu);
    zero_grad_calls.push_back(request->call());
    if (zero_grad_answers.empty()) return grpc::Status::OK;
    Answer answer = zero_grad_answers.front();
    zero_grad_answers.pop_front();
    if (answer.replayed) context->AddTrailingMetadata("rannc-replayed", "1");
    return answer.status;
  }

  grpc::Status ClipGradNorm(grpc::ServerContext*, const v1::ClipGradNormRequest* request,
                            v1::ClipGradNormResponse* response) override {
    response->set_total_norm(request->max_norm() * 10 + request->norm_type());
    return grpc::Status::OK;
  }

  // What ExportCheckpoint streams: `exported` in chunks of export_chunk_bytes, each announcing
  // exported.size() + export_extra_total bytes (non-zero: a stream cut short).
  std::string exported;
  size_t export_chunk_bytes = 4;
  uint64_t export_extra_total = 0;
  v1::CheckpointsRef export_ref;

  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest* request,
                          v1::CheckpointInfo* info) override {
    info->set_step(request->wait() ? 5 : 6);
    info->set_path("/ckpt/" + request->job_id());
    info->set_committed(request->wait());
    return grpc::Status::OK;
  }

  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::CheckpointsRef* request,
                               v1::ListCheckpointsResponse* response) override {
    response->add_checkpoints()->set_path(request->checkpoint_dir() + "/" + request->job_name());
    response->set_error("disk full");
    return grpc::Status::OK;
  }

  grpc::Status ExportCheckpoint(grpc::ServerContext*, const v1::CheckpointsRef* request,
                                grpc::ServerWriter<v1::ExportChunk>* writer) override {
    std::lock_guard<std::mutex> lock(mu);
    export_ref = *request;
    if (request->step() == 99) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no checkpoint of step 99");
    }
    for (size_t offset = 0; offset < exported.size(); offset += export_chunk_bytes) {
      v1::ExportChunk chunk;
      chunk.set_data(exported.substr(offset, export_chunk_bytes));
      chunk.set_total_bytes(exported.size() + export_extra_total);
      chunk.set_step(request->step() > 0 ? request->step() : 12);
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
};

struct FakeDaemon {
  FakeTrainingService service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<Client> client;

  explicit FakeDaemon(ClientOptions options = {}) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service);
    builder.SetMaxReceiveMessageSize(64 << 20);
    server = builder.BuildAndStart();
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    client = std::make_unique<Client>(server->InProcessChannel(args), "in-process", options);
  }
  ~FakeDaemon() { server->Shutdown(); }
};

TEST_CASE("Client::CreateJob sends the spec, then the model in bounded chunks", "[client]") {
  ClientOptions options;
  options.model_chunk_bytes = 1000;
  FakeDaemon fake(options);
  std::string model(2500, 'm');
  model[1234] = 'x';
  JobConfig config;
  config.name = "tiny";
  config.mode.set_training(true);
  config.optimizer.set_type(v1::ADAMW);
  config.example_inputs = {HostTensor::FromVector<float>({1, 2, 3, 4}, {2, 2})};
  config.input_names = {"x"};
  absl::StatusOr<v1::CreateJobResponse> job = fake.client->CreateJob(model, config);
  REQUIRE(job.ok());
  CHECK(job->job_id() == "job-1");
  CHECK(fake.service.model == model);
  CHECK(fake.service.model_chunk_sizes == std::vector<size_t>{1000, 1000, 500});
  CHECK(fake.service.spec.name() == "tiny");
  CHECK(fake.service.spec.mode().training());
  CHECK(fake.service.spec.optimizer().type() == v1::ADAMW);
  CHECK(fake.service.spec.model_bytes() == 2500);
  REQUIRE(fake.service.spec.example_inputs_size() == 1);
  CHECK(fake.service.spec.example_inputs(0).data() == config.example_inputs[0].data);
  CHECK(fake.service.spec.input_names(0) == "x");

  config.example_inputs[0].shape = {3, 3};  // inconsistent with its bytes
  CHECK(fake.client->CreateJob(model, config).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Client::CreateJob maps load_deployment, config and dry_run into the spec",
          "[client]") {
  FakeDaemon fake;
  JobConfig config;
  config.example_inputs = {HostTensor::FromVector<float>({1, 2}, {1, 2})};
  (*config.options.mutable_config())["schedule"] = "gpipe";
  (*config.options.mutable_config())["mem_margin"] = "0.2";
  config.options.set_gather_inputs(true);
  config.config = {{"partition_num", "2"}, {"schedule", "1f1b"}};
  config.load_deployment = std::string("\x08\x01\0binary", 9);
  config.dry_run.set_num_devices(4);
  config.dry_run.set_device_memory_bytes(80ull << 30);
  config.dry_run.set_batch_size(64);
  config.dry_run.set_links("p2p=300GB/s");
  REQUIRE(fake.client->CreateJob("model", config).ok());
  const v1::JobSpec& spec = fake.service.spec;
  CHECK(spec.options().gather_inputs());
  CHECK(spec.options().load_deployment() == config.load_deployment);
  CHECK(spec.options().config().size() == 3);
  CHECK(spec.options().config().at("partition_num") == "2");
  CHECK(spec.options().config().at("schedule") == "1f1b");  // JobConfig::config wins
  CHECK(spec.options().config().at("mem_margin") == "0.2");
  CHECK(spec.dry_run().num_devices() == 4);
  CHECK(spec.dry_run().device_memory_bytes() == (80ull << 30));
  CHECK(spec.dry_run().batch_size() == 64);
  CHECK(spec.dry_run().links() == "p2p=300GB/s");

  // Left empty, they leave the options alone and ask for no dry run.
  JobConfig plain;
  plain.options.set_load_deployment("from options");
  REQUIRE(fake.client->CreateJob("model", plain).ok());
  CHECK(fake.service.spec.options().load_deployment() == "from options");
  CHECK(fake.service.spec.options().config().empty());
  CHECK(!fake.service.spec.has_dry_run());
}

TEST_CASE("Client::CreateJob with an empty model sends only the spec", "[client]") {
  FakeDaemon fake;
  v1::JobSpec spec;
  spec.set_name("empty");
  REQUIRE(fake.client->CreateJob("", spec).ok());
  CHECK(fake.service.model_chunk_sizes.empty());
  CHECK(fake.service.spec.model_bytes() == 0);
}

TEST_CASE("Client::Forward moves tensors both ways", "[client]") {
  FakeDaemon fake;
  absl::StatusOr<ForwardResult> out =
      fake.client->Forward("job-1", {HostTensor::FromVector<float>({1, -2, 3}, {3, 1})});
  REQUIRE(out.ok());
  CHECK(out->forward_id == 7);
  REQUIRE(out->outputs.size() == 1);
  CHECK(out->outputs[0].shape == std::vector<int64_t>{3, 1});
  CHECK(*out->outputs[0].ToVector<float>() == std::vector<float>{2, -4, 6});
  CHECK(fake.client->Forward("job-1", {}, false)->forward_id == 8);
}

TEST_CASE("Client may be shared between threads", "[client]") {
  FakeDaemon fake;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const float v = static_cast<float>(t * 100 + i);
        absl::StatusOr<ForwardResult> out =
            fake.client->Forward("job-1", {HostTensor::FromVector<float>({v})});
        if (!out.ok() || *out->outputs.at(0).ToVector<float>() != std::vector<float>{2 * v}) {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(wrong == 0);
}

TEST_CASE("Client keeps the daemon's status code and message", "[client]") {
  FakeDaemon fake;
  absl::Status missing = fake.client->Forward("nope", {}).status();
  CHECK(missing.code() == absl::StatusCode::kNotFound);
  CHECK(missing.message() == "Forward: no job 'nope'");

  absl::Status early = fake.client->Backward("job-1", {{0, HostTensor::Scalar(1.0f)}});
  CHECK(early.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(early.message() == "Backward: backward before forward: call Forward first");

  // The fake does not implement Step: gRPC's own UNIMPLEMENTED comes through.
  CHECK(fake.client->Step("job-1", {}).code() == absl::StatusCode::kUnimplemented);
}

TEST_CASE("Client::StateDict reassembles chunked tensors", "[client]") {
  FakeDaemon fake;
  fake.service.state["weight"] = HostTensor::FromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  fake.service.state["running_mean"] = HostTensor::FromVector<double>({0.5, 0.25});
  fake.service.state["step"] = HostTensor::Scalar<int64_t>(42);
  absl::StatusOr<NamedTensors> state = fake.client->StateDict("job-1");
  REQUIRE(state.ok());
  REQUIRE(state->size() == 3);
  for (const auto& [name, tensor] : fake.service.state) {
    CHECK(state->at(name).dtype == tensor.dtype);
    CHECK(state->at(name).shape == tensor.shape);
    CHECK(state->at(name).data == tensor.data);
  }
}

TEST_CASE("Client::LoadStateDict streams a header, then chunks within the limit", "[client]") {
  ClientOptions options;
  options.state_dict_chunk_bytes = 4 << 20;
  FakeDaemon fake(options);
  NamedTensors state;
  std::vector<float> big((9 << 20) / 4 + 3);  // 9 MiB + 12 bytes: three chunks
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  state["big"] = HostTensor::FromVector(big);
  state["small"] = HostTensor::FromVector<int64_t>({1, 2, 3});
  absl::StatusOr<LoadStateDictResult> result =
      fake.client->LoadStateDict("job-1", state, true, {"small"});
  REQUIRE(result.ok());
  CHECK(result->missing_keys == std::vector<std::string>{"bias"});
  CHECK(fake.service.loaded_job == "job-1");

  HostStateDictAssembler assembler;
  size_t big_chunks = 0;
  for (const v1::StateDictChunk& c : fake.service.loaded_chunks) {
    CHECK(c.data().size() <= options.state_dict_chunk_bytes);
    CHECK(c.is_buffer() == (c.name() == "small"));
    big_chunks += c.name() == "big";
    REQUIRE(assembler.Add(c).ok());
  }
  CHECK(big_chunks == 3);
  absl::StatusOr<NamedTensors> received = std::move(assembler).Finish();
  REQUIRE(received.ok());
  CHECK(received->at("big").data == state["big"].data);
  CHECK(received->at("small").data == state["small"].data);
}

TEST_CASE("Client::GetParam and GetParamGrad", "[client]") {
  FakeDaemon fake;
  absl::StatusOr<HostTensor> value = fake.client->GetParam("job-1", "w");
  REQUIRE(value.ok());
  CHECK(*value->ToVector<float>() == std::vector<float>{1, 2});
  absl::StatusOr<std::optional<HostTensor>> grad = fake.client->GetParamGrad("job-1", "w");
  REQUIRE(grad.ok());
  CHECK(!grad->has_value());
  absl::StatusOr<double> norm = fake.client->ClipGradNorm("job-1", 1.5, 2.0);
  REQUIRE(norm.ok());
  CHECK(*norm == 17.0);
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string TestTmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr && *dir != '\0' ? dir : "/tmp";
}

TEST_CASE("Client::Checkpoint and ListCheckpoints pass the request and answer through",
          "[client]") {
  FakeDaemon fake;
  absl::StatusOr<v1::CheckpointInfo> waited = fake.client->Checkpoint("job-1");
  REQUIRE(waited.ok());
  CHECK(waited->step() == 5);
  CHECK(waited->committed());
  CHECK(waited->path() == "/ckpt/job-1");
  absl::StatusOr<v1::CheckpointInfo> async = fake.client->Checkpoint("job-1", /*wait=*/false);
  REQUIRE(async.ok());
  CHECK(async->step() == 6);
  CHECK(!async->committed());

  v1::CheckpointsRef ref;
  ref.set_job_name("gpt");
  ref.set_checkpoint_dir("/data");
  absl::StatusOr<v1::ListCheckpointsResponse> list = fake.client->ListCheckpoints(ref);
  REQUIRE(list.ok());
  REQUIRE(list->checkpoints_size() == 1);
  CHECK(list->checkpoints(0).path() == "/data/gpt");
  CHECK(list->error() == "disk full");
}

TEST_CASE("Client::ExportCheckpoint writes the stream to the file through a .tmp", "[client]") {
  FakeDaemon fake;
  fake.service.exported = std::string("0123456789abc\0\xff", 15);  // four chunks, the last short
  const std::string out = TestTmpDir() + "/export_test.pt";
  std::remove(out.c_str());
  v1::CheckpointsRef ref;
  ref.set_job_id("job-1");
  absl::StatusOr<int64_t> step = fake.client->ExportCheckpoint(ref, out);
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  CHECK(*step == 12);  // the newest, as the daemon says
  CHECK(Slurp(out) == fake.service.exported);
  CHECK(!Exists(out + ".tmp"));
  CHECK(fake.service.export_ref.job_id() == "job-1");

  ref.set_step(7);
  REQUIRE(fake.client->ExportCheckpoint(ref, out).ok());
  CHECK(fake.service.export_ref.step() == 7);
  std::remove(out.c_str());

  SECTION("a stream short of its total_bytes is DATA_LOSS and leaves no file") {
    fake.service.export_extra_total = 3;
    absl::StatusOr<int64_t> short_stream = fake.client->ExportCheckpoint(ref, out);
    CHECK(short_stream.status().code() == absl::StatusCode::kDataLoss);
    CHECK(short_stream.status().message() ==
          "ExportCheckpoint: received 15 of the 18 bytes of step 7");
    CHECK(!Exists(out));
    CHECK(!Exists(out + ".tmp"));
  }
  SECTION("a stream that announces fewer bytes than it sends is DATA_LOSS") {
    fake.service.exported = std::string(10, 'x');
    fake.service.export_extra_total = static_cast<uint64_t>(-4);  // announces 6
    CHECK(fake.client->ExportCheckpoint(ref, out).status().code() ==
          absl::StatusCode::kDataLoss);
    CHECK(!Exists(out));
    CHECK(!Exists(out + ".tmp"));
  }
  SECTION("an empty stream is DATA_LOSS") {
    fake.service.exported.clear();
    CHECK(fake.client->ExportCheckpoint(ref, out).status().code() ==
          absl::StatusCode::kDataLoss);
    CHECK(!Exists(out));
  }
  SECTION("the daemon's error comes through, and no file is left") {
    ref.set_step(99);
    absl::Status missing = fake.client->ExportCheckpoint(ref, out).status();
    CHECK(missing.code() == absl::StatusCode::kNotFound);
    CHECK(missing.message() == "ExportCheckpoint: no checkpoint of step 99");
    CHECK(!Exists(out));
    CHECK(!Exists(out + ".tmp"));
  }
  SECTION("an unwritable path fails before the daemon is asked") {
    const std::string nowhere = TestTmpDir() + "/no/such/dir/out.pt";
    fake.service.export_ref.Clear();
    absl::Status s = fake.client->ExportCheckpoint(ref, nowhere).status();
    CHECK(s.code() == absl::StatusCode::kNotFound);
    CHECK(s.message().find(nowhere + ".tmp") != std::string::npos);
    CHECK(fake.service.export_ref.step() == 0);  // never called
  }
}

bool SameCall(const v1::CallId& a, const v1::CallId& b) {
  return a.client_id() == b.client_id() && a.seq() == b.seq();
}

// ClientOptions whose on_retry counts the retries into `retries`.
ClientOptions CountingRetries(std::atomic<int>* retries,
                              absl::Duration bound = absl::Seconds(30)) {
  ClientOptions options;
  options.call_retry_timeout = bound;
  options.on_retry = [retries](absl::string_view, const absl::Status&) { ++*retries; };
  return options;
}

TEST_CASE("Client numbers mutating calls and retries a lost answer with the same CallId",
          "[client][retry]") {
  std::atomic<int> retries{0};
  FakeDaemon fake(CountingRetries(&retries));
  fake.service.forward_drops = 2;
  absl::StatusOr<ForwardResult> out =
      fake.client->Forward("job-1", {HostTensor::FromVector<float>({1.5f})});
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  CHECK(*out->outputs.at(0).ToVector<float>() == std::vector<float>{3.0f});
  CHECK(retries == 2);
  const std::vector<v1::CallId>& calls = fake.service.forward_calls;
  REQUIRE(calls.size() == 3);
  CHECK(calls[0].client_id().size() == 32);  // 128 bits in hex
  CHECK(calls[0].seq() == 1);
  CHECK(SameCall(calls[1], calls[0]));
  CHECK(SameCall(calls[2], calls[0]));

  // The next call of this thread: the same client id, the next number; other mutating calls
  // share the numbering.
  REQUIRE(fake.client->Forward("job-1", {}).ok());
  REQUIRE(fake.client->ZeroGrad("job-1").ok());
  REQUIRE(calls.size() == 4);
  CHECK(calls[3].client_id() == calls[0].client_id());
  CHECK(calls[3].seq() == 2);
  REQUIRE(fake.service.zero_grad_calls.size() == 1);
  CHECK(fake.service.zero_grad_calls[0].client_id() == calls[0].client_id());
  CHECK(fake.service.zero_grad_calls[0].seq() == 3);

  // Another thread numbers its calls under a client id of its own.
  bool other_thread_ok = false;
  std::thread([&] { other_thread_ok = fake.client->Forward("job-1", {}).ok(); }).join();
  REQUIRE(other_thread_ok);
  REQUIRE(calls.size() == 5);
  CHECK(calls[4].client_id() != calls[0].client_id());
  CHECK(calls[4].client_id().size() == 32);
  CHECK(calls[4].seq() == 1);
  // And another Client is another client.
  FakeDaemon other;
  REQUIRE(other.client->Forward("job-1", {}).ok());
  REQUIRE(other.service.forward_calls.size() == 1);
  CHECK(other.service.forward_calls[0].client_id() != calls[0].client_id());

  // A deadline that passed is retried too, and read-only calls carry no CallId.
  fake.service.zero_grad_answers.push_back(
      {grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "too slow"), false});
  REQUIRE(fake.client->ZeroGrad("job-1").ok());
  CHECK(retries == 3);
  REQUIRE(fake.service.zero_grad_calls.size() == 3);
  CHECK(SameCall(fake.service.zero_grad_calls[1], fake.service.zero_grad_calls[2]));
  CHECK(fake.service.zero_grad_calls[1].seq() == 4);
}

TEST_CASE("Client::LoadStateDict sends the whole stream again on a retry", "[client][retry]") {
  std::atomic<int> retries{0};
  ClientOptions options = CountingRetries(&retries);
  options.state_dict_chunk_bytes = 8;
  FakeDaemon fake(options);
  fake.service.load_drops = 1;
  NamedTensors state;
  state["weight"] = HostTensor::FromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});  // 3 chunks
  state["bias"] = HostTensor::FromVector<float>({7});
  absl::StatusOr<LoadStateDictResult> result = fake.client->LoadStateDict("job-1", state);
  INFO(result.status().ToString());
  REQUIRE(result.ok());
  CHECK(result->missing_keys == std::vector<std::string>{"bias"});
  CHECK(retries == 1);
  REQUIRE(fake.service.load_calls.size() == 2);
  CHECK(fake.service.load_calls[0].seq() == 1);
  CHECK(!fake.service.load_calls[0].client_id().empty());
  CHECK(SameCall(fake.service.load_calls[0], fake.service.load_calls[1]));
  CHECK(fake.service.load_chunk_counts == std::vector<size_t>{4, 4});
  HostStateDictAssembler assembler;
  for (const v1::StateDictChunk& c : fake.service.loaded_chunks) REQUIRE(assembler.Add(c).ok());
  absl::StatusOr<NamedTensors> received = std::move(assembler).Finish();
  REQUIRE(received.ok());
  CHECK(received->at("weight").data == state["weight"].data);
  CHECK(received->at("bias").data == state["bias"].data);
}

TEST_CASE("Client's retries stop after call_retry_timeout with the cause", "[client][retry]") {
  std::atomic<int> retries{0};
  FakeDaemon fake(CountingRetries(&retries, absl::Milliseconds(400)));
  for (int i = 0; i < 100; ++i) {
    fake.service.zero_grad_answers.push_back(
        {grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon restarting"), false});
  }
  const absl::Time start = absl::Now();
  absl::Status s = fake.client->ZeroGrad("job-1");
  const absl::Duration took = absl::Now() - start;
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  INFO(s.message());
  CHECK(s.message().find("ZeroGrad: cannot reach ranncd at in-process: daemon restarting") == 0);
  // Backoff 50, 100, 200 ms; the next, 400 ms, would end past the bound.
  CHECK(s.message().find("retries over") != std::string::npos);
  CHECK(retries >= 1);
  CHECK(retries <= 3);
  CHECK(took >= absl::Milliseconds(50));
  CHECK(took < absl::Milliseconds(400) + absl::Seconds(1));
  const std::vector<v1::CallId>& calls = fake.service.zero_grad_calls;
  REQUIRE(calls.size() == static_cast<size_t>(retries) + 1);
  for (const v1::CallId& call : calls) CHECK(SameCall(call, calls[0]));

  {  // zero: no retries
    std::atomic<int> none{0};
    FakeDaemon once(CountingRetries(&none, absl::ZeroDuration()));
    once.service.zero_grad_answers.push_back(
        {grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon restarting"), false});
    absl::Status failed = once.client->ZeroGrad("job-1");
    CHECK(failed.code() == absl::StatusCode::kUnavailable);
    CHECK(failed.message() == "ZeroGrad: cannot reach ranncd at in-process: daemon restarting");
    CHECK(none == 0);
    CHECK(once.service.zero_grad_calls.size() == 1);
  }
}

TEST_CASE("Client does not retry an error the daemon answered from its record",
          "[client][retry]") {
  std::atomic<int> retries{0};
  FakeDaemon fake(CountingRetries(&retries));
  // The call's own first answer was UNAVAILABLE (e.g. a peer daemon down): replayed, it stays.
  fake.service.zero_grad_answers.push_back(
      {grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon 10.0.0.2:7411 is down"), true});
  absl::Status s = fake.client->ZeroGrad("job-1");
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(s.message().find("daemon 10.0.0.2:7411 is down") != std::string::npos);
  CHECK(s.message().find("retries") == std::string::npos);
  CHECK(retries == 0);
  CHECK(fake.service.zero_grad_calls.size() == 1);

  // Neither is an error that is not a lost answer.
  fake.service.zero_grad_answers.push_back(
      {grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "older than its last call"), false});
  CHECK(fake.client->ZeroGrad("job-1").code() == absl::StatusCode::kFailedPrecondition);
  CHECK(retries == 0);
  CHECK(fake.service.zero_grad_calls.size() == 2);
}

TEST_CASE("Client::WaitUntilReady", "[client]") {
  FakeDaemon fake;
  CHECK(fake.client->WaitUntilReady(absl::Seconds(5)).ok());

  // Nothing listens on port 1 (tcpmux) here: the call must retry until its deadline, then fail.
  Client nobody("127.0.0.1:1");
  const absl::Time start = absl::Now();
  absl::Status s = nobody.WaitUntilReady(absl::Milliseconds(600));
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(s.message().find("127.0.0.1:1") != std::string::npos);
  CHECK(absl::Now() - start >= absl::Milliseconds(550));
  CHECK(absl::Now() - start < absl::Seconds(5));

  absl::Status unreachable = nobody.GetInfo().status();
  CHECK(unreachable.code() == absl::StatusCode::kUnavailable);
  CHECK(unreachable.message().find("cannot reach ranncd at 127.0.0.1:1") != std::string::npos);
}

}  // namespace
}  // namespace rannc
