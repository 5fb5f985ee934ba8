#include "daemon/security/tls_mirror.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/files.h"
#include "daemon/common/periodic.h"

namespace rannc {
namespace security {
namespace {

constexpr char kIdentityFile[] = "identity.pem";  // the key, then the certificate chain
constexpr char kCaFile[] = "ca.pem";

// What identifies a set read: its text, or why it could not be read.
std::string Fingerprint(const absl::StatusOr<TlsPem>& read) {
  if (!read.ok()) return absl::StrCat("!", read.status().message());
  return absl::StrCat(read->cert.size(), ":", read->cert, read->key.size(), ":", read->key,
                      read->ca.size(), ":", read->ca);
}

// Replaces `path` with `text` (mode 0600): written to a temporary file (WriteFileDurably), its
// modification time set to a second after `*mtime` at least (gRPC compares whole seconds before
// and after it reads, so every version must have a time of its own), renamed over `path`.
absl::Status ReplaceFile(const std::string& dir, const std::string& path, const std::string& text,
                         int64_t* mtime) {
  const std::string temporary = path + ".new";
  if (absl::Status written = WriteFileDurably(temporary, text.data(), text.size());
      !written.ok()) {
    ::unlink(temporary.c_str());
    return written;
  }
  const int64_t when = std::max<int64_t>(std::time(nullptr), *mtime + 1);
  const struct timespec times[2] = {{static_cast<time_t>(when), 0},
                                    {static_cast<time_t>(when), 0}};
  if (::chmod(temporary.c_str(), 0600) != 0 ||
      ::utimensat(AT_FDCWD, temporary.c_str(), times, 0) != 0 ||
      ::rename(temporary.c_str(), path.c_str()) != 0) {
    const absl::Status failed = ErrnoStatus(errno, absl::StrCat("replacing ", path));
    ::unlink(temporary.c_str());
    return failed;
  }
  (void)SyncDirectory(dir);
  *mtime = when;
  return absl::OkStatus();
}

std::string Flags(const TlsFiles& files, const std::string& flag) {
  std::string named;
  if (!files.cert.empty()) {
    absl::StrAppend(&named, flag, "-cert ", files.cert, ", ", flag, "-key ", files.key);
  }
  if (!files.ca.empty()) absl::StrAppend(&named, named.empty() ? "" : ", ", flag, "-ca ", files.ca);
  return named;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFileMirror>> TlsFileMirror::Start(const TlsFiles& files,
                                                                   const std::string& flag,
                                                                   TlsMirrorOptions options) {
  if (!files.enabled()) return absl::InvalidArgumentError("TlsFileMirror: no TLS files given");
  if (absl::Status checked = CheckTlsFiles(files, flag, /*need_identity=*/false); !checked.ok()) {
    return checked;
  }
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files, flag);
  if (!pem.ok()) return pem.status();
  if (absl::Status checked = CheckTlsPem(*pem, files, flag); !checked.ok()) return checked;

  std::string parent = options.parent;
  if (parent.empty()) {
    const char* tmpdir = std::getenv("TMPDIR");
    parent = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  }
  std::string pattern = parent + "/ranncd-tls-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat(
        "cannot make a private directory for the copies of the TLS files under ", parent, ": ",
        std::strerror(errno), " (set TMPDIR to a writable directory)"));
  }
  ::chmod(pattern.c_str(), 0700);
  std::unique_ptr<TlsFileMirror> mirror(new TlsFileMirror(files, flag, pattern));
  {
    std::lock_guard<std::mutex> lock(mirror->mu_);
    if (absl::Status written = mirror->Write(*pem); !written.ok()) return written;
    mirror->current_ = *pem;
    mirror->last_read_ = Fingerprint(pem);
  }
  if (options.refresh > std::chrono::milliseconds(0)) {
    TlsFileMirror* self = mirror.get();
    mirror->periodic_ = std::make_unique<Periodic>(options.refresh, [self] { self->Refresh(); });
  }
  return mirror;
}

TlsFileMirror::TlsFileMirror(TlsFiles files, std::string flag, std::string dir)
    : files_(std::move(files)), flag_(std::move(flag)), dir_(std::move(dir)) {
  if (!files_.cert.empty()) copies_.cert = copies_.key = dir_ + "/" + kIdentityFile;
  if (!files_.ca.empty()) copies_.ca = dir_ + "/" + kCaFile;
}

TlsFileMirror::~TlsFileMirror() {
  periodic_.reset();
  // Not std::filesystem, whose copy in PyTorch's wheels crashed the daemon (common/files.h).
  (void)RemoveTree(dir_);
}

absl::Status TlsFileMirror::Write(const TlsPem& pem) {
  if (!copies_.cert.empty()) {
    const std::string identity = KeyAndChainPem(pem);
    // What gRPC will read from the copy, checked as the pair it reads.
    const absl::Status as_read =
        CheckTlsPem({identity, identity, ""}, {copies_.cert, copies_.key, ""}, flag_);
    if (!as_read.ok()) {
      return absl::InternalError(absl::StrCat("the copy of ", Flags(files_, flag_),
                                              " for gRPC does not check: ", as_read.message()));
    }
    if (identity != KeyAndChainPem(current_)) {
      if (absl::Status s = ReplaceFile(dir_, copies_.cert, identity, &identity_mtime_); !s.ok()) {
        return s;
      }
    }
  }
  if (!copies_.ca.empty() && (pem.ca != current_.ca || ca_mtime_ == 0)) {
    if (absl::Status s = ReplaceFile(dir_, copies_.ca, pem.ca, &ca_mtime_); !s.ok()) return s;
  }
  return absl::OkStatus();
}

TlsFileMirror::Outcome TlsFileMirror::Refresh() {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::StatusOr<TlsPem> read = ReadTlsFiles(files_, flag_);
  const std::string seen = Fingerprint(read);
  if (seen == last_read_) return Outcome::kUnchanged;
  absl::Status checked = read.ok() ? CheckTlsPem(*read, files_, flag_) : read.status();
  if (checked.ok() && *read == current_) {
    // Good again, as they were (a file put back): nothing to copy.
    if (!last_error_.ok()) {
      spdlog::info("TLS: {} pass the checks again; the certificate in use stays ({})",
                   Flags(files_, flag_), DescribeCertificate(current_.cert));
    }
    last_read_ = seen;
    last_error_ = absl::OkStatus();
    last_logged_.clear();
    return Outcome::kUnchanged;
  }
  bool copied = false;
  if (checked.ok()) {
    checked = Write(*read);
    copied = checked.ok();
  }
  if (copied) {
    current_ = *read;
    last_read_ = seen;
    last_error_ = absl::OkStatus();
    last_logged_.clear();
    spdlog::info("TLS: new files in use: {} ({})", Flags(files_, flag_),
                 current_.cert.empty() ? "root certificates only"
                                       : DescribeCertificate(current_.cert));
    return Outcome::kReplaced;
  }
  last_error_ = checked;
  // A set that failed its checks is logged once; one that could not be copied is tried again at
  // the next refresh, and logged again if the reason changes.
  const bool bad_files = checked.code() == absl::StatusCode::kInvalidArgument;
  if (bad_files) last_read_ = seen;
  if (bad_files || std::string(checked.message()) != last_logged_) {
    last_logged_ = std::string(checked.message());
    spdlog::warn("TLS: {}; these files are not used: new connections get the last good ones "
                 "({}) until they are fixed",
                 last_logged_,
                 current_.cert.empty() ? "root certificates" : DescribeCertificate(current_.cert));
  }
  return Outcome::kRejected;
}

absl::Status TlsFileMirror::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

std::string TlsFileMirror::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return DescribeCertificate(current_.cert);
}

}  // namespace security
}  // namespace rannc
