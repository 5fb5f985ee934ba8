#include "daemon/planner/profile_cache.h"

#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace planner {
namespace {

namespace fs = std::filesystem;

// A fresh directory per call, under Bazel's TEST_TMPDIR when there is one.
fs::path MakeTempDir() {
  const char* root = getenv("TEST_TMPDIR");
  std::string pattern =
      (fs::path(root != nullptr ? root : fs::temp_directory_path().c_str()) / "profilesXXXXXX")
          .string();
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

ProfileKey Key(std::string hash = "abc123", int64_t mb = 8) {
  return ProfileKey{std::move(hash), mb, "cpu", "recompute=0"};
}

ProfileRecord Record(double fwd = 1.25) {
  ProfileRecord r;
  r.fwd_ms = fwd;
  r.bwd_ms = 0.1 + 0.2;  // not exactly representable in decimal: checks full precision
  r.act_bytes = 1 << 20;
  r.peak_bytes = 3;
  r.param_bytes = uint64_t{1} << 40;
  r.output_bytes = ~uint64_t{0};
  return r;
}

TEST_CASE("Insert then Find") {
  ProfileCache cache("");
  CHECK(cache.size() == 0);
  CHECK_FALSE(cache.Find(Key()).has_value());
  cache.Insert(Key(), Record());
  REQUIRE(cache.Find(Key()).has_value());
  CHECK(*cache.Find(Key()) == Record());
  cache.Insert(Key(), Record(2.5));  // replaces
  CHECK(cache.Find(Key())->fwd_ms == 2.5);
  CHECK(cache.size() == 1);
  // In memory only: Load and Flush succeed and do nothing.
  CHECK(cache.Load().ok());
  CHECK(cache.Flush().ok());
}

TEST_CASE("every key field matters") {
  ProfileCache cache("");
  cache.Insert(Key(), Record());
  CHECK_FALSE(cache.Find(Key("abc124")).has_value());
  CHECK_FALSE(cache.Find(Key("abc123", 16)).has_value());
  ProfileKey other_device = Key();
  other_device.device_type = "cuda";
  CHECK_FALSE(cache.Find(other_device).has_value());
  ProfileKey other_options = Key();
  other_options.options = "recompute=1";
  CHECK_FALSE(cache.Find(other_options).has_value());
  CHECK(cache.Find(Key()).has_value());
}

TEST_CASE("Flush and Load round trip exactly, in a fresh object") {
  const fs::path path = MakeTempDir() / "nested" / "dir" / "profiles.tsv";  // dirs created
  ProfileKey odd{"tab\there\nnewline\\back\rslash", -1, "", "a=1\tb=2"};
  ProfileRecord tiny;
  tiny.fwd_ms = 1e-300;
  tiny.bwd_ms = 1.0 / 3.0;
  {
    ProfileCache cache(path.string());
    REQUIRE(cache.Load().ok());  // missing file: empty cache
    CHECK(cache.size() == 0);
    for (int mb : {1, 2, 4, 8}) cache.Insert(Key("h", mb), Record(mb * 0.1));
    cache.Insert(odd, tiny);
    absl::Status flushed = cache.Flush();
    INFO(flushed.ToString());
    REQUIRE(flushed.ok());
  }
  const std::string text = ReadAll(path);
  CHECK(text.rfind("rannc-profile-cache v1\n", 0) == 0);
  CHECK(std::count(text.begin(), text.end(), '\n') == 6);
  for (const auto& entry : fs::directory_iterator(path.parent_path())) {
    CHECK(entry.path().filename() == "profiles.tsv");  // no temporary file left behind
  }

  ProfileCache loaded(path.string());
  absl::Status status = loaded.Load();
  INFO(status.ToString());
  REQUIRE(status.ok());
  CHECK(loaded.size() == 5);
  for (int mb : {1, 2, 4, 8}) {
    std::optional<ProfileRecord> r = loaded.Find(Key("h", mb));
    REQUIRE(r.has_value());
    CHECK(*r == Record(mb * 0.1));  // exact double equality
  }
  REQUIRE(loaded.Find(odd).has_value());
  CHECK(*loaded.Find(odd) == tiny);
}

TEST_CASE("Flush merges records another process flushed") {
  const fs::path path = MakeTempDir() / "profiles.tsv";
  ProfileCache a(path.string());
  ProfileCache b(path.string());
  a.Insert(Key("a"), Record(1));
  b.Insert(Key("b"), Record(2));
  b.Insert(Key("shared"), Record(3));
  REQUIRE(b.Flush().ok());
  a.Insert(Key("shared"), Record(4));  // a's own record wins over the file's
  REQUIRE(a.Flush().ok());
  CHECK(a.size() == 3);
  ProfileCache c(path.string());
  REQUIRE(c.Load().ok());
  CHECK(c.size() == 3);
  CHECK(c.Find(Key("b"))->fwd_ms == 2);
  CHECK(c.Find(Key("shared"))->fwd_ms == 4);
}

TEST_CASE("Load keeps records inserted before it") {
  const fs::path path = MakeTempDir() / "profiles.tsv";
  {
    ProfileCache writer(path.string());
    writer.Insert(Key(), Record(1));
    REQUIRE(writer.Flush().ok());
  }
  ProfileCache cache(path.string());
  cache.Insert(Key(), Record(2));
  REQUIRE(cache.Load().ok());
  CHECK(cache.Find(Key())->fwd_ms == 2);
}

TEST_CASE("a corrupt file is an error naming the file and line, and leaves the cache alone") {
  const fs::path path = MakeTempDir() / "profiles.tsv";
  {
    ProfileCache writer(path.string());
    writer.Insert(Key("x"), Record());
    writer.Insert(Key("y"), Record());
    REQUIRE(writer.Flush().ok());
  }
  const std::string good = ReadAll(path);
  const std::pair<std::string, std::string> cases[] = {
      {good + "only\tthree\tfields\n", "line 4: expected 10 tab-separated fields, found 3"},
      {good + "h\teight\tcpu\t\t1\t2\t3\t4\t5\t6\n", "line 4: field 2 (micro_batch)"},
      {good + "h\t8\tcpu\t\t1\tslow\t3\t4\t5\t6\n", "line 4: field 6 (bwd_ms)"},
      {good + "h\t8\tcpu\t\t1\t2\t-3\t4\t5\t6\n", "line 4: field 7 (act_bytes)"},
      {good + "bad\\x\t8\tcpu\t\t1\t2\t3\t4\t5\t6\n", "line 4: field 1 (graph_hash)"},
  };
  for (const auto& [text, expected] : cases) {
    WriteAll(path, text);
    ProfileCache cache(path.string());
    cache.Insert(Key("mine"), Record());
    absl::Status status = cache.Load();
    INFO(status.ToString());
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(status.message()), Catch::Contains(path.string()));
    CHECK_THAT(std::string(status.message()), Catch::Contains(expected));
    CHECK(cache.size() == 1);  // nothing of the file was added
    // The daemon carries on; the next Flush replaces the corrupt file with a good one.
    REQUIRE(cache.Flush().ok());
    ProfileCache reloaded(path.string());
    REQUIRE(reloaded.Load().ok());
    CHECK(reloaded.size() == 1);
  }
}

TEST_CASE("a wrong header or an empty file is rejected") {
  const fs::path path = MakeTempDir() / "profiles.tsv";
  WriteAll(path, "rannc-profile-cache v2\n");
  ProfileCache cache(path.string());
  absl::Status status = cache.Load();
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(status.message()), Catch::Contains(path.string()));
  CHECK_THAT(std::string(status.message()), Catch::Contains("line 1"));
  WriteAll(path, "");
  status = cache.Load();
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::Contains("empty"));
}

TEST_CASE("an unwritable location is a clear error") {
  const fs::path dir = MakeTempDir();
  WriteAll(dir / "file", "x");
  ProfileCache cache((dir / "file" / "profiles.tsv").string());  // parent is a regular file
  cache.Insert(Key(), Record());
  absl::Status status = cache.Flush();
  INFO(status.ToString());
  CHECK_FALSE(status.ok());
  CHECK_THAT(std::string(status.message()), Catch::Contains("profiles.tsv"));
  CHECK(cache.size() == 1);
}

TEST_CASE("concurrent Insert, Find and Flush") {
  const fs::path path = MakeTempDir() / "profiles.tsv";
  ProfileCache cache(path.string());
  constexpr int kThreads = 8;
  constexpr int kPerThread = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        cache.Insert(Key(absl::StrCat("t", t), i), Record(i));
        if (!cache.Find(Key(absl::StrCat("t", t), i)).has_value()) FAIL_CHECK("lost insert");
        if (i % 100 == 0 && !cache.Flush().ok()) FAIL_CHECK("flush failed");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(cache.size() == kThreads * kPerThread);
  REQUIRE(cache.Flush().ok());
  ProfileCache loaded(path.string());
  REQUIRE(loaded.Load().ok());
  CHECK(loaded.size() == kThreads * kPerThread);
  CHECK(loaded.Find(Key("t7", 299))->fwd_ms == 299);
}

TEST_CASE("DefaultProfileCachePath follows the environment") {
  setenv("RANNC_PROFILE_CACHE", "/x/p.tsv", 1);
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  setenv("HOME", "/home/u", 1);
  CHECK(DefaultProfileCachePath() == "/x/p.tsv");
  setenv("RANNC_PROFILE_CACHE", "", 1);  // empty counts as unset
  CHECK(DefaultProfileCachePath() == "/xdg/rannc/profiles.tsv");
  unsetenv("XDG_CACHE_HOME");
  CHECK(DefaultProfileCachePath() == "/home/u/.cache/rannc/profiles.tsv");
  unsetenv("HOME");
  CHECK(DefaultProfileCachePath() == "");
}

}  // namespace
}  // namespace planner
}  // namespace rannc
