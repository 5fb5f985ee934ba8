// TlsFileMirror driven by Refresh (no thread, no sleeping): which sets replace the copies, which
// are rejected and logged once, and what the copies look like on disk.
#include "daemon/security/tls_mirror.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <catch2/catch.hpp>

#include "daemon/security/tls_testing.h"

namespace rannc {
namespace security {
namespace {

using testing::Read;
using testing::Replace;

using Outcome = TlsFileMirror::Outcome;

struct stat Stat(const std::string& path) {
  struct stat st;
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// spdlog's default logger writes to a string while it lives.
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("captured", sink));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> previous_;
};

TEST_CASE("TlsFileMirror: checked copies in a private directory, gone with the mirror",
          "[tls]") {
  testing::TestCa ca;
  ca.Issue("one");
  std::string dir;
  {
    absl::StatusOr<std::unique_ptr<TlsFileMirror>> mirror = TlsFileMirror::Start(
        {ca.cert("one"), ca.key("one"), ca.ca()}, "--tls", {std::chrono::seconds(0), ca.dir()});
    REQUIRE(mirror.ok());
    const TlsFileMirror& m = **mirror;
    dir = m.dir();
    CHECK((Stat(dir).st_mode & 0777) == 0700);
    // gRPC reads the key and the certificate from one file.
    CHECK(m.files().cert == m.files().key);
    CHECK((Stat(m.files().cert).st_mode & 0777) == 0600);
    CHECK((Stat(m.files().ca).st_mode & 0777) == 0600);
    CHECK(Read(m.files().cert) == Read(ca.key("one")) + Read(ca.cert("one")));
    CHECK(Read(m.files().ca) == Read(ca.ca()));
    CHECK(CheckTlsFiles(m.files(), "copy", true).ok());
    CHECK(m.serving().rfind("CN=one, valid until ", 0) == 0);
  }
  CHECK_FALSE(std::filesystem::exists(dir));
}

TEST_CASE("TlsFileMirror: bad files at start are the errors CheckTlsFiles gives", "[tls]") {
  testing::TestCa ca;
  ca.Issue("one");
  ca.Issue("two");
  const TlsFiles mismatched{ca.cert("one"), ca.key("two"), ""};
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> mirror =
      TlsFileMirror::Start(mismatched, "--tls", {std::chrono::seconds(0), ca.dir()});
  REQUIRE_FALSE(mirror.ok());
  CHECK(mirror.status() == CheckTlsFiles(mismatched, "--tls", true));
  mirror = TlsFileMirror::Start({ca.dir() + "/missing.crt", ca.key("one"), ""}, "--tls",
                                {std::chrono::seconds(0), ca.dir()});
  CHECK_THAT(std::string(mirror.status().message()),
             Catch::StartsWith("--tls-cert " + ca.dir() + "/missing.crt: cannot be read"));
}

TEST_CASE("TlsFileMirror: a good rotation replaces the copies; a bad one is logged once and "
          "leaves them", "[tls]") {
  testing::TestCa ca;
  ca.Issue("one");
  ca.Issue("two");
  ca.Issue("three");
  testing::TestCa live;
  const std::string cert = live.dir() + "/tls.crt", key = live.dir() + "/tls.key";
  Replace(key, Read(ca.key("one")));
  Replace(cert, Read(ca.cert("one")));
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> started = TlsFileMirror::Start(
      {cert, key, ""}, "--tls", {std::chrono::seconds(0), live.dir()});
  REQUIRE(started.ok());
  TlsFileMirror& mirror = **started;
  const std::string copy = mirror.files().cert;
  CHECK(mirror.files().ca.empty());
  CHECK(mirror.Refresh() == Outcome::kUnchanged);

  CapturedLog log;
  Replace(key, Read(ca.key("two")));
  Replace(cert, Read(ca.cert("two")));
  const time_t before = Stat(copy).st_mtime;
  CHECK(mirror.Refresh() == Outcome::kReplaced);
  CHECK(Read(copy) == Read(ca.key("two")) + Read(ca.cert("two")));
  // Each version of the copy has a time of its own, in whole seconds: gRPC's check for a file
  // replaced while it reads.
  CHECK(Stat(copy).st_mtime > before);
  CHECK(mirror.serving().rfind("CN=two,", 0) == 0);
  CHECK_THAT(log.text(), Catch::Contains("TLS: new files in use: --tls-cert " + cert));
  const std::string good = Read(copy);

  struct Bad {
    std::string cert_text;
    std::string says;
  };
  const std::string three = Read(ca.cert("three"));
  for (const Bad& bad : {
           Bad{"garbage\n", "--tls-cert " + cert + ": not PEM"},
           Bad{three.substr(0, three.size() / 2), "--tls-cert " + cert + ": a PEM block is cut"},
           Bad{"", "--tls-cert " + cert + ": empty"},
           Bad{three, "--tls-key " + key + ": not the key of the certificate in --tls-cert " +
                          cert + " (CN=three"},
       }) {
    INFO(bad.says);
    Replace(cert, bad.cert_text);
    CHECK(mirror.Refresh() == Outcome::kRejected);
    CHECK(mirror.Refresh() == Outcome::kUnchanged);  // the same bad set: not logged again
    CHECK(Read(copy) == good);
    CHECK_THAT(std::string(mirror.last_error().message()), Catch::StartsWith(bad.says));
    CHECK(Count(log.text(), bad.says) == 1);
    CHECK_THAT(log.text(), Catch::Contains("the last good ones (CN=two,"));
  }
  std::filesystem::remove(key);
  CHECK(mirror.Refresh() == Outcome::kRejected);
  CHECK(mirror.Refresh() == Outcome::kUnchanged);
  CHECK(Count(log.text(), "--tls-key " + key + ": cannot be read") == 1);

  // The same good pair back: nothing to copy; a new one: copied.
  Replace(key, Read(ca.key("two")));
  Replace(cert, Read(ca.cert("two")));
  CHECK(mirror.Refresh() == Outcome::kUnchanged);
  CHECK(mirror.last_error().ok());
  CHECK_THAT(log.text(), Catch::Contains("pass the checks again"));
  Replace(key, Read(ca.key("three")));
  Replace(cert, three);
  CHECK(mirror.Refresh() == Outcome::kReplaced);
  CHECK(Read(copy) == Read(ca.key("three")) + three);
  CHECK(mirror.serving().rfind("CN=three,", 0) == 0);
}

TEST_CASE("TlsFileMirror: root certificates alone (a client's) are checked and copied too",
          "[tls]") {
  testing::TestCa ca, other;
  ca.Issue("one");
  other.Issue("stranger");
  testing::TestCa live;
  const std::string roots = live.dir() + "/roots.crt";
  Replace(roots, Read(ca.ca()));
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> started = TlsFileMirror::Start(
      {"", "", roots}, "--cluster-store", {std::chrono::seconds(0), live.dir()});
  REQUIRE(started.ok());
  TlsFileMirror& mirror = **started;
  CHECK(mirror.files().cert.empty());
  CHECK(mirror.files().key.empty());
  Replace(roots, "-----BEGIN CERTIFICATE-----\nAAAA\n");
  CHECK(mirror.Refresh() == Outcome::kRejected);
  CHECK_THAT(std::string(mirror.last_error().message()),
             Catch::StartsWith("--cluster-store-ca " + roots + ": a PEM block is cut short"));
  CHECK(Read(mirror.files().ca) == Read(ca.ca()));
  Replace(roots, Read(other.ca()));
  CHECK(mirror.Refresh() == Outcome::kReplaced);
  CHECK(Read(mirror.files().ca) == Read(other.ca()));
}

TEST_CASE("TlsFileMirror: its thread reads the files every refresh", "[tls]") {
  testing::TestCa ca;
  ca.Issue("one");
  ca.Issue("two");
  testing::TestCa live;
  const std::string cert = live.dir() + "/tls.crt", key = live.dir() + "/tls.key";
  Replace(key, Read(ca.key("one")));
  Replace(cert, Read(ca.cert("one")));
  absl::StatusOr<std::unique_ptr<TlsFileMirror>> started = TlsFileMirror::Start(
      {cert, key, ""}, "--tls", {std::chrono::milliseconds(50), live.dir()});
  REQUIRE(started.ok());
  Replace(key, Read(ca.key("two")));
  Replace(cert, Read(ca.cert("two")));
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    rotated = (*started)->serving().rfind("CN=two,", 0) == 0;
  }
  CHECK(rotated);
}

}  // namespace
}  // namespace security
}  // namespace rannc
