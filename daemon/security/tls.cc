#include "daemon/security/tls.h"

#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rannc {
namespace security {
namespace {

absl::Status CheckPem(const std::string& path, const std::string& flag, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", path, ": cannot be read (", what, "; a PEM file this process can read)"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not PEM (", what,
                                                   "; expected a -----BEGIN ... block)"));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(
    const TlsFiles& files, std::chrono::seconds refresh) {
  const unsigned int seconds = static_cast<unsigned int>(std::max<int64_t>(1, refresh.count()));
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, seconds);
}

std::mutex peer_mu;
std::shared_ptr<grpc::ChannelCredentials>& PeerSlot() {
  static auto* slot = new std::shared_ptr<grpc::ChannelCredentials>();
  return *slot;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& flag, bool need_identity) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give ", flag, "-cert and ", flag, "-key together (a certificate and its private key)"));
  }
  if (need_identity && files.cert.empty() && files.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "-ca without ", flag, "-cert and ", flag, "-key: a TLS server needs its own "
        "certificate and key"));
  }
  if (!files.cert.empty()) {
    if (absl::Status s = CheckPem(files.cert, flag + "-cert", "a certificate chain"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckPem(files.key, flag + "-key", "a private key"); !s.ok()) return s;
  }
  if (!files.ca.empty()) {
    if (absl::Status s = CheckPem(files.ca, flag + "-ca", "root certificates"); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& files,
                                                           std::chrono::seconds refresh) {
  grpc::experimental::TlsServerCredentialsOptions options(Provider(files, refresh));
  options.watch_identity_key_cert_pairs();
  if (!files.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& files,
                                                             std::chrono::seconds refresh) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(files, refresh));
  if (!files.ca.empty()) options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

void SetPeerCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials) {
  std::lock_guard<std::mutex> lock(peer_mu);
  PeerSlot() = std::move(credentials);
}

std::shared_ptr<grpc::ChannelCredentials> PeerCredentials() {
  std::lock_guard<std::mutex> lock(peer_mu);
  if (!PeerSlot()) return grpc::InsecureChannelCredentials();
  return PeerSlot();
}

std::string PeerCertificate(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& name : auth->FindPropertyValues("x509_common_name")) {
    return std::string(name.data(), name.size());
  }
  return "(no common name)";
}

}  // namespace security
}  // namespace rannc
