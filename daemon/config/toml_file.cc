#include "daemon/config/toml_file.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/files.h"

namespace rannc {

absl::Status CheckTomlText(std::string_view text, const std::string& source) {
  // Where the scan is: outside strings and comments (kCode), where TOML allows ASCII only, or
  // inside one. A string that is not closed is left to the parser to report.
  enum { kCode, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral } in = kCode;
  auto at = [&](size_t i, std::string_view s) { return text.substr(i, s.size()) == s; };
  int64_t line = 1;
  int64_t column = 1;
  // A UTF-8 byte order mark first is not part of the text (toml++ skips it too).
  for (size_t i = at(0, "\xef\xbb\xbf") ? 3 : 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const bool crlf = c == '\r' && i + 1 < text.size() && text[i + 1] == '\n';
    if ((c < 0x20 && c != '\t' && c != '\n' && !crlf) || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s:%d:%d: control character U+%04X is not allowed in TOML (only tab, LF and CR LF; "
          "is this a text file?)",
          source, line, column, c));
    }
    if (c >= 0x80 && in == kCode) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s:%d:%d: a non-ASCII character outside a string or a comment is not TOML (quote "
          "the value)",
          source, line, column));
    }
    size_t skip = 0;  // more bytes of a delimiter or an escape, taken with this one
    switch (in) {
      case kCode:
        if (c == '#') {
          in = kComment;
        } else if (at(i, "\"\"\"")) {
          in = kMultiBasic;
          skip = 2;
        } else if (at(i, "'''")) {
          in = kMultiLiteral;
          skip = 2;
        } else if (c == '"') {
          in = kBasic;
        } else if (c == '\'') {
          in = kLiteral;
        }
        break;
      case kComment:
        if (c == '\n') in = kCode;
        break;
      case kBasic:
        if (c == '\\' && i + 1 < text.size() && text[i + 1] != '\n') {
          skip = 1;
        } else if (c == '"' || c == '\n') {
          in = kCode;
        }
        break;
      case kLiteral:
        if (c == '\'' || c == '\n') in = kCode;
        break;
      case kMultiBasic:
        if (c == '\\' && i + 1 < text.size() && text[i + 1] != '\n') {
          skip = 1;
        } else if (at(i, "\"\"\"")) {
          in = kCode;
          skip = 2;
        }
        break;
      case kMultiLiteral:
        if (at(i, "'''")) {
          in = kCode;
          skip = 2;
        }
        break;
    }
    for (; skip > 0 && i + 1 < text.size(); --skip) {
      ++i;
      ++column;  // a delimiter's quotes, or an escaped character (ASCII or a UTF-8 lead byte)
    }
    if (c == '\n') {
      ++line;
      column = 1;
    } else if ((c & 0xc0) != 0x80) {  // one column a character, not a UTF-8 continuation byte
      ++column;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<toml::table> ReadTomlFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  if (absl::Status checked = CheckTomlText(*text, path); !checked.ok()) return checked;
  try {
    return toml::parse(*text, path);
  } catch (const toml::parse_error& e) {
    const auto& begin = e.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(path, ":", begin.line, ":", begin.column,
                                                   ": ", std::string(e.description())));
  } catch (const TomlCheckFailed& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not valid TOML (the parser's own check '", e.what(), "' failed)"));
  }
}

}  // namespace rannc
