// TorchScript source checks (torch_archive.h: CheckTorchScriptCode): what crashes LibTorch
// 1.13's TorchScript importer, found by fuzz/torchscript_import_fuzzer.cc and docs/hardening.md.
#include "daemon/common/torch_archive.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rannc {

namespace {

// CheckTorchScriptCode's bound: TorchScript's parser recurses once per level (~1.6 KB of stack
// each: 5,000 unary minuses overflow an 8 MiB stack and end the process), and the code
// torch.jit.save writes nests a few levels.
constexpr int64_t kMaxCodeNesting = 500;

// Whether `word` stands at code[i] as a word of its own.
bool IsWordAt(absl::string_view code, size_t i, absl::string_view word) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  if (code.compare(i, word.size(), word) != 0) return false;
  if (i > 0 && ident(code[i - 1])) return false;
  return i + word.size() >= code.size() || !ident(code[i + word.size()]);
}

// Passes over a string literal or a comment starting at code[*i], leaving *i on its last byte;
// false when code[*i] starts neither.
bool SkipStringOrComment(absl::string_view code, size_t* i) {
  const char c = code[*i];
  if (c == '#') {
    while (*i + 1 < code.size() && code[*i + 1] != '\n') ++*i;
    return true;
  }
  if (c != '"' && c != '\'') return false;
  while (++*i < code.size() && code[*i] != c && code[*i] != '\n') {
    if (code[*i] == '\\') ++*i;
  }
  if (*i >= code.size()) *i = code.size() - 1;
  return true;
}

// CheckTorchScriptCode's first half: how deeply the code nests.
absl::Status CheckNesting(absl::string_view code, absl::string_view what) {
  // A statement's nesting, over-estimated: its bracket depth plus every operator character and
  // `if`/`not`/`lambda` in it (each can be one more level of the parser's recursion: unary
  // operators, `**`, chained conditionals), plus its line's indentation.
  int depth = 0;         // brackets open
  int64_t budget = 0;    // of the statement so far
  int64_t indent = 0;    // of the statement's first line
  bool line_start = true;
  size_t statement = 0;  // where it began
  auto over = [&](size_t at) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " nests deeper than TorchScript's compiler can parse safely (over ",
        kMaxCodeNesting, " levels in the statement at byte ", statement, ", ending at byte ", at,
        ")"));
  };
  for (size_t i = 0; i < code.size(); ++i) {
    const char c = code[i];
    if (line_start) {
      if (c == ' ' || c == '\t') {
        if (depth == 0) ++indent;
        if (indent > kMaxCodeNesting) return over(i);
        continue;
      }
      line_start = false;
    }
    switch (c) {
      case '\n':
        if (depth == 0) {
          budget = 0;
          indent = 0;
          statement = i + 1;
        }
        line_start = true;
        continue;
      case '#':
      case '"':
      case '\'':  // a comment, or a string literal
        SkipStringOrComment(code, &i);
        continue;
      case '(': case '[': case '{':
        ++depth;
        ++budget;
        break;
      case ')': case ']': case '}':
        depth = std::max(0, depth - 1);
        break;
      case '-': case '+': case '~': case '*': case '/': case '%': case '@': case '&': case '|':
      case '^': case '<': case '>': case '!':
        ++budget;
        break;
      default:
        if (IsWordAt(code, i, "if") || IsWordAt(code, i, "not") || IsWordAt(code, i, "lambda")) {
          ++budget;
        }
        break;
    }
    if (budget + indent > kMaxCodeNesting) return over(i);
  }
  return absl::OkStatus();
}

// The identifier at code[*i] (moving past it), or "".
absl::string_view Identifier(absl::string_view code, size_t* i) {
  const size_t begin = *i;
  while (*i < code.size() && (std::isalnum(static_cast<unsigned char>(code[*i])) ||
                              code[*i] == '_')) {
    ++*i;
  }
  if (begin < code.size() && std::isdigit(static_cast<unsigned char>(code[begin]))) {
    *i = begin;
  }
  return code.substr(begin, *i - begin);
}

void SkipBlanks(absl::string_view code, size_t* i) {
  while (*i < code.size() && (code[*i] == ' ' || code[*i] == '\t')) ++*i;
}

// Whether code[from, to) can be a type as TorchScript writes one: names, dots, brackets,
// parentheses, commas and blanks (`Optional[Tuple[int, Tensor]]`, `Tuple[()]`,
// `__torch__.torch.nn.modules.linear.Linear`).
bool IsTypeText(absl::string_view code, size_t from, size_t to) {
  for (size_t i = from; i < to && i < code.size(); ++i) {
    const char c = code[i];
    const bool other = c == '\0' || std::strchr("_.[](), \t\n\\", c) == nullptr;
    if (!std::isalnum(static_cast<unsigned char>(c)) && other) return false;
  }
  return true;
}

bool IsKeyword(absl::string_view word) {
  for (const char* k : {"if", "elif", "else", "for", "while", "with", "try", "except", "finally",
                        "def", "class", "return", "pass", "break", "continue", "raise", "assert",
                        "del", "import", "from", "global", "nonlocal", "lambda", "yield", "not",
                        "and", "or", "in", "is", "async", "await"}) {
    if (word == k) return true;
  }
  return false;
}

// The first byte of code[from, to) outside brackets and strings that is one of `stops`, or `to`.
size_t FindOutside(absl::string_view code, size_t from, size_t to, absl::string_view stops) {
  int depth = 0;
  for (size_t i = from; i < to; ++i) {
    const char c = code[i];
    if (SkipStringOrComment(code, &i)) continue;
    if (depth == 0 && stops.find(c) != absl::string_view::npos) return i;
    if (c == '(' || c == '[' || c == '{') ++depth;
    if (c == ')' || c == ']' || c == '}') depth = std::max(0, depth - 1);
  }
  return to;
}

// The type annotations of the statement code[at, to): `NAME : TYPE [= ...]`, and a def's
// parameters' and result's. TorchScript's type parser crashes on some expressions that are no
// type (`__parameters__ :n["weight", "bias", ]`: a SIGSEGV in parseTypeFromExpr, the fuzzer's
// fifth input), so an annotation must read as one (IsTypeText).
absl::Status CheckAnnotations(absl::string_view code, size_t at, size_t to,
                              absl::string_view what) {
  auto refuse = [&](size_t from, size_t until) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the type annotation '", code.substr(from, std::min(until - from, size_t{80})),
        "' at byte ", from, " is not a type"));
  };
  SkipBlanks(code, &at);
  const absl::string_view name = Identifier(code, &at);
  if (name.empty()) return absl::OkStatus();
  if (name == "def") {
    SkipBlanks(code, &at);
    if (Identifier(code, &at).empty()) return absl::OkStatus();
    SkipBlanks(code, &at);
    if (at >= to || code[at] != '(') return absl::OkStatus();
    const size_t close = FindOutside(code, at + 1, to, ")");
    for (size_t param = at + 1; param < close;) {
      const size_t next = FindOutside(code, param, close, ",");
      const size_t colon = FindOutside(code, param, next, ":");
      if (colon < next) {
        const size_t type_end = FindOutside(code, colon + 1, next, "=");
        if (!IsTypeText(code, colon + 1, type_end)) return refuse(colon + 1, type_end);
      }
      param = next + 1;
    }
    size_t after = close + 1;
    while (after < to && std::isspace(static_cast<unsigned char>(code[after]))) ++after;
    if (after + 1 < to && code[after] == '-' && code[after + 1] == '>') {
      const size_t type_end = FindOutside(code, after + 2, to, ":");
      if (!IsTypeText(code, after + 2, type_end)) return refuse(after + 2, type_end);
    }
    return absl::OkStatus();
  }
  if (IsKeyword(name)) return absl::OkStatus();
  SkipBlanks(code, &at);
  if (at >= to || code[at] != ':') return absl::OkStatus();
  const size_t type_end = FindOutside(code, at + 1, to, "=");
  if (!IsTypeText(code, at + 1, type_end)) return refuse(at + 1, type_end);
  return absl::OkStatus();
}

// CheckTorchScriptCode's second half: the type annotations (CheckAnnotations), and the
// constants of classes. LibTorch 1.13 reads the type annotation of a class's constant without
// checking that it has one: `  foo = []` in a class body (any name but the four its importer
// knows) makes it read an absent annotation: garbage, an exception or a SIGSEGV (found by
// fuzz/torchscript_import_fuzzer.cc: `__buffers__` with one bit flipped). Enum classes, whose
// members are such assignments, are read by other code.
absl::Status CheckStatements(absl::string_view code, absl::string_view what) {
  int64_t class_indent = -1;  // of the class statement whose body this is; -1: none
  int64_t body_indent = -1;   // of that body's statements; -1: not seen yet
  // A statement beginning at code[at] in a class body: an assignment without annotation?
  auto check = [&](size_t at) -> absl::Status {
    SkipBlanks(code, &at);
    const absl::string_view name = Identifier(code, &at);
    SkipBlanks(code, &at);
    if (name.empty() || at + 1 >= code.size() || code[at] != '=' || code[at + 1] == '=') {
      return absl::OkStatus();
    }
    for (const char* known :
         {"__parameters__", "__buffers__", "__forward_pre_hooks__", "__forward_hooks__"}) {
      if (name == known) return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the class constant '", name, "' at byte ", at,
        " has no type annotation (TorchScript's importer reads one regardless; torch.jit.save "
        "writes `", name, " : Final[T] = ...`)"));
  };
  size_t i = 0;
  while (i < code.size()) {
    // A logical line: a newline outside brackets, not after a backslash, ends it.
    int64_t indent = 0;
    while (i < code.size() && (code[i] == ' ' || code[i] == '\t')) {
      ++indent;
      ++i;
    }
    const size_t text = i;
    std::vector<size_t> statements{text};  // where each of its statements begins
    size_t colon = std::string::npos;       // its first ':' outside brackets
    int depth = 0;
    for (; i < code.size(); ++i) {
      const char c = code[i];
      if (c == '\\' && i + 1 < code.size() && code[i + 1] == '\n') {
        ++i;
      } else if (c == '\n') {
        if (depth == 0) break;
      } else if (SkipStringOrComment(code, &i)) {
      } else if (c == '(' || c == '[' || c == '{') {
        ++depth;
      } else if (c == ')' || c == ']' || c == '}') {
        depth = std::max(0, depth - 1);
      } else if (depth == 0 && c == ';') {
        statements.push_back(i + 1);
      } else if (depth == 0 && c == ':' && colon == std::string::npos) {
        colon = i;
      }
    }
    const size_t end = i++;
    if (text == end || code[text] == '#') continue;  // blank, or a comment
    for (size_t k = 0; k < statements.size(); ++k) {
      const size_t to = k + 1 < statements.size() ? statements[k + 1] - 1 : end;
      if (absl::Status ok = CheckAnnotations(code, statements[k], to, what); !ok.ok()) return ok;
    }
    if (class_indent >= 0 && indent <= class_indent) class_indent = -1;
    if (class_indent >= 0) {
      if (body_indent < 0) body_indent = indent;
      if (indent == body_indent) {
        for (size_t at : statements) {
          if (absl::Status ok = check(at); !ok.ok()) return ok;
        }
      }
    }
    // `class NAME(BASE):` or `class NAME:`, and what follows its colon on the line.
    size_t at = text;
    if (Identifier(code, &at) != "class") continue;
    SkipBlanks(code, &at);
    if (Identifier(code, &at).empty()) continue;
    SkipBlanks(code, &at);
    if (at < end && code[at] == '(') {
      ++at;
      SkipBlanks(code, &at);
      if (Identifier(code, &at) == "Enum") continue;
    }
    class_indent = indent;
    body_indent = -1;
    if (colon != std::string::npos) {
      if (absl::Status ok = check(colon + 1); !ok.ok()) return ok;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTorchScriptCode(absl::string_view code, absl::string_view what) {
  if (absl::Status ok = CheckNesting(code, what); !ok.ok()) return ok;
  return CheckStatements(code, what);
}

}  // namespace rannc
