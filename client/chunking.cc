#include "client/chunking.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {

std::vector<std::string_view> SplitBytes(std::string_view bytes, size_t max_chunk) {
  std::vector<std::string_view> pieces;
  if (max_chunk == 0) max_chunk = 1;
  for (size_t offset = 0; offset < bytes.size(); offset += max_chunk) {
    pieces.push_back(bytes.substr(offset, max_chunk));
  }
  return pieces;
}

std::vector<v1::StateDictChunk> ToStateDictChunks(const std::string& name,
                                                  const HostTensor& tensor, bool is_buffer,
                                                  size_t max_chunk) {
  v1::StateDictChunk header;
  header.set_name(name);
  header.set_dtype(tensor.dtype);
  header.mutable_shape()->Add(tensor.shape.begin(), tensor.shape.end());
  header.set_total_bytes(tensor.data.size());
  header.set_is_buffer(is_buffer);

  std::vector<v1::StateDictChunk> chunks;
  std::vector<std::string_view> pieces = SplitBytes(tensor.data, max_chunk);
  if (pieces.empty()) pieces.emplace_back();
  uint64_t offset = 0;
  for (std::string_view piece : pieces) {
    v1::StateDictChunk& chunk = chunks.emplace_back(header);
    chunk.set_offset(offset);
    chunk.set_data(piece.data(), piece.size());
    offset += piece.size();
  }
  return chunks;
}

absl::Status StateDictAssembler::Add(const v1::StateDictChunk& chunk) {
  const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  auto [it, inserted] = partial_.try_emplace(chunk.name());
  Partial& p = it->second;
  if (inserted) {
    p.tensor.dtype = chunk.dtype();
    p.tensor.shape = shape;
    p.total_bytes = chunk.total_bytes();
    HostTensor expected_size{chunk.dtype(), shape, {}};
    const uint64_t expected = static_cast<uint64_t>(expected_size.NumElements()) *
                              DTypeSize(chunk.dtype());
    if (DTypeSize(chunk.dtype()) == 0 || expected != chunk.total_bytes()) {
      return absl::DataLossError(absl::StrCat(
          "state_dict entry '", chunk.name(), "' is ", expected_size.DebugString(),
          " but announces ", chunk.total_bytes(), " bytes"));
    }
    p.tensor.data.reserve(chunk.total_bytes());
  } else if (p.tensor.dtype != chunk.dtype() || p.tensor.shape != shape ||
             p.total_bytes != chunk.total_bytes()) {
    return absl::DataLossError(absl::StrCat("state_dict entry '", chunk.name(),
                                            "': chunks disagree on dtype, shape or size"));
  }
  if (chunk.is_buffer()) buffers_.insert(chunk.name());
  if (chunk.offset() != p.tensor.data.size()) {
    return absl::DataLossError(absl::StrCat("state_dict entry '", chunk.name(),
                                            "': chunk at offset ", chunk.offset(), ", expected ",
                                            p.tensor.data.size()));
  }
  if (p.tensor.data.size() + chunk.data().size() > p.total_bytes) {
    return absl::DataLossError(absl::StrCat("state_dict entry '", chunk.name(), "': ",
                                            p.tensor.data.size() + chunk.data().size(),
                                            " bytes received, more than its ", p.total_bytes));
  }
  p.tensor.data.append(chunk.data());
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> StateDictAssembler::Finish() && {
  NamedTensors out;
  std::vector<std::string> incomplete;
  for (auto& [name, p] : partial_) {
    if (p.tensor.data.size() != p.total_bytes) {
      incomplete.push_back(absl::StrCat(name, " (", p.tensor.data.size(), " of ", p.total_bytes,
                                        " bytes)"));
      continue;
    }
    out.emplace(name, std::move(p.tensor));
  }
  if (!incomplete.empty()) {
    return absl::DataLossError(absl::StrCat("state_dict stream ended with incomplete tensors: ",
                                            absl::StrJoin(incomplete, ", ")));
  }
  return out;
}

}  // namespace rannc
