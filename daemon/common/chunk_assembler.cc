#include "daemon/common/chunk_assembler.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/wire_dtype.h"

namespace rannc {

ChunkAssembler::ChunkAssembler(absl::StatusCode code, Allocate allocate)
    : code_(code), allocate_(std::move(allocate)) {}

absl::Status ChunkAssembler::Add(const v1::StateDictChunk& chunk) {
  const std::string what = absl::StrCat("state_dict entry '", chunk.name(), "'");
  auto fail = [&](auto&&... parts) { return absl::Status(code_, absl::StrCat(what, parts...)); };
  const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  auto it = partial_.find(chunk.name());
  if (it == partial_.end()) {
    if (chunk.offset() != 0) return fail(": chunk at offset ", chunk.offset(), ", expected 0");
    absl::StatusOr<size_t> expected = DenseBytes(chunk.dtype(), shape, what);
    if (!expected.ok()) return absl::Status(code_, expected.status().message());
    if (chunk.total_bytes() != *expected) {
      return fail(": ", chunk.total_bytes(), " bytes for ", DescribeTensor(chunk.dtype(), shape),
                  ", which needs ", *expected);
    }
    Partial p;
    p.entry.name = chunk.name();
    p.entry.dtype = chunk.dtype();
    p.entry.shape = shape;
    p.entry.total_bytes = chunk.total_bytes();
    // Checked before allocating, so that a bad chunk costs no memory.
    if (chunk.data().size() > p.entry.total_bytes) {
      return fail(": ", chunk.data().size(), " bytes received, more than its ",
                  p.entry.total_bytes);
    }
    absl::StatusOr<char*> buffer = allocate_(p.entry);
    if (!buffer.ok()) return buffer.status();
    p.buffer = *buffer;
    it = partial_.emplace(chunk.name(), std::move(p)).first;
  } else {
    const Partial& p = it->second;
    if (chunk.offset() == 0 && (p.filled > 0 || p.filled == p.entry.total_bytes)) {
      return fail(" sent twice");
    }
    if (chunk.dtype() != p.entry.dtype || shape != p.entry.shape ||
        chunk.total_bytes() != p.entry.total_bytes) {
      return fail(": chunks disagree on dtype, shape or size (",
                  DescribeTensor(chunk.dtype(), shape), " in ", chunk.total_bytes(),
                  " bytes, first ", DescribeTensor(p.entry.dtype, p.entry.shape), " in ",
                  p.entry.total_bytes, " bytes)");
    }
    if (chunk.offset() != p.filled) {
      return fail(": chunk at offset ", chunk.offset(), ", expected ", p.filled);
    }
    if (p.filled + chunk.data().size() > p.entry.total_bytes) {
      return fail(": ", p.filled + chunk.data().size(), " bytes received, more than its ",
                  p.entry.total_bytes);
    }
  }
  Partial& p = it->second;
  if (chunk.is_buffer()) buffers_.insert(chunk.name());
  if (!chunk.data().empty()) {
    std::memcpy(p.buffer + p.filled, chunk.data().data(), chunk.data().size());
    p.filled += chunk.data().size();
  }
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Finish() const {
  std::vector<std::string> incomplete;
  for (const auto& [name, p] : partial_) {
    if (p.filled != p.entry.total_bytes) {
      incomplete.push_back(
          absl::StrCat("'", name, "' (", p.filled, " of ", p.entry.total_bytes, " bytes)"));
    }
  }
  if (incomplete.empty()) return absl::OkStatus();
  return absl::Status(code_, absl::StrCat("state_dict stream ended with incomplete entries: ",
                                          absl::StrJoin(incomplete, ", ")));
}

}  // namespace rannc
