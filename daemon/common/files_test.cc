#include "daemon/common/files.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("ReadFile returns a file's bytes, or NOT_FOUND naming it", "[common]") {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/files_test.bin";
  const std::string bytes("a\0b\nc", 5);
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  absl::StatusOr<std::string> read = ReadFile(path);
  REQUIRE(read.ok());
  CHECK(*read == bytes);
  std::remove(path.c_str());
  absl::StatusOr<std::string> missing = ReadFile(path);
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains(path));
}

}  // namespace
}  // namespace rannc
