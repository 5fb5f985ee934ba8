// TokenFile: a flat file of token ids (uint8, uint16, uint32 or int32, little-endian, no header:
// the format nanoGPT and most tokenizer scripts write), memory-mapped read-only for the
// TokenFile's lifetime, so a multi-GiB corpus costs no copy. `rannc train` samples its windows
// from one (client/token_data.h); a detached job's daemon reads one itself.
//
// Thread-safety: a TokenFile is immutable after Open; any thread may read it.
//
// Example:
//   absl::StatusOr<rannc::TokenFile> tokens = rannc::TokenFile::Open("train.bin", "uint16");
//   int64_t first = tokens->at(0);
#ifndef RANNC_DAEMON_COMMON_TOKEN_FILE_H_
#define RANNC_DAEMON_COMMON_TOKEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace rannc {

class TokenFile {
 public:
  // `dtype` is "uint8", "uint16", "uint32" or "int32". NOT_FOUND for a missing file;
  // INVALID_ARGUMENT for a size that is not a multiple of the token size or an unknown dtype.
  static absl::StatusOr<TokenFile> Open(const std::string& path, const std::string& dtype);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  size_t size() const { return num_tokens_; }
  int64_t at(size_t i) const;
  // The largest id in the file (one pass over it); -1 for an empty file.
  int64_t MaxToken() const;

 private:
  TokenFile() = default;
  void Release();

  const unsigned char* bytes_ = nullptr;
  size_t mapped_bytes_ = 0;
  size_t token_bytes_ = 0;
  bool is_signed_ = false;
  size_t num_tokens_ = 0;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_TOKEN_FILE_H_
