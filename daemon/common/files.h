// Whole files in and out of memory, as the tools and the CLI read models and deployments, and
// durable writes (checkpoints, job records); directories made, listed and removed.
//
// The daemon uses these, not std::filesystem: PyTorch's wheels (the GPU build's LibTorch) export
// their own copies of libstdc++'s std::filesystem from libtorch.so, which the dynamic linker
// binds the daemon's calls to, and their remove_all jumped through a null pointer (a SIGSEGV
// after a checkpoint was pruned, on the H200). POSIX calls have one implementation.
//
//   absl::StatusOr<std::string> bytes = ReadFile("model.pt");
//   absl::Status s = WriteFileDurably("dir/manifest.json", json.data(), json.size());
//
// Thread-compatible free functions.
#ifndef RANNC_DAEMON_COMMON_FILES_H_
#define RANNC_DAEMON_COMMON_FILES_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace rannc {

// The bytes of the file at `path`; NOT_FOUND naming the path when it cannot be opened.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `size` bytes to a new file at `path` (replacing one there) and fsyncs it. An error
// names the path, its code from errno: RESOURCE_EXHAUSTED for a full disk, PERMISSION_DENIED,
// NOT_FOUND, else INTERNAL.
absl::Status WriteFileDurably(const std::string& path, const char* data, size_t size);
// A new file written in pieces, then made durable: what WriteFileDurably does for bytes that
// are not in memory all at once (a checkpoint's tensor file, serialized as it is written).
//
//   absl::StatusOr<DurableFile> f = DurableFile::Create(path);
//   absl::Status s = f->Write(data, size);  // ... as often as needed
//   if (s.ok()) s = f->Finish();            // fsync, close
//
// Errors as WriteFileDurably's. Movable; a file not finished is closed (not synced) when it goes.
class DurableFile {
 public:
  static absl::StatusOr<DurableFile> Create(const std::string& path);
  DurableFile(DurableFile&& other) noexcept;
  DurableFile& operator=(DurableFile&& other) noexcept;
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  ~DurableFile();

  absl::Status Write(const char* data, size_t size);
  absl::Status Finish();

 private:
  DurableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// Appends `data` to `path` (created if missing) in one write(2) with O_APPEND, so that what
// several processes append does not interleave; not fsync'ed.
absl::Status AppendToFile(const std::string& path, const std::string& data);
// fsyncs the directory `path` (so that files created or renamed in it are durable).
absl::Status SyncDirectory(const std::string& path);
// The status of errno `err` when doing `what` (as above).
absl::Status ErrnoStatus(int err, const std::string& what);

// `dir` + "/" + `name` (just `name` when `dir` is empty or `name` is absolute).
std::string JoinPath(const std::string& dir, const std::string& name);
// The directory part of `path` ("a/b" of "a/b/c"; "" for "c"; "/" for "/c").
std::string ParentPath(const std::string& path);
bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);     // following symbolic links
bool IsRegularFile(const std::string& path);   // following symbolic links
// Makes `path` and its missing parents (mkdir -p); OK if it is a directory already.
absl::Status MakeDirs(const std::string& path);
// Removes `path` and everything under it, not following symbolic links (rm -rf); OK if it
// does not exist.
absl::Status RemoveTree(const std::string& path);
// The names in directory `path` (no "." or ".."), unsorted; as ErrnoStatus when it cannot be
// read (NOT_FOUND when it does not exist).
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& path);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_FILES_H_
