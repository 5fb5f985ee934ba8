// The random training windows that `rannc train` draws from a token file
// (daemon/common/token_file.h).
//
// Thread-safety: SampleTokenBatch may run on several threads if each passes its own generator.
//
// Example:
//   absl::StatusOr<rannc::TokenFile> tokens = rannc::TokenFile::Open("train.bin", "uint16");
//   std::mt19937_64 rng(seed);
//   rannc::TokenBatch batch = rannc::SampleTokenBatch(*tokens, rng, /*batch=*/8, /*seq=*/128);
//   // batch.targets[b][t] == batch.input_ids[b][t + 1] within the file: next-token targets.
#ifndef RANNC_CLIENT_TOKEN_DATA_H_
#define RANNC_CLIENT_TOKEN_DATA_H_

#include <cstdint>
#include <random>

#include "client/host_tensor.h"
#include "daemon/common/token_file.h"

namespace rannc {

struct TokenBatch {
  HostTensor input_ids;  // int64 [batch, seq]
  HostTensor targets;    // int64 [batch, seq]: each window shifted by one token
};

// `batch` windows of seq + 1 consecutive tokens, each starting at a uniformly random position.
// Requires tokens.size() >= seq + 1.
TokenBatch SampleTokenBatch(const TokenFile& tokens, std::mt19937_64& rng, int64_t batch,
                            int64_t seq);

}  // namespace rannc

#endif  // RANNC_CLIENT_TOKEN_DATA_H_
