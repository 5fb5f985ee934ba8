// Whole files in and out of memory, as the tools and the CLI read models and deployments, and
// durable writes (checkpoints, job records).
//
//   absl::StatusOr<std::string> bytes = ReadFile("model.pt");
//   absl::Status s = WriteFileDurably("dir/manifest.json", json.data(), json.size());
//
// Thread-compatible free functions.
#ifndef RANNC_DAEMON_COMMON_FILES_H_
#define RANNC_DAEMON_COMMON_FILES_H_

#include <string>

#include "absl/status/statusor.h"

namespace rannc {

// The bytes of the file at `path`; NOT_FOUND naming the path when it cannot be opened.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `size` bytes to a new file at `path` (replacing one there) and fsyncs it. An error
// names the path, its code from errno: RESOURCE_EXHAUSTED for a full disk, PERMISSION_DENIED,
// NOT_FOUND, else INTERNAL.
absl::Status WriteFileDurably(const std::string& path, const char* data, size_t size);
// fsyncs the directory `path` (so that files created or renamed in it are durable).
absl::Status SyncDirectory(const std::string& path);
// The status of errno `err` when doing `what` (as above).
absl::Status ErrnoStatus(int err, const std::string& what);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_FILES_H_
