// The fuzz targets' main where libFuzzer is not linked (fuzz/BUILD): runs each file named on the
// command line, or each file in each directory named, through LLVMFuzzerTestOneInput once. The
// seed corpora are replayed this way in CI; a crash is the test's failure.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Defined by the targets that set something up first (libFuzzer calls it the same way).
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

bool RunFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  int ran = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    struct stat st;
    if (::stat(arg.c_str(), &st) != 0) {
      std::fprintf(stderr, "no such file or directory: %s\n", arg.c_str());
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (!RunFile(arg)) return 1;
      ++ran;
      continue;
    }
    DIR* dir = ::opendir(arg.c_str());
    if (dir == nullptr) return 1;
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(dir)) {
      if (e->d_name[0] != '.') names.push_back(arg + "/" + e->d_name);
    }
    ::closedir(dir);
    for (const std::string& name : names) {
      if (!RunFile(name)) return 1;
      ++ran;
    }
  }
  std::printf("%d input(s) run\n", ran);
  return 0;
}
