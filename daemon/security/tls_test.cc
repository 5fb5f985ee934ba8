// TLS through gRPC with certificates made by openssl: who may connect, mutual TLS, rotation.
#include "daemon/security/tls.h"

#include <chrono>
#include <filesystem>
#include <thread>

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "daemon/security/tls_testing.h"
#include "rannc/v1/cluster.grpc.pb.h"

namespace rannc {
namespace security {
namespace {

using std::chrono::seconds;

// A service whose Heartbeat answers with the caller's certificate (PeerCertificate) as its
// address.
class WhoCalls final : public v1::ClusterService::Service {
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse* response) override {
    response->mutable_responder()->set_address(PeerCertificate(*context));
    return grpc::Status::OK;
  }
};

struct Server {
  explicit Server(std::shared_ptr<grpc::ServerCredentials> credentials) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
  }
  ~Server() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  WhoCalls service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// Whose certificate the server saw on a call with `credentials`.
std::string Caller(const Server& server, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  auto stub = v1::ClusterService::NewStub(grpc::CreateChannel(server.address(), credentials));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(5));
  v1::HeartbeatRequest request;
  v1::HeartbeatResponse response;
  grpc::Status status = stub->Heartbeat(&context, request, &response);
  REQUIRE(status.ok());
  return response.responder().address();
}

// Whether a channel with `credentials` completes its handshake within 3 s. A new channel each
// time (channels to one target with equal arguments would share a subchannel).
bool Connects(const Server& server, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  static int salt = 0;
  grpc::ChannelArguments args;
  args.SetInt("rannc.test.salt", ++salt);
  auto channel = grpc::CreateCustomChannel(server.address(), std::move(credentials), args);
  return channel->WaitForConnected(std::chrono::system_clock::now() + seconds(3));
}

TEST_CASE("TLS: the files are checked at start, with the flag and file named", "[tls]") {
  testing::TestCa ca;
  ca.Issue("server");
  CHECK(CheckTlsFiles({ca.cert("server"), ca.key("server"), ca.ca()}, "--tls", true).ok());
  CHECK(CheckTlsFiles({}, "--tls", true).ok());  // no TLS

  absl::Status s = CheckTlsFiles({ca.cert("server"), "", ""}, "--tls", true);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("--tls-cert and --tls-key together"));

  s = CheckTlsFiles({"", "", ca.ca()}, "--tls", true);
  CHECK_THAT(std::string(s.message()), Catch::Contains("needs its own certificate"));
  CHECK(CheckTlsFiles({"", "", ca.ca()}, "RANNC_TLS", false).ok());  // a client's CA alone

  s = CheckTlsFiles({ca.dir() + "/missing.crt", ca.key("server"), ""}, "--tls", true);
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("--tls-cert " + ca.dir() + "/missing.crt: cannot be read"));
  s = CheckTlsFiles({ca.cert("server"), ca.key("server"), "/etc/hostname"}, "--tls", true);
  CHECK_THAT(std::string(s.message()), Catch::Contains("--tls-ca /etc/hostname: not PEM"));
}

TEST_CASE("TLS: a client trusting the CA connects; another CA, or plain text, does not",
          "[tls]") {
  testing::TestCa ca, other;
  ca.Issue("server");
  other.Issue("stranger");
  Server server(ServerCredentials({ca.cert("server"), ca.key("server"), ""}, seconds(1)));
  CHECK(Connects(server, ChannelCredentials({"", "", ca.ca()}, seconds(1))));
  CHECK_FALSE(Connects(server, ChannelCredentials({"", "", other.ca()}, seconds(1))));
  CHECK_FALSE(Connects(server, grpc::InsecureChannelCredentials()));
}

TEST_CASE("TLS: mutual TLS checks a client certificate that is given; clients may give none",
          "[tls]") {
  testing::TestCa ca, other;
  ca.Issue("daemon-a");
  ca.Issue("daemon-b");
  other.Issue("stranger");
  Server server(ServerCredentials({ca.cert("daemon-a"), ca.key("daemon-a"), ca.ca()},
                                  seconds(1)));
  // Another daemon of the cluster, and a user's client with the CA alone.
  const TlsFiles daemon_b{ca.cert("daemon-b"), ca.key("daemon-b"), ca.ca()};
  CHECK(Connects(server, ChannelCredentials(daemon_b, seconds(1))));
  CHECK(Caller(server, ChannelCredentials(daemon_b, seconds(1))) == "daemon-b");
  CHECK(Connects(server, ChannelCredentials({"", "", ca.ca()}, seconds(1))));
  CHECK(Caller(server, ChannelCredentials({"", "", ca.ca()}, seconds(1))).empty());
  // A certificate of another CA is refused, though the client trusts the server.
  std::filesystem::copy_file(ca.ca(), other.dir() + "/trusted.crt");
  CHECK_FALSE(Connects(server, ChannelCredentials({other.cert("stranger"),
                                                   other.key("stranger"),
                                                   other.dir() + "/trusted.crt"},
                                                  seconds(1))));
}

TEST_CASE("TLS: a rotated certificate is used without a restart; an unreadable one keeps the "
          "last", "[tls]") {
  testing::TestCa first, second;
  first.Issue("server");
  second.Issue("server");
  // The server reads its files from a directory of its own, which the test rewrites.
  testing::TestCa live;
  const std::string cert = live.dir() + "/tls.crt", key = live.dir() + "/tls.key";
  auto install = [&](const testing::TestCa& from) {
    std::filesystem::copy_file(from.cert("server"), cert + ".new");
    std::filesystem::copy_file(from.key("server"), key + ".new");
    std::filesystem::rename(key + ".new", key);
    std::filesystem::rename(cert + ".new", cert);
  };
  install(first);
  Server server(ServerCredentials({cert, key, ""}, seconds(1)));
  CHECK(Connects(server, ChannelCredentials({"", "", first.ca()}, seconds(1))));
  CHECK_FALSE(Connects(server, ChannelCredentials({"", "", second.ca()}, seconds(1))));

  install(second);
  bool rotated = false;
  for (int i = 0; i < 10 && !rotated; ++i) {
    std::this_thread::sleep_for(seconds(1));
    rotated = Connects(server, ChannelCredentials({"", "", second.ca()}, seconds(1)));
  }
  CHECK(rotated);
  CHECK_FALSE(Connects(server, ChannelCredentials({"", "", first.ca()}, seconds(1))));

  // The files go (a rotation half done): the server goes on with the certificate it has.
  std::filesystem::remove(cert);
  std::filesystem::remove(key);
  std::this_thread::sleep_for(seconds(2));
  CHECK(Connects(server, ChannelCredentials({"", "", second.ca()}, seconds(1))));
}

}  // namespace
}  // namespace security
}  // namespace rannc
