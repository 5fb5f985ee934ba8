#include "daemon/common/status.h"

#include <cctype>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rannc {

namespace {

bool IsErrorLine(absl::string_view line) {
  // "RuntimeError: index out of range in self", "IndexError: ...".
  const size_t colon = line.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return false;
  absl::string_view kind = line.substr(0, colon);
  for (char c : kind) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.') return false;
  }
  return absl::EndsWith(kind, "Error") || absl::EndsWith(kind, "Exception");
}

}  // namespace

std::string UserMessage(absl::string_view message) {
  constexpr absl::string_view kInterpreter = "The following operation failed in the TorchScript";
  if (!absl::StartsWith(message, kInterpreter)) return FirstLine(message);
  // An error inside a TorchScript model: the cause is the last "XError: ..." line; the
  // innermost frames of the original Python code say where it came from.
  std::vector<absl::string_view> lines = absl::StrSplit(message, '\n');
  std::string cause;
  for (absl::string_view line : lines) {
    if (absl::StartsWith(line, "Exception raised from")) break;
    if (IsErrorLine(line)) cause = std::string(line);
  }
  if (cause.empty()) return FirstLine(message);
  std::vector<std::string> frames;
  bool in_original = false;
  for (absl::string_view line : lines) {
    if (absl::StartsWith(line, "Traceback of TorchScript, original code")) {
      in_original = true;
    } else if (in_original && !line.empty() && !IsErrorLine(line) && frames.size() < 2) {
      const size_t slash = line.rfind('/');
      frames.push_back(std::string(slash == absl::string_view::npos ? line : line.substr(slash + 1)));
    }
  }
  if (frames.empty()) return cause;
  return absl::StrCat(cause, " (at ", absl::StrJoin(frames, " in "), ")");
}

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
