// TlsFileMirror: checked copies of the daemon's TLS files, for gRPC to read. gRPC's
// FileWatcherCertificateProvider (tls.h) keeps the last good certificate when a file goes
// missing, but passes on one that is there and does not parse (garbage, a truncated PEM, a key of
// another certificate), and new handshakes then fail. The mirror reads the user's files itself
// every `refresh`, and only a set that passes CheckTlsPem replaces the copies; a set that fails
// is logged (once per distinct content: the flag, the file and what is wrong) and the copies keep
// the last good set, which gRPC goes on serving.
//
//   absl::StatusOr<std::unique_ptr<TlsFileMirror>> mirror =
//       TlsFileMirror::Start(files, "--tls", {std::chrono::seconds(10)});
//   builder.AddListeningPort(addr, ServerCredentials((*mirror)->files(), seconds(1)));
//
// The copies live in a private directory (mode 0700, files 0600) under $TMPDIR (else /tmp),
// removed with the mirror: the certificate chain and its key in one file, which files() gives as
// both cert and key, and the CA in another. Each is replaced by rename, with a modification time
// (whole seconds, as gRPC compares them) later than its predecessor's; gRPC reads the key, then
// the certificate, and checks the file's time before and after, so it never pairs a key with a
// certificate of another version, and what it reads was checked as the pair it is.
//
// Thread-safety: Refresh runs on the mirror's thread (every `refresh`), and may be called from
// any thread; calls are serialised. files() is fixed at Start. The mirror must outlive the
// credentials made from files() or they read a removed directory (gRPC then keeps what it has
// and logs each failed read).
#ifndef RANNC_DAEMON_SECURITY_TLS_MIRROR_H_
#define RANNC_DAEMON_SECURITY_TLS_MIRROR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/security/tls.h"

namespace rannc {

class Periodic;

namespace security {

struct TlsMirrorOptions {
  // How often the user's files are read again (--tls-refresh; default 10 s). Zero: never by
  // the mirror itself; the caller calls Refresh (tests).
  std::chrono::milliseconds refresh{10000};
  // Where the private directory is made; "" for $TMPDIR, else /tmp.
  std::string parent;
};

class TlsFileMirror {
 public:
  // What a Refresh did.
  enum class Outcome {
    kUnchanged,  // the files read as last time (or a bad set already logged)
    kReplaced,   // a new set passed the checks; the copies hold it
    kRejected,   // a new set failed the checks (or could not be copied): logged, copies kept
  };

  // Checks `files` as CheckTlsFiles does (the same errors, naming `flag`'s flags), copies them
  // and starts watching them. `files` must be enabled().
  static absl::StatusOr<std::unique_ptr<TlsFileMirror>> Start(const TlsFiles& files,
                                                              const std::string& flag,
                                                              TlsMirrorOptions options = {});
  // Stops the thread and removes the copies and their directory.
  ~TlsFileMirror();

  TlsFileMirror(const TlsFileMirror&) = delete;
  TlsFileMirror& operator=(const TlsFileMirror&) = delete;

  // The copies, for ServerCredentials / ChannelCredentials: cert and key name one file (given
  // when the user's files had them), ca the CA's copy (when given).
  const TlsFiles& files() const { return copies_; }
  // The private directory holding them.
  const std::string& dir() const { return dir_; }

  // Reads the user's files once, and replaces the copies with them if they changed and pass the
  // checks. A set that fails is logged (warning) the first time it is read.
  Outcome Refresh();
  // Why the set last read was rejected; OK when it was taken, or was the one in use.
  absl::Status last_error() const;
  // DescribeCertificate of the certificate the copies hold ("" without one).
  std::string serving() const;

 private:
  TlsFileMirror(TlsFiles files, std::string flag, std::string dir);
  // Writes the copies of `pem` (each: a temporary file, fsync, its time set, rename).
  absl::Status Write(const TlsPem& pem);

  const TlsFiles files_;  // the user's
  const std::string flag_;
  const std::string dir_;
  TlsFiles copies_;

  mutable std::mutex mu_;  // one Refresh at a time; guards everything below
  TlsPem current_;         // what the copies hold
  std::string last_read_;  // the set read last (its text, or why it could not be read)
  std::string last_logged_;
  absl::Status last_error_;
  int64_t identity_mtime_ = 0;  // the copies' modification times (s)
  int64_t ca_mtime_ = 0;

  std::unique_ptr<Periodic> periodic_;  // last: stopped first
};

}  // namespace security
}  // namespace rannc

#endif  // RANNC_DAEMON_SECURITY_TLS_MIRROR_H_
