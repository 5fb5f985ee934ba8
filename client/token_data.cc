#include "client/token_data.h"

#include <vector>

namespace rannc {

TokenBatch SampleTokenBatch(const TokenFile& tokens, std::mt19937_64& rng, int64_t batch,
                            int64_t seq) {
  std::uniform_int_distribution<size_t> start(0, tokens.size() - static_cast<size_t>(seq) - 1);
  std::vector<int64_t> inputs(static_cast<size_t>(batch * seq));
  std::vector<int64_t> targets(inputs.size());
  for (int64_t b = 0; b < batch; ++b) {
    const size_t s = start(rng);
    for (int64_t t = 0; t < seq; ++t) {
      inputs[b * seq + t] = tokens.at(s + t);
      targets[b * seq + t] = tokens.at(s + t + 1);
    }
  }
  return {HostTensor::FromVector(inputs, {batch, seq}),
          HostTensor::FromVector(targets, {batch, seq})};
}

}  // namespace rannc
