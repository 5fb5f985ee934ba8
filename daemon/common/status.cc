#include "daemon/common/status.h"

#include "absl/strings/str_cat.h"

namespace rannc {

std::string FirstLine(absl::string_view message) {
  // c10::Error::what() holds the message, then "Exception raised from ..." and a backtrace.
  size_t end = message.find("\nException raised from");
  if (end == absl::string_view::npos) end = message.find('\n');
  absl::string_view line = message.substr(0, end);
  while (!line.empty() && (line.back() == ' ' || line.back() == '\n')) line.remove_suffix(1);
  return std::string(line);
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace rannc
