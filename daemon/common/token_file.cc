#include "daemon/common/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rannc {

absl::StatusOr<TokenFile> TokenFile::Open(const std::string& path, const std::string& dtype) {
  TokenFile file;
  if (dtype == "uint8") {
    file.token_bytes_ = 1;
  } else if (dtype == "uint16") {
    file.token_bytes_ = 2;
  } else if (dtype == "uint32") {
    file.token_bytes_ = 4;
  } else if (dtype == "int32") {
    file.token_bytes_ = 4;
    file.is_signed_ = true;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown token dtype '", dtype, "' (use uint8, uint16, uint32 or int32)"));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", std::strerror(err)));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size % file.token_bytes_ != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " has ", size, " bytes, not a multiple of ",
                                                   file.token_bytes_, " (", dtype,
                                                   " tokens); is the token dtype right?"));
  }
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot map ", path, ": ", std::strerror(err)));
    }
    file.bytes_ = static_cast<const unsigned char*>(p);
    file.mapped_bytes_ = size;
  }
  ::close(fd);  // the mapping keeps the file alive
  file.num_tokens_ = size / file.token_bytes_;
  return file;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    Release();
    bytes_ = std::exchange(other.bytes_, nullptr);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
    token_bytes_ = other.token_bytes_;
    is_signed_ = other.is_signed_;
    num_tokens_ = std::exchange(other.num_tokens_, 0);
  }
  return *this;
}

TokenFile::~TokenFile() { Release(); }

void TokenFile::Release() {
  if (bytes_ != nullptr) ::munmap(const_cast<unsigned char*>(bytes_), mapped_bytes_);
  bytes_ = nullptr;
  mapped_bytes_ = 0;
}

int64_t TokenFile::at(size_t i) const {
  const unsigned char* p = bytes_ + i * token_bytes_;
  switch (token_bytes_) {
    case 1: return p[0];
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    default: {
      if (!is_signed_) {
        uint32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
}

int64_t TokenFile::MaxToken() const {
  int64_t max = -1;
  for (size_t i = 0; i < num_tokens_; ++i) max = std::max(max, at(i));
  return max;
}

}  // namespace rannc
