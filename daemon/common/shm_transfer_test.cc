#include "daemon/common/shm_transfer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

// A rannc-* file of `size` zero bytes in a private directory, removed at scope exit.
struct TempShmFile {
  explicit TempShmFile(size_t size) {
    char tmpl[] = "/tmp/rannc-shm-test-XXXXXX";
    dir = mkdtemp(tmpl);
    path = dir + "/rannc-test";
    std::ofstream(path, std::ios::binary) << std::string(size, '\0');
  }
  ~TempShmFile() {
    std::remove(path.c_str());
    rmdir(dir.c_str());
  }
  std::string dir;
  std::string path;
};

v1::ShmRef Ref(const std::string& path, uint64_t offset, uint64_t length) {
  v1::ShmRef ref;
  ref.set_path(path);
  ref.set_offset(offset);
  ref.set_length(length);
  return ref;
}

TEST_CASE("ShmDirectory round-trips bytes through a reply region", "[shm]") {
  TempShmFile file(4096);
  ShmDirectory shm(file.dir);
  absl::StatusOr<ShmDirectory::Writer> writer = shm.OpenReply(Ref(file.path, 0, 4096));
  REQUIRE(writer.ok());
  std::vector<float> a{1, 2, 3}, b(200, 7.f);
  v1::ShmRef placed_a, placed_b;
  REQUIRE(writer->Write(a.data(), a.size() * 4, &placed_a));
  REQUIRE(writer->Write(b.data(), b.size() * 4, &placed_b));
  CHECK(placed_a.offset() == 0);
  CHECK(placed_b.offset() == 64);  // 64-byte aligned after the first tensor
  std::vector<float> c(4000 / 4);
  CHECK_FALSE(writer->Write(c.data(), c.size() * 4, &placed_b));  // no room: caller goes inline

  std::vector<float> back(200);
  REQUIRE(shm.Read(Ref(file.path, 64, 800), back.data(), 800).ok());
  CHECK(back == b);
}

TEST_CASE("ShmDirectory refuses paths outside its directory and bad regions", "[shm]") {
  TempShmFile file(128);
  ShmDirectory shm(file.dir);
  char buf[16];
  CHECK(shm.Read(Ref("/etc/passwd", 0, 16), buf, 16).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(shm.Read(Ref(file.dir + "/../etc/rannc-x", 0, 16), buf, 16).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(shm.Read(Ref(file.dir + "/other", 0, 16), buf, 16).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(shm.Read(Ref(file.path, 0, 8), buf, 16).code() == absl::StatusCode::kInvalidArgument);
  CHECK(shm.Read(Ref(file.path, 120, 16), buf, 16).code() == absl::StatusCode::kInvalidArgument);
  CHECK_FALSE(shm.OpenReply(Ref(file.path, 0, 4096)).ok());
  CHECK(ShmDirectory("").Read(Ref(file.path, 0, 16), buf, 16).code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("ShmDirectory refuses regions that overflow and files that are not regular", "[shm]") {
  TempShmFile file(128);
  ShmDirectory shm(file.dir);
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  char buf[16];
  // offset + length wraps around to within the file.
  CHECK(shm.Read(Ref(file.path, max - 7, 16), buf, 16).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(shm.OpenReply(Ref(file.path, max - 7, 16)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  // The region is checked before anything is read: a shape that lies is refused while opening.
  CHECK(shm.OpenRegion(Ref(file.path, 0, uint64_t{1} << 40), uint64_t{1} << 40).status().code() ==
        absl::StatusCode::kInvalidArgument);

  // A FIFO named rannc-*: opening it for reading or writing must not wait for its other end.
  const std::string fifo = file.dir + "/rannc-fifo";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  absl::Status read = shm.Read(Ref(fifo, 0, 16), buf, 16);
  CHECK(read.code() == absl::StatusCode::kInvalidArgument);
  CHECK(read.message().find("not a regular file") != absl::string_view::npos);
  // For writing, a FIFO without a reader fails to open (ENXIO); either way, at once.
  CHECK(shm.OpenReply(Ref(fifo, 0, 16)).status().code() == absl::StatusCode::kInvalidArgument);
  std::remove(fifo.c_str());
}

}  // namespace
}  // namespace rannc
