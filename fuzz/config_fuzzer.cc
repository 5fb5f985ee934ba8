// Fuzz target: a rannc.toml of any bytes through LoadDaemonOptions (--config FILE), which parses
// the TOML, checks each key against the registry and each value against its kind (sizes,
// durations, device lists, addresses). It must return a status, never crash, hang or leak.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/config/options.h"

namespace {

// One file, rewritten for each input (the loader reads a path).
const std::string& ConfigPath() {
  static const std::string path = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/rannc-fuzz-XXXXXX.toml";
    const int fd = ::mkstemps(pattern.data(), 5);
    if (fd < 0) std::abort();
    ::close(fd);
    return pattern;
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = ConfigPath();
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC);
  if (fd < 0) std::abort();
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::write(fd, data + written, size - written);
    if (n <= 0) std::abort();
    written += static_cast<size_t>(n);
  }
  ::close(fd);
  std::vector<std::string> args = {"ranncd", "--config", path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  (void)rannc::LoadDaemonOptions(static_cast<int>(args.size()), argv.data(), {});
  return 0;
}
