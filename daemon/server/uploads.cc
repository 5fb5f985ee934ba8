#include "daemon/server/uploads.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/files.h"

namespace rannc {

Uploads::Uploads(std::string dir, bool temporary)
    : dir_(std::move(dir)), temporary_(temporary) {}

Uploads::~Uploads() {
  if (temporary_) (void)RemoveTree(dir_);
}

Uploads::Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

absl::Status Uploads::Writer::Write(const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd_, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrCat("writing the upload ", path_));
    data += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Uploads::Writer::Commit(uint64_t expected) {
  if (expected != 0 && written_ != expected) {
    return absl::DataLossError(absl::StrCat("the upload of ", path_, " ended after ", written_,
                                            " of ", expected, " bytes"));
  }
  if (::fsync(fd_) != 0) return ErrnoStatus(errno, absl::StrCat("writing the upload ", path_));
  ::close(fd_);
  fd_ = -1;
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("committing the upload ", path_));
  }
  committed_ = true;
  (void)SyncDirectory(ParentPath(path_));
  return path_;
}

absl::StatusOr<std::unique_ptr<Uploads::Writer>> Uploads::Begin(const std::string& name) {
  const std::string base = name.substr(name.find_last_of('/') + 1);
  if (base.empty() || base == "." || base == "..") {
    return absl::InvalidArgumentError(absl::StrCat("an upload needs a file name, not '", name,
                                                   "'"));
  }
  absl::Status made = MakeDirs(dir_);
  if (!made.ok()) return made;
  const std::string unique = absl::StrFormat(
      "%x%x-%d", ::getpid(),
      std::chrono::steady_clock::now().time_since_epoch().count() & 0xFFFFFFFF, next_++);
  const std::string path = JoinPath(dir_, absl::StrCat(unique, "-", base));
  const std::string tmp = JoinPath(dir_, absl::StrCat(".", unique, ".tmp"));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", tmp));
  return std::unique_ptr<Writer>(new Writer(fd, tmp, path));
}

bool Uploads::Holds(const std::string& path) const {
  return !path.empty() && ParentPath(path) == dir_ && IsRegularFile(path);
}

void Uploads::Release(const std::string& path) const {
  if (Holds(path)) ::unlink(path.c_str());
}

int Uploads::RemoveUnused(const std::set<std::string>& in_use,
                          std::chrono::milliseconds unused_for) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir_);
  if (!names.ok()) return 0;  // no upload yet
  const auto now = std::chrono::system_clock::now();
  int removed = 0;
  for (const std::string& name : *names) {
    const std::string path = JoinPath(dir_, name);
    struct stat st;
    if (in_use.count(path) || ::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    const auto written = std::chrono::system_clock::time_point(
        std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec));
    if (now - written < unused_for) continue;
    if (::unlink(path.c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace rannc
