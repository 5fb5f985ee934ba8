#include "daemon/common/files.h"

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

}  // namespace rannc
