#include "daemon/common/shm_transfer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

ShmDirectory::ShmDirectory(std::string dir) : dir_(std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
}

absl::StatusOr<std::string> ShmDirectory::Resolve(const std::string& path) const {
  if (!enabled()) {
    return absl::FailedPreconditionError(
        "this daemon offers no shared-memory transfer (--shm-dir is empty); send tensor bytes "
        "inline");
  }
  const std::string prefix = dir_ + "/rannc-";
  if (!absl::StartsWith(path, prefix) || path.find('/', dir_.size() + 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory path '", path, "' is not a rannc-* file directly in ", dir_));
  }
  return path;
}

absl::Status ShmDirectory::Read(const v1::ShmRef& ref, void* dst, size_t size) const {
  absl::StatusOr<std::string> path = Resolve(ref.path());
  if (!path.ok()) return path.status();
  if (ref.length() != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory region of ", ref.length(), " bytes for a tensor of ", size, " bytes"));
  }
  const int fd = open(path->c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat("opening ", *path));
  size_t done = 0;
  while (done < size) {
    const ssize_t n = pread(fd, static_cast<char*>(dst) + done, size - done, ref.offset() + done);
    if (n <= 0) {
      absl::Status status = n == 0 ? absl::InvalidArgumentError(absl::StrCat(
                                         *path, " ends before offset ", ref.offset() + size))
                                   : Errno(absl::StrCat("reading ", *path));
      close(fd);
      return status;
    }
    done += n;
  }
  close(fd);
  return absl::OkStatus();
}

absl::StatusOr<ShmDirectory::Writer> ShmDirectory::OpenReply(const v1::ShmRef& region) const {
  absl::StatusOr<std::string> path = Resolve(region.path());
  if (!path.ok()) return path.status();
  const int fd = open(path->c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat("opening ", *path));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) < region.offset() + region.length()) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "reply region ", region.offset(), "+", region.length(), " lies outside ", *path));
  }
  return Writer(fd, *path, region.offset(), region.offset() + region.length());
}

ShmDirectory::Writer::Writer(int fd, std::string path, uint64_t next, uint64_t end)
    : fd_(fd), path_(std::move(path)), next_(next), end_(end) {}

ShmDirectory::Writer::Writer(Writer&& other) noexcept
    : fd_(other.fd_), path_(std::move(other.path_)), next_(other.next_), end_(other.end_) {
  other.fd_ = -1;
}

ShmDirectory::Writer::~Writer() {
  if (fd_ >= 0) close(fd_);
}

bool ShmDirectory::Writer::Write(const void* src, size_t size, v1::ShmRef* placed) {
  const uint64_t start = (next_ + 63) & ~uint64_t{63};
  if (start + size > end_) return false;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = pwrite(fd_, static_cast<const char*>(src) + done, size - done, start + done);
    if (n <= 0) return false;
    done += n;
  }
  placed->set_path(path_);
  placed->set_offset(start);
  placed->set_length(size);
  next_ = start + size;
  return true;
}

}  // namespace rannc
