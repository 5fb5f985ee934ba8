#include "daemon/common/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace rannc {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("reading ", path, " failed"));
  return bytes.str();
}

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status AppendToFile(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  const ssize_t n = ::write(fd, data.data(), data.size());
  const int err = errno;
  ::close(fd);
  if (n < 0) return ErrnoStatus(err, absl::StrCat("appending to ", path));
  if (static_cast<size_t>(n) != data.size()) {
    return absl::DataLossError(absl::StrCat("appending to ", path, ": wrote ", n, " of ",
                                            data.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DurableFile> DurableFile::Create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", path));
  return DurableFile(path, fd);
}

DurableFile::DurableFile(DurableFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

DurableFile& DurableFile::operator=(DurableFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status DurableFile::Write(const char* data, size_t size) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd_, data + done, std::min<size_t>(size - done, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path_));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status DurableFile::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is closed"));
  const int fd = std::exchange(fd_, -1);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("syncing ", path_));
  }
  if (::close(fd) != 0) return ErrnoStatus(errno, absl::StrCat("closing ", path_));
  return absl::OkStatus();
}

absl::Status WriteFileDurably(const std::string& path, const char* data, size_t size) {
  absl::StatusOr<DurableFile> file = DurableFile::Create(path);
  if (!file.ok()) return file.status();
  absl::Status written = file->Write(data, size);
  if (!written.ok()) return written;
  return file->Finish();
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening directory ", path));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, absl::StrCat("syncing directory ", path));
  return absl::OkStatus();
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || (!name.empty() && name[0] == '/')) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string ParentPath(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : p.substr(0, slash);
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::Status MakeDirs(const std::string& path) {
  if (path.empty() || IsDirectory(path)) return absl::OkStatus();
  const std::string parent = ParentPath(path);
  if (!parent.empty() && parent != path) {
    absl::Status made = MakeDirs(parent);
    if (!made.ok()) return made;
  }
  if (::mkdir(path.c_str(), 0777) != 0 && !(errno == EEXIST && IsDirectory(path))) {
    return ErrnoStatus(errno, absl::StrCat("creating directory ", path));
  }
  return absl::OkStatus();
}

namespace {

int RemoveEntry(const char* path, const struct stat*, int type, struct FTW*) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  return rc == 0 || errno == ENOENT ? 0 : errno;
}

}  // namespace

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoStatus(errno, "removing " + path);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, "removing " + path);
    }
    return absl::OkStatus();
  }
  // Children before their directory (FTW_DEPTH), symbolic links as themselves (FTW_PHYS).
  const int rc = ::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) return ErrnoStatus(rc > 0 ? rc : errno, "removing " + path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return ErrnoStatus(errno, "listing " + path);
  std::vector<std::string> names;
  while (const struct dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

}  // namespace rannc
