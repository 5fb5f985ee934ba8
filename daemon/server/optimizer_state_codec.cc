#include "daemon/server/optimizer_state_codec.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"

namespace rannc {

absl::Status EncodeOptimizerState(const std::vector<OptimizerEntry>& state, size_t chunk_bytes,
                                  const std::function<bool(const v1::StateDictChunk&)>& write) {
  for (const OptimizerEntry& entry : state) {
    absl::Status written = EncodeStateChunks(
        entry.param, entry.value, /*is_buffer=*/false, chunk_bytes,
        [&](const v1::StateDictChunk& chunk) {
          v1::StateDictChunk keyed = chunk;
          keyed.set_state_key(entry.key);
          return write(keyed);
        });
    if (!written.ok()) return written;
  }
  return absl::OkStatus();
}

absl::Status OptimizerStateAssembler::Add(v1::StateDictChunk chunk) {
  if (chunk.state_key().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state chunk for '", chunk.name(), "' has no state_key"));
  }
  chunk.set_name(absl::StrCat(chunk.name(), "[", chunk.state_key(), "]"));
  return tensors_.Add(chunk);
}

absl::StatusOr<std::vector<OptimizerEntry>> OptimizerStateAssembler::Finish() {
  absl::StatusOr<std::map<std::string, at::Tensor>> assembled = tensors_.Finish();
  if (!assembled.ok()) return assembled.status();
  std::vector<OptimizerEntry> state;
  for (auto& [joined, value] : *assembled) {
    const size_t cut = joined.rfind('[');
    state.push_back({joined.substr(0, cut), joined.substr(cut + 1, joined.size() - cut - 2),
                     std::move(value)});
  }
  return state;
}

}  // namespace rannc
