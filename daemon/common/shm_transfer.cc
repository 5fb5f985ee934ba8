#include "daemon/common/shm_transfer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

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

absl::StatusOr<int> ShmDirectory::OpenRegular(const std::string& path, int flags,
                                               uint64_t offset, uint64_t length,
                                               const char* what) {
  // O_NONBLOCK: opening a FIFO someone named rannc-* would otherwise wait for its other end.
  const int fd = open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Errno(absl::StrCat("opening ", path));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (offset > file_size || length > file_size - offset) {  // no overflow in offset + length
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, " ", offset, "+", length,
                                                   " lies outside ", path, " (", file_size,
                                                   " bytes)"));
  }
  return fd;
}

absl::StatusOr<ShmDirectory::Reader> ShmDirectory::OpenRegion(const v1::ShmRef& ref,
                                                              size_t size) const {
  absl::StatusOr<std::string> path = Resolve(ref.path());
  if (!path.ok()) return path.status();
  if (ref.length() != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory region of ", ref.length(), " bytes for a tensor of ", size, " bytes"));
  }
  absl::StatusOr<int> fd = OpenRegular(*path, O_RDONLY, ref.offset(), size, "region");
  if (!fd.ok()) return fd.status();
  return Reader(*fd, *path, ref.offset(), size);
}

absl::Status ShmDirectory::Read(const v1::ShmRef& ref, void* dst, size_t size) const {
  absl::StatusOr<Reader> reader = OpenRegion(ref, size);
  if (!reader.ok()) return reader.status();
  return reader->Read(dst);
}

ShmDirectory::Reader::Reader(int fd, std::string path, uint64_t offset, size_t size)
    : fd_(fd), path_(std::move(path)), offset_(offset), size_(size) {}

ShmDirectory::Reader::Reader(Reader&& other) noexcept
    : fd_(other.fd_), path_(std::move(other.path_)), offset_(other.offset_), size_(other.size_) {
  other.fd_ = -1;
}

ShmDirectory::Reader::~Reader() {
  if (fd_ >= 0) close(fd_);
}

absl::Status ShmDirectory::Reader::Read(void* dst) {
  size_t done = 0;
  while (done < size_) {
    const ssize_t n = pread(fd_, static_cast<char*>(dst) + done, size_ - done, offset_ + done);
    if (n <= 0) {
      // The file shrank since it was opened.
      return n == 0 ? absl::InvalidArgumentError(absl::StrCat(
                          path_, " ends before offset ", offset_ + size_))
                    : Errno(absl::StrCat("reading ", path_));
    }
    done += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmDirectory::Writer> ShmDirectory::OpenReply(const v1::ShmRef& region) const {
  absl::StatusOr<std::string> path = Resolve(region.path());
  if (!path.ok()) return path.status();
  absl::StatusOr<int> fd =
      OpenRegular(*path, O_WRONLY, region.offset(), region.length(), "reply region");
  if (!fd.ok()) return fd.status();
  return Writer(*fd, *path, region.offset(), region.offset() + region.length());
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
