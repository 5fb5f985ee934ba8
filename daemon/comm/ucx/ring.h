// Backend-agnostic collectives over point-to-point messages: any backend that can send and
// receive tagged messages (UCX, a TCP transport, the in-memory test transport) gets ring
// all-reduce, reduce-scatter, all-gather, a pipelined chain broadcast and a dissemination
// barrier from here.
//
//   class MyP2p : public rannc::comm::P2p { ... };   // StartSend / StartRecv / rank / size
//   RingScratch scratch;                              // reused across collectives
//   absl::Status s = RingAllReduce(p2p, /*seq=*/7, buffer, ReduceOp::kSum, &scratch);
//
// Every rank of the group calls the same collective with the same `seq`, count and dtype;
// `seq` (a per-group collective sequence number) goes into every tag, so messages of different
// collectives, and the backend's user point-to-point traffic (which it must tag apart), never
// cross-match. Tags built here use the low kRingTagBits bits (see RingTag).
//
// Bandwidth: each collective splits its segments into chunks (RingConfig::chunk_bytes) and keeps
// chunks in flight: a received chunk is reduced and forwarded (or its next receive posted) while
// later chunks are still moving, so transfer overlaps reduction.
//
// Thread-safety: a collective runs on the calling thread and calls `p2p` only from it. The
// functions are reentrant; a RingScratch belongs to one thread at a time.
// Lifetimes: buffers must stay valid until the call returns; every request the functions start
// is waited on before they return, also on error (so no transfer outlives the call).
#ifndef RANNC_DAEMON_COMM_UCX_RING_H_
#define RANNC_DAEMON_COMM_UCX_RING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "daemon/comm/communicator.h"

namespace rannc {
namespace comm {

// One started send or receive. Wait blocks until it completed and returns its status; it is
// called exactly once. Destroying an unwaited request must not leave the transfer running
// against freed memory: implementations cancel or finish it.
class P2pRequest {
 public:
  virtual ~P2pRequest() = default;
  virtual absl::Status Wait() = 0;
};

// A tagged point-to-point transport among `size()` ranks. Messages from one source with one tag
// match receives in issue order. The receive's `bytes` equals the send's.
class P2p {
 public:
  virtual ~P2p() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::unique_ptr<P2pRequest> StartSend(const void* data, size_t bytes, int dst,
                                                uint64_t tag) = 0;
  virtual std::unique_ptr<P2pRequest> StartRecv(void* data, size_t bytes, int src,
                                                uint64_t tag) = 0;

  absl::Status Send(const void* data, size_t bytes, int dst, uint64_t tag) {
    return StartSend(data, bytes, dst, tag)->Wait();
  }
  absl::Status Recv(void* data, size_t bytes, int src, uint64_t tag) {
    return StartRecv(data, bytes, src, tag)->Wait();
  }
};

// Tags the ring uses: (seq mod 2^16) << 32 | step << 20 | chunk. Wrapping seq is safe because a
// rank cannot get more than one collective ahead of its ring neighbours.
inline constexpr int kRingTagBits = 48;
inline uint64_t RingTag(uint32_t seq, uint32_t step, uint64_t chunk) {
  return (uint64_t{seq & 0xffffu} << 32) | (uint64_t{step & 0xfffu} << 20) | (chunk & 0xfffffu);
}

struct RingConfig {
  // Bytes per pipelined message. Smaller overlaps more, larger costs less per-message overhead.
  size_t chunk_bytes = 1 << 20;
};

// Temporary memory reused across collectives: fresh pages fault slowly, so a communicator keeps
// one and hands it to every call instead of allocating per call.
class RingScratch {
 public:
  // At least `bytes` bytes, valid until the next Get with the same `slot`.
  char* Get(int slot, size_t bytes);

 private:
  std::vector<std::vector<char>> slots_;
};

// Reduces `count` elements: dst[i] = a[i] op b[i]. dst may alias a or b. kAvg sums here; divide
// with ScaleDown afterwards. float16/bfloat16 compute in float.
void ReduceInto(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
                size_t count);
// data[i] /= divisor (integer division for integer types): the last step of kAvg.
void ScaleDown(DataType dtype, void* data, size_t count, int divisor);

// In place on every rank's `buffer`. Group size 1 copies nothing.
absl::Status RingAllReduce(P2p& p2p, uint32_t seq, const Buffer& buffer, ReduceOp op,
                           RingScratch* scratch, const RingConfig& config = {});
// `input` holds size() * output.count elements; rank r's `output` gets the reduction of the
// ranks' chunk r. `input` is not modified.
absl::Status RingReduceScatter(P2p& p2p, uint32_t seq, const Buffer& input, const Buffer& output,
                               ReduceOp op, RingScratch* scratch, const RingConfig& config = {});
// `output` holds size() * input.count elements; chunk r is rank r's `input`. `input` may be
// chunk rank() of `output` (in place).
absl::Status RingAllGather(P2p& p2p, uint32_t seq, const Buffer& input, const Buffer& output,
                           const RingConfig& config = {});
// Chain root -> root+1 -> ... pipelined in chunks.
absl::Status ChainBroadcast(P2p& p2p, uint32_t seq, const Buffer& buffer, int root,
                            const RingConfig& config = {});
// Dissemination barrier: ceil(log2 size) rounds of empty messages.
absl::Status DisseminationBarrier(P2p& p2p, uint32_t seq);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_UCX_RING_H_
