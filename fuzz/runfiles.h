// Fuzz-target helper: reading test fixtures (tests/fixtures/..., relative paths) from the
// target's Bazel runfiles, whatever directory tools/fuzz.sh runs it in, while the corpus paths
// on its command line stay relative to the caller's directory.
//
//   LLVMFuzzerInitialize: rannc::fuzz::FindRunfiles((*argv)[0]);
//   later:                rannc::fuzz::InRunfiles([&] { fixture = LoadFixture("mlp"); });
//
// Not thread-safe (the working directory is the process's): call it before the target starts
// threads of its own, or from one thread.
#ifndef RANNC_FUZZ_RUNFILES_H_
#define RANNC_FUZZ_RUNFILES_H_

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace rannc::fuzz {

// The runfiles' workspace directory ("": the process runs from it already, as under bazel test).
inline std::string& Runfiles() {
  static std::string dir;
  return dir;
}

// Notes `argv0`'s runfiles directory, when it has one.
inline void FindRunfiles(const char* argv0) {
  const std::string runfiles = std::string(argv0) + ".runfiles/rannc";
  if (::access(runfiles.c_str(), F_OK) == 0) Runfiles() = runfiles;
}

// Runs fn() in the runfiles' directory, then returns to the one it was called in (aborts if
// either cannot be entered).
template <typename Fn>
void InRunfiles(Fn&& fn) {
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) std::abort();
  if (!Runfiles().empty() && ::chdir(Runfiles().c_str()) != 0) std::abort();
  fn();
  if (::chdir(cwd) != 0) std::abort();
}

}  // namespace rannc::fuzz

#endif  // RANNC_FUZZ_RUNFILES_H_
