// TLS for ranncd's gRPC (issue 24): its server (--tls-cert, --tls-key, --tls-ca), the calls its
// daemons make to each other (mutual TLS under the cluster's CA), and clients (the C++ SDK and
// the CLI; pyrannc does the same in Python).
//
//   TlsFiles files{"/etc/rannc/tls.crt", "/etc/rannc/tls.key", "/etc/rannc/ca.crt"};
//   absl::Status ok = CheckTlsFiles(files, "--tls", true);              // at start: clear errors
//   builder.AddListeningPort(addr, ServerCredentials(files, seconds(10)));
//   SetPeerCredentials(ChannelCredentials(files, seconds(10)));         // daemon -> daemon
// (the daemon passes its TlsFileMirror's files() instead of the user's: tls_mirror.h)
//   auto channel = grpc::CreateChannel(peer, PeerCredentials());
//
// Certificates are read through gRPC's FileWatcherCertificateProvider: the files are read again
// every `refresh`, and a change is used by the next handshake, so a rotated Kubernetes secret
// needs no restart. gRPC keeps the last good certificate when a file goes missing, but passes on
// one that is there and does not parse; the daemon therefore gives gRPC checked copies of its
// files (tls_mirror.h), and CheckTlsPem is the check.
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
#include "absl/status/statusor.h"

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

// The PEM text of the files of a TlsFiles ("" for a file not given).
struct TlsPem {
  std::string cert;
  std::string key;
  std::string ca;
  bool operator==(const TlsPem& o) const { return cert == o.cert && key == o.key && ca == o.ca; }
  bool operator!=(const TlsPem& o) const { return !(*this == o); }
};

// The files as given at start: cert and key both or neither, each readable, and the text as
// CheckTlsPem wants it. INVALID_ARGUMENT naming the flag (`flag` + "-cert", "-key", "-ca") and
// the file. `need_identity`: a server needs cert and key.
absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& flag, bool need_identity);

// Reads the files given in `files`, as one set: a file replaced while it is read (a rotation
// under way) is read again, up to a few times. INVALID_ARGUMENT "FLAG-cert PATH: cannot be read
// (...)" for a file that is missing or unreadable; the text is not checked.
absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files, const std::string& flag);

// Whether `pem` is what gRPC can use, checked with OpenSSL as gRPC reads it: the certificate
// chain's PEM blocks are whole, it holds a certificate and each certificate in it parses; the
// key is an unencrypted PEM private key; the key belongs to the chain's first certificate; the
// CA's PEM blocks are whole and hold at least one certificate, each of which parses. Blocks of
// other kinds (a key beside a chain) are skipped, as gRPC skips them. INVALID_ARGUMENT naming
// the flag, the file (from `files`) and what is wrong. Thread-safe.
absl::Status CheckTlsPem(const TlsPem& pem, const TlsFiles& files, const std::string& flag);

// One text that gRPC reads as both the private key and the certificate chain of `pem`: the first
// private key block of pem.key, then pem.cert. The mirror (tls_mirror.h) gives gRPC this as one
// file, so that a key and its certificate are replaced together. "" when pem.key holds no
// private key block.
std::string KeyAndChainPem(const TlsPem& pem);

// The subject and expiry of the first certificate in `cert_pem`, for logs:
// "CN=node-a, valid until Jan  2 03:04:05 2027 GMT"; "" if there is none.
std::string DescribeCertificate(const std::string& cert_pem);

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
