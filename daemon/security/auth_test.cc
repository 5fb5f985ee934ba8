// Tokens: every RPC has a rule; who may call what; the admin token file; constant-time compare.
#include "daemon/security/auth.h"

#include <cstdio>
#include <fstream>
#include <set>

#include <google/protobuf/descriptor.h>

#include <catch2/catch.hpp>

#include "rannc/v1/cluster.grpc.pb.h"
#include "rannc/v1/job_part.grpc.pb.h"
#include "rannc/v1/store.grpc.pb.h"
#include "rannc/v1/training.grpc.pb.h"

namespace rannc {
namespace security {
namespace {

std::string Write(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp ? tmp : "/tmp") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST_CASE("Every RPC of rannc.v1 has an authorization rule, and every rule an RPC", "[auth]") {
  // Linked in, the generated services are in the pool.
  const google::protobuf::DescriptorPool* pool =
      google::protobuf::DescriptorPool::generated_pool();
  std::set<std::string> methods;
  for (const char* service : {"rannc.v1.TrainingService", "rannc.v1.JobPartService",
                              "rannc.v1.StoreService", "rannc.v1.ClusterService"}) {
    const google::protobuf::ServiceDescriptor* s = pool->FindServiceByName(service);
    REQUIRE(s != nullptr);
    for (int i = 0; i < s->method_count(); ++i) {
      const std::string full = "/" + std::string(service) + "/" + s->method(i)->name();
      methods.insert(full);
      INFO(full << " has no rule in security::MethodAccess (auth.cc): add one");
      CHECK(MethodAccess().count(full) == 1);
    }
  }
  for (const auto& [method, access] : MethodAccess()) {
    INFO(method << " is no RPC");
    CHECK(methods.count(method) == 1);
  }
  CHECK(methods.size() > 50);
}

TEST_CASE("Who may call what", "[auth]") {
  const std::string file = Write("admin.token", "0123456789abcdef-admin\n");
  auto made = Authorizer::FromFile(file);
  REQUIRE(made.ok());
  Authorizer& auth = **made;
  CHECK(auth.enabled());
  const std::string a = auth.IssueJobToken("job-a", "gpt");
  CHECK(a.rfind("rj1.job-a.", 0) == 0);
  CHECK(auth.JobToken("job-a") == a);
  const std::string step = "/rannc.v1.TrainingService/Step";

  Caller none;
  CHECK(auth.Allow(none, step, "job-a", "").code() == absl::StatusCode::kUnauthenticated);
  CHECK(auth.Authenticated(none, step).code() == absl::StatusCode::kUnauthenticated);
  Caller invalid;
  invalid.kind = Caller::Kind::kInvalid;
  CHECK(auth.Allow(invalid, step, "job-a", "").code() == absl::StatusCode::kUnauthenticated);

  Caller admin;
  admin.kind = Caller::Kind::kAdmin;
  for (const auto& [method, access] : MethodAccess()) {
    CHECK(auth.Allow(admin, method, "job-b", "other").ok());
  }

  Caller job_a;
  job_a.kind = Caller::Kind::kJob;
  job_a.job_id = "job-a";
  job_a.job_name = "gpt";
  CHECK(auth.Allow(job_a, step, "job-a", "").ok());
  absl::Status other = auth.Allow(job_a, step, "job-b", "");
  CHECK(other.code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(other.message()), Catch::Contains("job job-a's") &&
                                               !Catch::Contains(a.substr(10)));
  CHECK(auth.Allow(job_a, "/rannc.v1.TrainingService/JoinJob", "", "gpt").ok());
  CHECK(auth.Allow(job_a, "/rannc.v1.TrainingService/JoinJob", "", "bert").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(auth.Allow(job_a, "/rannc.v1.TrainingService/ListCheckpoints", "", "gpt").ok());
  CHECK(auth.Allow(job_a, "/rannc.v1.TrainingService/GetInfo", "", "").ok());
  CHECK(auth.Allow(job_a, "/rannc.v1.TrainingService/CreateJob", "", "").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(auth.Allow(job_a, "/rannc.v1.JobPartService/Forward", "job-a", "").code() ==
        absl::StatusCode::kPermissionDenied);

  Caller daemon;
  daemon.kind = Caller::Kind::kPeer;
  daemon.peer = "node-b";
  CHECK(auth.Allow(daemon, "/rannc.v1.JobPartService/Forward", "", "").ok());
  CHECK(auth.Allow(daemon, "/rannc.v1.ClusterService/Heartbeat", "", "").ok());
  CHECK(auth.Allow(daemon, step, "job-a", "").code() == absl::StatusCode::kPermissionDenied);

  CHECK(auth.Allow(admin, "/rannc.v1.TrainingService/NoSuchCall", "", "").code() ==
        absl::StatusCode::kInternal);

  auth.ForgetJob("job-a");
  CHECK(auth.JobToken("job-a").empty());
}

TEST_CASE("Without a token file every call is allowed", "[auth]") {
  auto open = Authorizer::FromFile("");
  REQUIRE(open.ok());
  CHECK_FALSE((*open)->enabled());
  CHECK((*open)->Allow(Caller(), "/rannc.v1.TrainingService/CreateJob", "", "").ok());
}

TEST_CASE("The admin token file: missing, short, or a job token's shape is refused", "[auth]") {
  auto missing = Authorizer::FromFile("/nonexistent/admin.token");
  CHECK(missing.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(missing.status().message()),
             Catch::Contains("--auth-token-file /nonexistent/admin.token: cannot be read"));
  auto short_one = Authorizer::FromFile(Write("short.token", "abc\n"));
  CHECK_THAT(std::string(short_one.status().message()), Catch::Contains("give at least 16"));
  auto job_shaped = Authorizer::FromFile(Write("job.token", "rj1.job-a.0123456789abcdef\n"));
  CHECK_THAT(std::string(job_shaped.status().message()), Catch::Contains("must not start"));
  auto spaced = Authorizer::FromFile(Write("spaced.token", "  0123456789abcdefXYZ  \nrest\n"));
  REQUIRE(spaced.ok());
  CHECK((*spaced)->admin_token() == "0123456789abcdefXYZ");
}

TEST_CASE("ConstantTimeEqual compares whole strings", "[auth]") {
  CHECK(ConstantTimeEqual("abc", "abc"));
  CHECK_FALSE(ConstantTimeEqual("abc", "abd"));
  CHECK_FALSE(ConstantTimeEqual("abc", "ab"));
  CHECK(ConstantTimeEqual("", ""));
}

}  // namespace
}  // namespace security
}  // namespace rannc
