#include "daemon/config/toml_file.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

std::string Write(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST_CASE("text files parse; tab, LF and CR LF are allowed") {
  absl::StatusOr<toml::table> t =
      ReadTomlFile(Write("ok.toml", "a = 1\r\n\tb = \"x\\u0000y\" # é\n[c]\nd = true\n"));
  REQUIRE(t.ok());
  CHECK((*t)["a"].value<int64_t>() == 1);
  CHECK((*t)["b"].value<std::string>() == std::string("x\0y", 3));  // an escaped NUL is fine
}

TEST_CASE("a control character is refused with its line and column, before the parser") {
  // The input fuzz/config_fuzzer found: toml++ 3.3 aborted on an assertion for it.
  const std::string crash("[[\0\0 [1]\n", 9);
  absl::Status s = ReadTomlFile(Write("nul.toml", crash)).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("nul.toml:1:3: control character U+0000") !=
        std::string::npos);
  s = CheckTomlText("a = 1\nb = \"é\x7f\"\n", "f");
  CHECK(std::string(s.message()).find("f:2:7: control character U+007F") != std::string::npos);
  CHECK(!CheckTomlText("a = \x1b[31m\n", "f").ok());
  // The second input the fuzzer found: a lone CR in a table header (also an assertion there).
  CHECK(std::string(CheckTomlText("\xef\xbb\xbf[[\t\r]\n", "f").message())
            .find("f:1:4: control character U+000D") != std::string::npos);
  CHECK(!CheckTomlText("\x0c", "f").ok());
}

TEST_CASE("input that breaks toml++'s own assertions is refused, not an abort") {
  // Found by fuzz/config_fuzzer: toml++ 3.3 asserts that a table header's key starts with a key
  // character, and did not check it first.
  for (const char* text : {"[[,\n", "[,]\n", "[[\t]]\n", "a = 1\n[[\"x\"]\n[[=\n"}) {
    absl::Status s = ReadTomlFile(Write("assert.toml", text)).status();
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(s.message()).find("assert.toml") != std::string::npos);
  }
}

TEST_CASE("non-ASCII outside strings and comments is refused; inside them it is text") {
  // Found by fuzz/config_fuzzer under UBSan: toml++ 3.3 reached __builtin_unreachable
  // classifying U+0275 (and others) where it skips whitespace.
  absl::Status s = CheckTomlText("a = 1\nb = \xc9\xb5\n", "f");
  CHECK(std::string(s.message()).find("f:2:5: a non-ASCII character outside a string") !=
        std::string::npos);
  CHECK(!CheckTomlText("[[a]]\nb =-05-2\xc9\xb5" "07:32:00Z}]\n", "f").ok());
  for (const char* ok : {"a = \"\xc9\xb5 \\\" \xc3\xa9\" # \xc3\xa9\n", "a = 'x\xc3\xa9'\n",
                         "a = \"\"\"\n\xc3\xa9\"\"\\\"\"\"\"\nb = 1\n", "a = '''\n\xc3\xa9'''\n"}) {
    CHECK(CheckTomlText(ok, "f").ok());
    CHECK(ReadTomlFile(Write("text.toml", ok)).ok());
  }
}

TEST_CASE("parse errors and missing files name the file") {
  absl::Status s = ReadTomlFile(Write("bad.toml", "a = \n")).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("bad.toml:1:") != std::string::npos);
  CHECK(ReadTomlFile("/nonexistent/rannc.toml").status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace rannc
