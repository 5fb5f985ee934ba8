// TLS through gRPC with certificates made by openssl: who may connect, mutual TLS, rotation.
#include "daemon/security/tls.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "daemon/security/tls_mirror.h"
#include "daemon/security/tls_testing.h"
#include "rannc/v1/cluster.grpc.pb.h"

namespace rannc {
namespace security {
namespace {

using testing::Read;
using testing::Replace;

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

// The common name of the certificate the server presents to a new channel with `credentials`;
// "" when the channel does not connect.
std::string Served(const Server& server, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  static int salt = 0;
  grpc::ChannelArguments args;
  args.SetInt("rannc.test.served", ++salt);
  auto stub = v1::ClusterService::NewStub(
      grpc::CreateCustomChannel(server.address(), std::move(credentials), args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(3));
  v1::HeartbeatRequest request;
  v1::HeartbeatResponse response;
  if (!stub->Heartbeat(&context, request, &response).ok()) return "";
  for (const grpc::string_ref& name :
       context.auth_context()->FindPropertyValues("x509_common_name")) {
    return std::string(name.data(), name.size());
  }
  return "(no common name)";
}

// Files that must not pass: garbage, a PEM cut in the middle, nothing.
std::string Garbage() { return "this is not a certificate\n"; }
std::string Truncated(const std::string& pem) { return pem.substr(0, pem.size() / 2); }

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

TEST_CASE("TLS: CheckTlsFiles parses the files as gRPC will: garbage, a truncated PEM, a key "
          "of another certificate, an empty file or a CA that is not PEM are named", "[tls]") {
  testing::TestCa ca;
  ca.Issue("one");
  ca.Issue("two");
  const std::string dir = ca.dir();
  const TlsFiles good{ca.cert("one"), ca.key("one"), ca.ca()};
  CHECK(CheckTlsFiles(good, "--tls", true).ok());
  CHECK(CheckTlsPem({Read(ca.cert("one")), Read(ca.key("one")), Read(ca.ca())}, good, "--tls")
            .ok());
  CHECK(DescribeCertificate(Read(ca.cert("one"))).rfind("CN=one, valid until ", 0) == 0);

  auto message = [&](const TlsFiles& files) {
    absl::Status s = CheckTlsFiles(files, "--tls", true);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  Replace(dir + "/garbage.crt", Garbage());
  CHECK_THAT(message({dir + "/garbage.crt", ca.key("one"), ""}),
             Catch::StartsWith("--tls-cert " + dir + "/garbage.crt: not PEM"));
  Replace(dir + "/truncated.crt", Truncated(Read(ca.cert("one"))));
  CHECK_THAT(message({dir + "/truncated.crt", ca.key("one"), ""}),
             Catch::StartsWith("--tls-cert " + dir + "/truncated.crt: a PEM block is cut short"));
  Replace(dir + "/truncated.key", Truncated(Read(ca.key("one"))));
  CHECK_THAT(message({ca.cert("one"), dir + "/truncated.key", ""}),
             Catch::StartsWith("--tls-key " + dir + "/truncated.key: a PEM block is cut short"));
  CHECK_THAT(message({ca.cert("one"), ca.key("two"), ""}),
             Catch::StartsWith("--tls-key " + ca.key("two") +
                               ": not the key of the certificate in --tls-cert " +
                               ca.cert("one") + " (CN=one"));
  Replace(dir + "/empty.crt", "");
  CHECK_THAT(message({dir + "/empty.crt", ca.key("one"), ""}),
             Catch::StartsWith("--tls-cert " + dir + "/empty.crt: empty"));
  CHECK_THAT(message({ca.cert("one"), dir + "/empty.crt", ""}),
             Catch::StartsWith("--tls-key " + dir + "/empty.crt: empty"));
  CHECK_THAT(message({ca.cert("one"), ca.key("one"), dir + "/garbage.crt"}),
             Catch::StartsWith("--tls-ca " + dir + "/garbage.crt: not PEM"));
  // A key where a certificate belongs, and the other way round.
  CHECK_THAT(message({ca.key("one"), ca.key("one"), ""}),
             Catch::StartsWith("--tls-cert " + ca.key("one") + ": holds no certificate"));
  CHECK_THAT(message({ca.cert("one"), ca.cert("one"), ""}),
             Catch::StartsWith("--tls-key " + ca.cert("one") + ": holds no private key"));
  // A certificate block whose contents are not a certificate.
  Replace(dir + "/bad-der.crt",
          "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  CHECK_THAT(message({dir + "/bad-der.crt", ca.key("one"), ""}),
             Catch::StartsWith("--tls-cert " + dir + "/bad-der.crt: certificate 1 of 1 does "
                               "not parse"));
  // One file holding the key and the certificate serves as both, as with gRPC alone.
  Replace(dir + "/both.pem", Read(ca.key("one")) + Read(ca.cert("one")));
  CHECK(CheckTlsFiles({dir + "/both.pem", dir + "/both.pem", ca.ca()}, "--tls", true).ok());
  const std::string both =
      KeyAndChainPem({Read(ca.cert("one")), Read(ca.key("one")), ""});
  CHECK(CheckTlsPem({both, both, ""}, {"both", "both", ""}, "--tls").ok());
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
  // Through checked copies, as the daemon calls its peers (tls_mirror.h).
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> copies =
      TlsFileMirror::Start(daemon_b, "--tls", {seconds(0), ca.dir()});
  REQUIRE(copies.ok());
  CHECK(Caller(server, ChannelCredentials((*copies)->files(), seconds(1))) == "daemon-b");
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

TEST_CASE("TLS: through checked copies, a rotated certificate is used, and a bad one (garbage, "
          "truncated, a key of another certificate) keeps the last good one", "[tls]") {
  testing::TestCa first, second;
  first.Issue("one");
  second.Issue("two");
  second.Issue("three");
  testing::TestCa live;
  const std::string cert = live.dir() + "/tls.crt", key = live.dir() + "/tls.key";
  // The client trusts both CAs: the name served says which certificate is in use.
  const std::string both_cas = live.dir() + "/both-cas.crt";
  Replace(both_cas, Read(first.ca()) + Read(second.ca()));
  auto client = [&] { return ChannelCredentials({"", "", both_cas}, seconds(1)); };
  auto install = [&](const std::string& cert_text, const std::string& key_text) {
    Replace(key, key_text);
    Replace(cert, cert_text);
  };
  install(Read(first.cert("one")), Read(first.key("one")));
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> mirror =
      TlsFileMirror::Start({cert, key, ""}, "--tls", {seconds(1), live.dir()});
  REQUIRE(mirror.ok());
  TlsFileMirror& copies = **mirror;
  Server server(ServerCredentials(copies.files(), seconds(1)));
  CHECK(Served(server, client()) == "one");

  // Until `name` is served to new connections (the mirror's and gRPC's refresh: 2 s at most).
  auto served_within = [&](const std::string& name) {
    for (int i = 0; i < 20; ++i) {
      if (Served(server, client()) == name) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    return false;
  };
  install(Read(second.cert("two")), Read(second.key("two")));
  CHECK(served_within("two"));

  // Each bad rotation: after both refreshes (2 s) and more, new connections still get "two".
  auto stays = [&](const std::string& text, const std::string& says) {
    Replace(cert, text);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    CHECK(Served(server, client()) == "two");
    CHECK_THAT(std::string(copies.last_error().message()), Catch::StartsWith(says));
    CHECK(copies.serving().rfind("CN=two,", 0) == 0);
  };
  stays(Garbage(), "--tls-cert " + cert + ": not PEM");
  stays(Truncated(Read(second.cert("three"))), "--tls-cert " + cert + ": a PEM block is cut");
  stays(Read(second.cert("three")),  // with the key of "two"
        "--tls-key " + key + ": not the key of the certificate in --tls-cert " + cert);

  // A good pair again is picked up.
  install(Read(second.cert("three")), Read(second.key("three")));
  CHECK(served_within("three"));
  CHECK(copies.last_error().ok());

  // The files go (a rotation half done): the server goes on with the certificate it has.
  std::filesystem::remove(cert);
  std::filesystem::remove(key);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  CHECK(Served(server, client()) == "three");
  CHECK_THAT(std::string(copies.last_error().message()),
             Catch::StartsWith("--tls-cert " + cert + ": cannot be read"));
}

}  // namespace
}  // namespace security
}  // namespace rannc
