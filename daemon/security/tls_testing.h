// Test helper: certificates made for real by deploy/tls/make-certs.sh (openssl) in a temporary
// directory: a CA and certificates it signs for 127.0.0.1/localhost. Header-only; uses Catch2.
#ifndef RANNC_DAEMON_SECURITY_TLS_TESTING_H_
#define RANNC_DAEMON_SECURITY_TLS_TESTING_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

namespace rannc::testing {

// The bytes of the file at `path` ("" when it cannot be read).
inline std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Replaces `path` with `text` by rename, as Kubernetes' atomic writer does.
inline void Replace(const std::string& path, const std::string& text) {
  std::ofstream(path + ".new", std::ios::binary | std::ios::trunc) << text;
  std::filesystem::rename(path + ".new", path);
}

// DIR/ca.crt, and DIR/NAME.crt and DIR/NAME.key for each call of Issue.
class TestCa {
 public:
  TestCa() {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* workspace = std::getenv("TEST_WORKSPACE");
    REQUIRE(srcdir != nullptr);
    script_ = std::string(srcdir) + "/" + (workspace ? workspace : "rannc") +
              "/deploy/tls/make-certs.sh";
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp ? tmp : "/tmp") + "/rannc-ca-XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    dir_ = pattern;
  }
  // Makes NAME.crt/NAME.key signed by this CA (the CA itself on the first call).
  void Issue(const std::string& name) const {
    const std::string command = script_ + " " + dir_ + " " + name + " > /dev/null";
    REQUIRE(std::system(command.c_str()) == 0);
  }
  std::string ca() const { return dir_ + "/ca.crt"; }
  std::string cert(const std::string& name) const { return dir_ + "/" + name + ".crt"; }
  std::string key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  const std::string& dir() const { return dir_; }

 private:
  std::string script_;
  std::string dir_;
};

}  // namespace rannc::testing

#endif  // RANNC_DAEMON_SECURITY_TLS_TESTING_H_
