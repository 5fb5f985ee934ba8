#include "daemon/metrics/metrics.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include <catch2/catch.hpp>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <prometheus/metric_family.h>

#include "daemon/metrics/http_testing.h"
#include "daemon/metrics/rpc_metrics.h"

namespace rannc {
namespace metrics {
namespace {

using Catch::Contains;

DaemonSample OneJob() {
  DaemonSample s;
  s.version = "0.1.0";
  DaemonSample::Job j;
  j.name = "gpt";
  j.m.steps = 12;
  j.m.tokens = 4096;
  j.m.tokens_per_s = 2048;
  j.m.device_bytes = {100, 200};
  j.m.peak_device_bytes = {150, 260};
  j.m.step_buckets.assign(JobMetrics::StepBuckets().size(), 0);
  j.m.step_buckets.back() = 3;
  j.m.step_count = 4;
  j.m.step_sum_s = 5.5;
  j.m.planned_step_s = 0.25;
  j.m.bubble = 0.125;
  j.m.data_plane_bytes = 1 << 20;
  j.m.busy_by_call_s[static_cast<int>(JobMetrics::Call::kStep)] = 0.5;
  s.jobs.push_back(j);
  j.m = JobMetrics::Snapshot();
  s.jobs.push_back(j);  // a second job of the same name
  s.jobs_by_state = {{"DEPLOYED", 2}, {"SUSPENDED", 0}};
  s.detached_queued = 1;
  s.members_up = 2;
  s.members_down = 1;
  return s;
}

TEST_CASE("Families: per-job and per-daemon metrics in Prometheus text", "[metrics]") {
  RpcMetrics rpcs;
  rpcs.Record("rannc.v1.TrainingService/Forward", "OK", 0.003);
  rpcs.Record("rannc.v1.TrainingService/Forward", "OK", 0.3);
  rpcs.Record("rannc.v1.TrainingService/Forward", "NOT_FOUND", 0.0001);
  const std::string text = Text(Families(OneJob(), &rpcs));
  INFO(text);
  CHECK_THAT(text, Contains("# TYPE rannc_job_steps_total counter"));
  CHECK_THAT(text, Contains("rannc_job_steps_total{rannc_job=\"gpt\"} 12"));
  CHECK_THAT(text, Contains("rannc_job_steps_total{rannc_job=\"gpt#2\"} 0"));
  CHECK_THAT(text, Contains("rannc_job_tokens_total{rannc_job=\"gpt\"} 4096"));
  CHECK_THAT(text, Contains("rannc_job_tokens_per_second{rannc_job=\"gpt\"} 2048"));
  CHECK_THAT(text, Contains("rannc_job_device_memory_bytes{rannc_job=\"gpt\"} 300"));
  CHECK_THAT(text, Contains("rannc_job_device_memory_peak_bytes{rannc_job=\"gpt\"} 260"));
  CHECK_THAT(text, Contains("rannc_job_planned_step_seconds{rannc_job=\"gpt\"} 0.25"));
  CHECK_THAT(text, Contains("rannc_job_pipeline_bubble_ratio{rannc_job=\"gpt\"} 0.125"));
  CHECK_THAT(text, Contains("rannc_job_data_plane_bytes_total{rannc_job=\"gpt\"} 1048576"));
  CHECK_THAT(text, Contains("rannc_job_call_busy_seconds{rannc_job=\"gpt\",call=\"step\"} 0.5"));
  CHECK_THAT(text, Contains("rannc_job_call_busy_seconds{rannc_job=\"gpt\",call=\"forward\"} 0"));
  CHECK_THAT(text, Contains("# TYPE rannc_job_step_seconds histogram"));
  CHECK_THAT(text, Contains("rannc_job_step_seconds_bucket{rannc_job=\"gpt\",le=\"300\"} 3"));
  CHECK_THAT(text, Contains("rannc_job_step_seconds_bucket{rannc_job=\"gpt\",le=\"+Inf\"} 4"));
  CHECK_THAT(text, Contains("rannc_job_step_seconds_count{rannc_job=\"gpt\"} 4"));
  CHECK_THAT(text, Contains("rannc_job_step_seconds_sum{rannc_job=\"gpt\"} 5.5"));
  CHECK_THAT(text, Contains("rannc_jobs{state=\"DEPLOYED\"} 2"));
  CHECK_THAT(text, Contains("rannc_jobs{state=\"SUSPENDED\"} 0"));
  CHECK_THAT(text, Contains("rannc_detached_jobs_queued 1"));
  CHECK_THAT(text, Contains("rannc_cluster_members{status=\"down\"} 1"));
  CHECK_THAT(text, Contains("rannc_build_info{version=\"0.1.0\"} 1"));
  CHECK_THAT(text, Contains("rannc_grpc_server_handled_total{method=\"rannc.v1.TrainingService/"
                            "Forward\",code=\"OK\"} 2"));
  CHECK_THAT(text, Contains("rannc_grpc_server_handled_total{method=\"rannc.v1.TrainingService/"
                            "Forward\",code=\"NOT_FOUND\"} 1"));
  CHECK_THAT(text, Contains("rannc_grpc_server_handling_seconds_bucket{method=\"rannc.v1."
                            "TrainingService/Forward\",le=\"0.005\"} 2"));
  CHECK_THAT(text, Contains("rannc_grpc_server_handling_seconds_count{method=\"rannc.v1."
                            "TrainingService/Forward\"} 3"));
}

TEST_CASE("MetricsServer: serves the families over HTTP at each scrape", "[metrics]") {
  int scrapes = 0;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(
      "127.0.0.1:0",
      [&] {
        ++scrapes;
        DaemonSample s = OneJob();
        s.jobs[0].m.steps = 100 + scrapes;
        return s;
      },
      nullptr);
  REQUIRE(server.ok());
  const std::string address = (*server)->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  REQUIRE(port > 0);
  std::string first = HttpExchange(port, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n");
  CHECK_THAT(first, Contains("200 OK"));
  CHECK_THAT(first, Contains("rannc_job_steps_total{rannc_job=\"gpt\"} 101"));
  std::string second = HttpExchange(port, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n");
  CHECK_THAT(second, Contains("rannc_job_steps_total{rannc_job=\"gpt\"} 102"));
  CHECK_THAT(HttpExchange(port, "GET /other HTTP/1.0\r\n\r\n"), Contains("404"));
}

TEST_CASE("MetricsServer: a bad or busy address is a clear error", "[metrics]") {
  auto none = [] { return DaemonSample(); };
  absl::StatusOr<std::unique_ptr<MetricsServer>> no_port =
      MetricsServer::Start("127.0.0.1", none, nullptr);
  CHECK(no_port.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(no_port.status().message()),
             Contains("--metrics-listen 127.0.0.1 is not HOST:PORT"));

  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("127.0.0.1:0", none, nullptr);
  REQUIRE(first.ok());
  absl::StatusOr<std::unique_ptr<MetricsServer>> busy =
      MetricsServer::Start((*first)->address(), none, nullptr);
  CHECK(busy.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(busy.status().message()),
             Contains("cannot listen on " + (*first)->address() + ": Address already in use"));
}

// A generic service that answers every call at once: OK for /test.Echo/Ok, NOT_FOUND otherwise.
class Answering : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    class Answer : public grpc::ServerGenericBidiReactor {
     public:
      explicit Answer(grpc::Status status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Answer(context->method() == "/test.Echo/Ok"
                          ? grpc::Status::OK
                          : grpc::Status(grpc::StatusCode::NOT_FOUND, "no such method"));
  }
};

TEST_CASE("RpcMetrics: a real server's calls are counted by method and code", "[metrics]") {
  RpcMetrics rpcs;
  Answering service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(rpcs.InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(factories));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials());
  auto call = [&](const std::string& method) {
    grpc::GenericStub stub(channel);
    grpc::ClientContext context;
    grpc::Slice slice(std::string("x"));
    grpc::ByteBuffer in(&slice, 1), out;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &in, &out, [&](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      status = s;
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return status.error_code();
  };
  CHECK(call("/test.Echo/Ok") == grpc::StatusCode::OK);
  CHECK(call("/test.Echo/Ok") == grpc::StatusCode::OK);
  CHECK(call("/test.Echo/Other") == grpc::StatusCode::NOT_FOUND);
  server->Shutdown();
  RpcMetrics::Snapshot s = rpcs.Read();
  CHECK(s.handled[{"test.Echo/Ok", "OK"}] == 2);
  CHECK(s.handled[{"test.Echo/Other", "NOT_FOUND"}] == 1);
  CHECK(s.latency["test.Echo/Ok"].count == 2);
}

}  // namespace
}  // namespace metrics
}  // namespace rannc
