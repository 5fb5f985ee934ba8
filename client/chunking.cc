#include "client/chunking.h"

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"

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

HostStateDictAssembler::HostStateDictAssembler()
    : chunks_(absl::StatusCode::kDataLoss,
              [this](const ChunkAssembler::Entry& entry) { return Allocate(entry); }) {}

absl::StatusOr<char*> HostStateDictAssembler::Allocate(const ChunkAssembler::Entry& entry) {
  HostTensor& t = tensors_[entry.name];
  t.dtype = entry.dtype;
  t.shape = entry.shape;
  try {
    t.data.resize(entry.total_bytes);
  } catch (const std::exception&) {  // std::bad_alloc, std::length_error
    tensors_.erase(entry.name);
    return absl::ResourceExhaustedError(absl::StrCat(
        "state_dict entry '", entry.name, "': no memory for its ", entry.total_bytes, " bytes"));
  }
  return t.data.data();
}

absl::StatusOr<NamedTensors> HostStateDictAssembler::Finish() && {
  absl::Status complete = chunks_.Finish();
  if (!complete.ok()) return complete;
  return std::move(tensors_);
}

}  // namespace rannc
