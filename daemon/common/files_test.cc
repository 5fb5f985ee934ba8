#include "daemon/common/files.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

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

TEST_CASE("AppendToFile creates a file and appends to it; a missing directory is named",
          "[common]") {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/files_test.log";
  std::remove(path.c_str());
  REQUIRE(AppendToFile(path, "1 a\n").ok());
  REQUIRE(AppendToFile(path, "2 b\n").ok());
  CHECK(ReadFile(path).value() == "1 a\n2 b\n");
  std::remove(path.c_str());
  const std::string nowhere = path + ".missing/x.log";
  absl::Status failed = AppendToFile(nowhere, "x");
  CHECK(failed.code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(failed.message()), Catch::Contains(nowhere));
}

TEST_CASE("DurableFile writes a file in pieces; errors name the path", "[common]") {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/files_test.durable";
  {
    absl::StatusOr<DurableFile> file = DurableFile::Create(path);
    REQUIRE(file.ok());
    DurableFile moved = std::move(*file);  // the descriptor moves with it
    REQUIRE(moved.Write("abc", 3).ok());
    REQUIRE(moved.Write("", 0).ok());
    REQUIRE(moved.Write("de", 2).ok());
    REQUIRE(moved.Finish().ok());
    absl::Status again = moved.Write("f", 1);
    CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(again.message()), Catch::Contains(path));
  }
  absl::StatusOr<std::string> read = ReadFile(path);
  REQUIRE(read.ok());
  CHECK(*read == "abcde");
  {
    // Not finished: closed when it goes, what was written stays.
    absl::StatusOr<DurableFile> file = DurableFile::Create(path);
    REQUIRE(file.ok());
    REQUIRE(file->Write("xy", 2).ok());
  }
  CHECK(*ReadFile(path) == "xy");
  std::remove(path.c_str());
  absl::StatusOr<DurableFile> missing = DurableFile::Create(path + ".d/x");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains(path + ".d/x"));
}

TEST_CASE("directories are made, listed and removed without std::filesystem", "[common]") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root = JoinPath(tmp != nullptr ? tmp : "/tmp", "files_test_tree");
  REQUIRE(RemoveTree(root).ok());  // absent: nothing to do
  const std::string deep = JoinPath(JoinPath(root, "a"), "b");
  REQUIRE(MakeDirs(deep).ok());
  REQUIRE(MakeDirs(deep).ok());  // already there
  CHECK(IsDirectory(deep));
  CHECK(ParentPath(deep) == JoinPath(root, "a"));
  CHECK(ParentPath("name") == "");
  CHECK(ParentPath("/name") == "/");
  CHECK(JoinPath("", "x") == "x");
  CHECK(JoinPath("d/", "x") == "d/x");
  CHECK(JoinPath("d", "/abs") == "/abs");
  REQUIRE(WriteFileDurably(JoinPath(deep, "f"), "xy", 2).ok());
  CHECK(IsRegularFile(JoinPath(deep, "f")));
  CHECK_FALSE(IsRegularFile(deep));
  REQUIRE(WriteFileDurably(JoinPath(root, "g"), "z", 1).ok());
  // A symbolic link to outside the tree is removed, not followed.
  const std::string outside = JoinPath(tmp != nullptr ? tmp : "/tmp", "files_test_outside");
  REQUIRE(WriteFileDurably(outside, "keep", 4).ok());
  REQUIRE(::symlink(outside.c_str(), JoinPath(deep, "link").c_str()) == 0);
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(root);
  REQUIRE(names.ok());
  std::sort(names->begin(), names->end());
  CHECK(*names == std::vector<std::string>{"a", "g"});
  REQUIRE(RemoveTree(root).ok());
  CHECK_FALSE(PathExists(root));
  CHECK(IsRegularFile(outside));
  CHECK(ListDirectory(root).status().code() == absl::StatusCode::kNotFound);
  std::remove(outside.c_str());
}

}  // namespace
}  // namespace rannc
