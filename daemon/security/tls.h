// TLS for ranncd's gRPC (issue 24): its server (--tls-cert, --tls-key, --tls-ca), the calls its
// daemons make to each other (mutual TLS under the cluster's CA), and clients (the C++ SDK and
// the CLI; pyrannc does the same in Python).
//
//   TlsFiles files{"/etc/rannc/tls.crt", "/etc/rannc/tls.key", "/etc/rannc/ca.crt"};
//   absl::Status ok = CheckTlsFiles(files, "--tls");                    // at start: clear errors
//   builder.AddListeningPort(addr, ServerCredentials(files, seconds(10)));
//   SetPeerCredentials(ChannelCredentials(files, seconds(10)));         // daemon -> daemon
//   auto channel = grpc::CreateChannel(peer, PeerCredentials());
//
// Certificates are read through gRPC's FileWatcherCertificateProvider: the files are read again
// every `refresh`, and a change is used by the next handshake, so a rotated Kubernetes secret
// needs no restart. A file that goes missing or unreadable (or holds no PEM) then leaves the
// last good certificate in use; gRPC logs the failure.
//
// With a CA, the server asks each caller for a certificate and, if one is given, checks that it
// chains to the CA: daemons present theirs (PeerCertificate says whose it was), users' clients
// need not (they authenticate with tokens, auth.h).
#ifndef RANNC_DAEMON_SECURITY_TLS_H_
#define RANNC_DAEMON_SECURITY_TLS_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace grpc {
class ChannelCredentials;
class ServerContext;
class ServerCredentials;
}  // namespace grpc

namespace rannc {
namespace security {

struct TlsFiles {
  std::string cert;  // PEM certificate chain of this process
  std::string key;   // its PEM private key
  std::string ca;    // PEM root certificate(s) the other side's certificate must chain to
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The files as given at start: cert and key both or neither; each readable and PEM.
// INVALID_ARGUMENT naming the flag (`flag` + "-cert", "-key", "-ca") and the file.
// `need_identity`: a server needs cert and key.
absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& flag, bool need_identity);

// A TLS server with files.cert/key; with files.ca, callers' certificates are requested and, when
// given, verified against it.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& files,
                                                           std::chrono::seconds refresh);

// A TLS channel that verifies the server against files.ca (the system's roots when empty) and
// presents files.cert/key when given (mutual TLS). Insecure credentials when !files.enabled().
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& files,
                                                             std::chrono::seconds refresh);

// What this daemon's calls to other daemons use (cluster heartbeats, job parts, stores, peer
// stubs): insecure until set, once, at start, before any such call.
void SetPeerCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials);
std::shared_ptr<grpc::ChannelCredentials> PeerCredentials();

// The common name of the certificate the caller presented and the server verified (mutual TLS:
// another daemon of the cluster); "" for a caller without one, or on a plaintext server.
std::string PeerCertificate(const grpc::ServerContext& context);

}  // namespace security
}  // namespace rannc

#endif  // RANNC_DAEMON_SECURITY_TLS_H_
