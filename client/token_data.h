// TokenFile: a flat file of token ids (uint8, uint16 or int32, little-endian, no header: the
// format nanoGPT and most tokenizer scripts write) and the random training windows that
// `rannc train` draws from it. The file is memory-mapped read-only for the TokenFile's lifetime,
// so a multi-GiB corpus costs no copy.
//
// Thread-safety: a TokenFile is immutable after Open; SampleBatch may run on several threads if
// each passes its own generator.
//
// Example:
//   absl::StatusOr<rannc::TokenFile> tokens = rannc::TokenFile::Open("train.bin", "uint16");
//   std::mt19937_64 rng(seed);
//   rannc::TokenBatch batch = tokens->SampleBatch(rng, /*batch=*/8, /*seq=*/128);
//   // batch.targets[b][t] == batch.input_ids[b][t + 1] within the file: next-token targets.
#ifndef RANNC_CLIENT_TOKEN_DATA_H_
#define RANNC_CLIENT_TOKEN_DATA_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "client/host_tensor.h"

namespace rannc {

struct TokenBatch {
  HostTensor input_ids;  // int64 [batch, seq]
  HostTensor targets;    // int64 [batch, seq]: each window shifted by one token
};

class TokenFile {
 public:
  // `dtype` is "uint8", "uint16" or "int32". Fails for a missing file, a size that is not a
  // multiple of the token size, or an unknown dtype.
  static absl::StatusOr<TokenFile> Open(const std::string& path, const std::string& dtype);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  size_t size() const { return num_tokens_; }
  int64_t at(size_t i) const;

  // `batch` windows of seq + 1 consecutive tokens, each starting at a uniformly random
  // position. Requires size() >= seq + 1 (checked by Open's caller via size()).
  TokenBatch SampleBatch(std::mt19937_64& rng, int64_t batch, int64_t seq) const;

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

#endif  // RANNC_CLIENT_TOKEN_DATA_H_
