// Whole files in and out of memory, as the tools and the CLI read models and deployments.
//
//   absl::StatusOr<std::string> bytes = ReadFile("model.pt");
//
// Thread-compatible free functions.
#ifndef RANNC_DAEMON_COMMON_FILES_H_
#define RANNC_DAEMON_COMMON_FILES_H_

#include <string>

#include "absl/status/statusor.h"

namespace rannc {

// The bytes of the file at `path`; NOT_FOUND naming the path when it cannot be opened.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_FILES_H_
