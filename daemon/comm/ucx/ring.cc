#include "daemon/comm/ucx/ring.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace comm {
namespace {

// Chunk indices have 20 bits in a tag.
constexpr uint64_t kMaxChunks = uint64_t{1} << 20;
// Steps have 12 bits; all-reduce uses 2 * (size - 1) of them.
constexpr int kMaxRingSize = 2048;

int Mod(int a, int n) { return ((a % n) + n) % n; }

float HalfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t f;
  if (exp == 0) {
    if (mant == 0) {
      f = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      f = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (mant << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

// Round to nearest even, as PyTorch does.
uint16_t FloatToHalf(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  const uint32_t sign = (f >> 16) & 0x8000;
  const int32_t exp = (f >> 23) & 0xff;
  uint32_t mant = f & 0x7fffff;
  if (exp == 255) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const int32_t e = exp - 127 + 15;
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return sign | h;
  }
  uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry into exp rounds to inf
  return sign | h;
}

float BFloat16ToFloat(uint16_t b) {
  uint32_t f = uint32_t(b) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

uint16_t FloatToBFloat16(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  if ((f & 0x7fffffff) > 0x7f800000) return (f >> 16) | 0x40;  // keep NaN a NaN
  return (f + 0x7fff + ((f >> 16) & 1)) >> 16;
}

template <typename T>
void ReduceT(ReduceOp op, T* dst, const T* a, const T* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) dst[i] = T(a[i] + b[i]);
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) dst[i] = a[i] > b[i] ? a[i] : b[i];
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) dst[i] = a[i] < b[i] ? a[i] : b[i];
      break;
  }
}

// 16-bit floats go through float in blocks small enough to stay in L1.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Reduce16(ReduceOp op, uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  constexpr size_t kBlock = 512;
  float fa[kBlock], fb[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    for (size_t i = 0; i < m; ++i) fa[i] = ToFloat(a[start + i]);
    for (size_t i = 0; i < m; ++i) fb[i] = ToFloat(b[start + i]);
    ReduceT(op, fa, fa, fb, m);
    for (size_t i = 0; i < m; ++i) dst[start + i] = FromFloat(fa[i]);
  }
}

template <typename T>
void ScaleT(T* data, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i) data[i] = T(data[i] / T(divisor));
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Scale16(uint16_t* data, size_t n, int divisor) {
  const float d = float(divisor);
  for (size_t i = 0; i < n; ++i) data[i] = FromFloat(ToFloat(data[i]) / d);
}

// Requests to finish before the collective returns. Destroying unwaited requests cancels them
// (the P2p contract), which is what an early error return wants.
class Pending {
 public:
  void Add(std::unique_ptr<P2pRequest> request) { requests_.push_back(std::move(request)); }
  absl::Status WaitAll() {
    absl::Status first;
    for (auto& request : requests_) {
      absl::Status s = request->Wait();
      if (first.ok() && !s.ok()) first = s;
    }
    requests_.clear();
    return first;
  }

 private:
  std::vector<std::unique_ptr<P2pRequest>> requests_;
};

// How a buffer splits into one segment per rank, and segments into chunks.
struct Layout {
  std::vector<size_t> off, len;  // elements
  size_t chunk = 1;              // elements per chunk
  size_t es = 1;                 // bytes per element

  size_t NumChunks(int k) const { return (len[k] + chunk - 1) / chunk; }
  size_t ChunkOff(int k, size_t c) const { return off[k] + c * chunk; }  // elements
  size_t ChunkLen(int k, size_t c) const { return std::min(chunk, len[k] - c * chunk); }
};

Layout MakeLayout(const std::vector<size_t>& lens, DataType dtype, const RingConfig& config) {
  Layout layout;
  layout.es = ElementSize(dtype);
  layout.len = lens;
  size_t total = 0, longest = 0;
  for (size_t len : lens) {
    layout.off.push_back(total);
    total += len;
    longest = std::max(longest, len);
  }
  layout.chunk = std::max<size_t>(1, config.chunk_bytes / layout.es);
  layout.chunk = std::max<size_t>(layout.chunk, (longest + kMaxChunks - 1) / kMaxChunks);
  return layout;
}

// Segments as even as possible: the first count % n get one element more.
std::vector<size_t> EvenSplit(size_t count, int n) {
  std::vector<size_t> lens(n, count / n);
  for (size_t k = 0; k < count % size_t(n); ++k) ++lens[k];
  return lens;
}

// Reduce-scatter around the ring. At step s rank r sends segment r-s-1 and receives segment
// r-s-2, so after size-1 steps it holds the reduction of segment r, written to `final_out`.
// Partial sums go to `work` (which may be `in`, for all-reduce) and are forwarded from there.
// `on_final(c)` runs after chunk c of the final segment is written, so all-reduce can start
// the all-gather chunk by chunk.
absl::Status ReduceScatterPhase(P2p& p2p, uint32_t seq, DataType dtype, ReduceOp op,
                                const Layout& L, const char* in, char* work, char* final_out,
                                RingScratch* scratch, Pending* sends,
                                const std::function<void(size_t)>& on_final) {
  const int n = p2p.size(), r = p2p.rank();
  const int left = Mod(r - 1, n), right = Mod(r + 1, n);
  const size_t es = L.es;
  size_t longest = 0;
  for (size_t len : L.len) longest = std::max(longest, len);
  // Two receive slots: step s+1's chunks land while step s's are being reduced.
  char* slot[2] = {scratch->Get(0, longest * es), scratch->Get(1, longest * es)};
  std::vector<std::unique_ptr<P2pRequest>> recvs[2];

  const int first = Mod(r - 1, n);
  for (size_t c = 0; c < L.NumChunks(first); ++c) {
    sends->Add(p2p.StartSend(in + L.ChunkOff(first, c) * es, L.ChunkLen(first, c) * es, right,
                             RingTag(seq, 0, c)));
  }
  auto post_recvs = [&](int s) {
    const int k = Mod(r - s - 2, n);
    auto& slot_recvs = recvs[s % 2];
    slot_recvs.clear();
    for (size_t c = 0; c < L.NumChunks(k); ++c) {
      slot_recvs.push_back(p2p.StartRecv(slot[s % 2] + c * L.chunk * es, L.ChunkLen(k, c) * es,
                                         left, RingTag(seq, s, c)));
    }
  };
  const int steps = n - 1;
  post_recvs(0);
  if (steps > 1) post_recvs(1);
  for (int s = 0; s < steps; ++s) {
    const int k = Mod(r - s - 2, n);
    const bool last = s == steps - 1;
    for (size_t c = 0; c < L.NumChunks(k); ++c) {
      absl::Status status = recvs[s % 2][c]->Wait();
      if (!status.ok()) return status;
      const char* got = slot[s % 2] + c * L.chunk * es;
      const size_t at = L.ChunkOff(k, c) * es, len = L.ChunkLen(k, c);
      if (!last) {
        ReduceInto(dtype, op, work + at, got, in + at, len);
        sends->Add(p2p.StartSend(work + at, len * es, right, RingTag(seq, s + 1, c)));
      } else {
        char* dst = final_out + c * L.chunk * es;
        ReduceInto(dtype, op, dst, got, in + at, len);
        if (op == ReduceOp::kAvg) ScaleDown(dtype, dst, len, n);
        on_final(c);
      }
    }
    if (s + 2 < steps) post_recvs(s + 2);
  }
  return absl::OkStatus();
}

// All-gather around the ring: at step t rank r sends segment r-t and receives segment r-t-1
// straight into `out`, forwarding each chunk as it lands. Step 0's sends are the caller's when
// `first_sent` (all-reduce starts them as its reduction finishes).
absl::Status AllGatherPhase(P2p& p2p, uint32_t seq, uint32_t step_base, const Layout& L,
                            char* out, bool first_sent, Pending* sends) {
  const int n = p2p.size(), r = p2p.rank();
  const int left = Mod(r - 1, n), right = Mod(r + 1, n);
  const size_t es = L.es;
  const int steps = n - 1;
  // Every step writes a different segment, so all receives can be posted at once.
  std::vector<std::vector<std::unique_ptr<P2pRequest>>> recvs(steps);
  for (int t = 0; t < steps; ++t) {
    const int k = Mod(r - t - 1, n);
    for (size_t c = 0; c < L.NumChunks(k); ++c) {
      recvs[t].push_back(p2p.StartRecv(out + L.ChunkOff(k, c) * es, L.ChunkLen(k, c) * es, left,
                                       RingTag(seq, step_base + t, c)));
    }
  }
  if (!first_sent) {
    for (size_t c = 0; c < L.NumChunks(r); ++c) {
      sends->Add(p2p.StartSend(out + L.ChunkOff(r, c) * es, L.ChunkLen(r, c) * es, right,
                               RingTag(seq, step_base, c)));
    }
  }
  for (int t = 0; t < steps; ++t) {
    const int k = Mod(r - t - 1, n);
    for (size_t c = 0; c < L.NumChunks(k); ++c) {
      absl::Status status = recvs[t][c]->Wait();
      if (!status.ok()) return status;
      if (t + 1 < steps) {
        sends->Add(p2p.StartSend(out + L.ChunkOff(k, c) * es, L.ChunkLen(k, c) * es, right,
                                 RingTag(seq, step_base + t + 1, c)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGroup(const P2p& p2p) {
  if (p2p.size() < 1 || p2p.size() > kMaxRingSize) {
    return absl::InvalidArgumentError(absl::StrCat("ring collectives support 1..", kMaxRingSize,
                                                   " ranks, not ", p2p.size()));
  }
  return absl::OkStatus();
}

// The first error of the algorithm, else of its outstanding sends.
absl::Status Finish(absl::Status status, Pending* sends) {
  if (!status.ok()) return status;  // `sends` cancels what is left when destroyed
  return sends->WaitAll();
}

}  // namespace

char* RingScratch::Get(int slot, size_t bytes) {
  if (size_t(slot) >= slots_.size()) slots_.resize(slot + 1);
  if (slots_[slot].size() < bytes) slots_[slot].resize(bytes);
  return slots_[slot].data();
}

void ReduceInto(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
                size_t count) {
  switch (dtype) {
    case DataType::kFloat32:
      return ReduceT(op, static_cast<float*>(dst), static_cast<const float*>(a),
                     static_cast<const float*>(b), count);
    case DataType::kFloat64:
      return ReduceT(op, static_cast<double*>(dst), static_cast<const double*>(a),
                     static_cast<const double*>(b), count);
    case DataType::kInt64:
      return ReduceT(op, static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                     static_cast<const int64_t*>(b), count);
    case DataType::kInt32:
      return ReduceT(op, static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
                     static_cast<const int32_t*>(b), count);
    case DataType::kInt8:
      return ReduceT(op, static_cast<int8_t*>(dst), static_cast<const int8_t*>(a),
                     static_cast<const int8_t*>(b), count);
    case DataType::kUInt8:
      return ReduceT(op, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a),
                     static_cast<const uint8_t*>(b), count);
    case DataType::kFloat16:
      return Reduce16<HalfToFloat, FloatToHalf>(op, static_cast<uint16_t*>(dst),
                                                static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), count);
    case DataType::kBFloat16:
      return Reduce16<BFloat16ToFloat, FloatToBFloat16>(op, static_cast<uint16_t*>(dst),
                                                        static_cast<const uint16_t*>(a),
                                                        static_cast<const uint16_t*>(b), count);
  }
}

void ScaleDown(DataType dtype, void* data, size_t count, int divisor) {
  switch (dtype) {
    case DataType::kFloat32: return ScaleT(static_cast<float*>(data), count, divisor);
    case DataType::kFloat64: return ScaleT(static_cast<double*>(data), count, divisor);
    case DataType::kInt64: return ScaleT(static_cast<int64_t*>(data), count, divisor);
    case DataType::kInt32: return ScaleT(static_cast<int32_t*>(data), count, divisor);
    case DataType::kInt8: return ScaleT(static_cast<int8_t*>(data), count, divisor);
    case DataType::kUInt8: return ScaleT(static_cast<uint8_t*>(data), count, divisor);
    case DataType::kFloat16:
      return Scale16<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(data), count, divisor);
    case DataType::kBFloat16:
      return Scale16<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(data), count,
                                                       divisor);
  }
}

absl::Status RingAllReduce(P2p& p2p, uint32_t seq, const Buffer& buffer, ReduceOp op,
                           RingScratch* scratch, const RingConfig& config) {
  if (absl::Status s = CheckGroup(p2p); !s.ok()) return s;
  const int n = p2p.size(), r = p2p.rank();
  if (n == 1 || buffer.count == 0) return absl::OkStatus();  // avg over one rank is identity
  const Layout L = MakeLayout(EvenSplit(buffer.count, n), buffer.dtype, config);
  char* data = static_cast<char*>(buffer.data);
  Pending sends;
  const int right = Mod(r + 1, n);
  // As each chunk of this rank's segment is final, it starts around the ring.
  auto start_gather = [&](size_t c) {
    sends.Add(p2p.StartSend(data + L.ChunkOff(r, c) * L.es, L.ChunkLen(r, c) * L.es, right,
                            RingTag(seq, n - 1, c)));
  };
  absl::Status status = ReduceScatterPhase(p2p, seq, buffer.dtype, op, L, data, data,
                                           data + L.off[r] * L.es, scratch, &sends,
                                           start_gather);
  if (status.ok()) status = AllGatherPhase(p2p, seq, n - 1, L, data, true, &sends);
  return Finish(status, &sends);
}

absl::Status RingReduceScatter(P2p& p2p, uint32_t seq, const Buffer& input, const Buffer& output,
                               ReduceOp op, RingScratch* scratch, const RingConfig& config) {
  if (absl::Status s = CheckGroup(p2p); !s.ok()) return s;
  const int n = p2p.size();
  if (input.count != output.count * n || input.dtype != output.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reduce_scatter: input must hold size (", n, ") * output.count (", output.count,
        ") elements of the output's dtype; it holds ", input.count, " ",
        DataTypeName(input.dtype)));
  }
  if (output.count == 0) return absl::OkStatus();
  if (n == 1) {
    std::memmove(output.data, input.data, output.bytes());
    return absl::OkStatus();
  }
  const Layout L = MakeLayout(std::vector<size_t>(n, output.count), input.dtype, config);
  // Partial sums need their own memory: the input is the caller's and stays unmodified.
  char* work = scratch->Get(2, input.bytes());
  Pending sends;
  absl::Status status = ReduceScatterPhase(
      p2p, seq, input.dtype, op, L, static_cast<const char*>(input.data), work,
      static_cast<char*>(output.data), scratch, &sends, [](size_t) {});
  return Finish(status, &sends);
}

absl::Status RingAllGather(P2p& p2p, uint32_t seq, const Buffer& input, const Buffer& output,
                           const RingConfig& config) {
  if (absl::Status s = CheckGroup(p2p); !s.ok()) return s;
  const int n = p2p.size(), r = p2p.rank();
  if (output.count != input.count * n || input.dtype != output.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all_gather: output must hold size (", n, ") * input.count (", input.count,
        ") elements of the input's dtype; it holds ", output.count, " ",
        DataTypeName(output.dtype)));
  }
  char* out = static_cast<char*>(output.data);
  char* mine = out + r * input.bytes();
  if (mine != input.data && input.count > 0) std::memmove(mine, input.data, input.bytes());
  if (n == 1 || input.count == 0) return absl::OkStatus();
  const Layout L = MakeLayout(std::vector<size_t>(n, input.count), input.dtype, config);
  Pending sends;
  absl::Status status = AllGatherPhase(p2p, seq, 0, L, out, false, &sends);
  return Finish(status, &sends);
}

absl::Status ChainBroadcast(P2p& p2p, uint32_t seq, const Buffer& buffer, int root,
                            const RingConfig& config) {
  if (absl::Status s = CheckGroup(p2p); !s.ok()) return s;
  const int n = p2p.size(), r = p2p.rank();
  if (root < 0 || root >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " is not a rank of a group of ", n));
  }
  if (n == 1 || buffer.count == 0) return absl::OkStatus();
  const Layout L = MakeLayout({buffer.count}, buffer.dtype, config);
  char* data = static_cast<char*>(buffer.data);
  const int position = Mod(r - root, n);
  const int left = Mod(r - 1, n), right = Mod(r + 1, n);
  const bool forwards = position < n - 1;
  Pending sends;
  absl::Status status;
  if (position == 0) {
    for (size_t c = 0; c < L.NumChunks(0); ++c) {
      sends.Add(p2p.StartSend(data + L.ChunkOff(0, c) * L.es, L.ChunkLen(0, c) * L.es, right,
                              RingTag(seq, 0, c)));
    }
  } else {
    std::vector<std::unique_ptr<P2pRequest>> recvs;
    for (size_t c = 0; c < L.NumChunks(0); ++c) {
      recvs.push_back(p2p.StartRecv(data + L.ChunkOff(0, c) * L.es, L.ChunkLen(0, c) * L.es,
                                    left, RingTag(seq, 0, c)));
    }
    for (size_t c = 0; c < recvs.size() && status.ok(); ++c) {
      status = recvs[c]->Wait();
      if (status.ok() && forwards) {
        sends.Add(p2p.StartSend(data + L.ChunkOff(0, c) * L.es, L.ChunkLen(0, c) * L.es, right,
                                RingTag(seq, 0, c)));
      }
    }
  }
  return Finish(status, &sends);
}

absl::Status DisseminationBarrier(P2p& p2p, uint32_t seq) {
  if (absl::Status s = CheckGroup(p2p); !s.ok()) return s;
  const int n = p2p.size(), r = p2p.rank();
  char none = 0;
  uint32_t round = 0;
  for (int distance = 1; distance < n; distance *= 2, ++round) {
    auto recv = p2p.StartRecv(&none, 0, Mod(r - distance, n), RingTag(seq, round, 0));
    auto send = p2p.StartSend(&none, 0, Mod(r + distance, n), RingTag(seq, round, 0));
    absl::Status rs = recv->Wait();
    absl::Status ss = send->Wait();
    if (!rs.ok()) return rs;
    if (!ss.ok()) return ss;
  }
  return absl::OkStatus();
}

}  // namespace comm
}  // namespace rannc
