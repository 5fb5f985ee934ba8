// The data plane between a job's devices: a Communicator is one rank's handle on a group of
// ranks (a stage's replica set, a pair of adjacent stages), with point-to-point and collective
// operations that return a Work handle. Backends, one file each, are chosen by a factory
// (comm/factory.h): UCX for CPU devices and host memory (also between daemons), NCCL for CUDA
// devices, and an in-memory fake for tests. Every backend runs the same conformance suite.
//
// Buffers are raw memory with a dtype and a device, not at::Tensors, so this layer and its
// tests build without LibTorch; the runtime wraps tensors (data_ptr, numel, dtype).
//
//   std::unique_ptr<Store> store = MakeInMemoryStore();          // rendezvous (comm/store.h)
//   absl::StatusOr<std::unique_ptr<Communicator>> c =
//       MakeCommunicator(Backend::kUcx, {store.get(), "stage0/replicas", rank, size});
//   std::unique_ptr<Work> w = (*c)->AllReduce(Buffer::Of(grad_ptr, n), {ReduceOp::kSum});
//   absl::Status s = w->Wait(std::chrono::seconds(30));
//
// Ordering and threads: operations on one Communicator are issued from one thread at a time,
// and every rank of a group issues the group's collectives in the same order (as with NCCL and
// c10d); point-to-point operations between a pair match by (tag, issue order). A Work may be
// waited on from any thread. A Buffer must stay valid until its Work completes. Communicators
// of different groups are independent and may be used concurrently.
#ifndef RANNC_DAEMON_COMM_COMMUNICATOR_H_
#define RANNC_DAEMON_COMM_COMMUNICATOR_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace rannc {
namespace comm {

enum class DataType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kInt8, kUInt8 };
size_t ElementSize(DataType type);
const char* DataTypeName(DataType type);

enum class DeviceKind { kCpu, kCuda };

// Memory an operation reads or writes: `count` elements of `dtype`, contiguous.
struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  DeviceKind device = DeviceKind::kCpu;
  int device_index = 0;

  size_t bytes() const { return count * ElementSize(dtype); }
  static Buffer Of(float* data, size_t count) { return {data, count, DataType::kFloat32}; }
};

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// No deadline: wait until the operation completes or fails.
inline constexpr std::chrono::milliseconds kNoTimeout = std::chrono::milliseconds::max();

struct SendOptions {
  uint32_t tag = 0;  // matches the receiver's RecvOptions::tag
};
struct RecvOptions {
  uint32_t tag = 0;
};
struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
};
struct AllGatherOptions {};
struct BroadcastOptions {
  int root = 0;
};
struct BarrierOptions {};

// An operation in flight. Wait returns OK once it completed, DEADLINE_EXCEEDED when `timeout`
// passed first (the operation keeps running; wait again or abandon the communicator), or the
// operation's error (UNAVAILABLE naming the peer when a peer is gone).
class Work {
 public:
  virtual ~Work() = default;
  virtual absl::Status Wait(std::chrono::milliseconds timeout = kNoTimeout) = 0;
  virtual bool IsCompleted() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "ucx", "nccl", "fake"

  // Point to point. The receiver's buffer has the sender's count and dtype.
  virtual std::unique_ptr<Work> Send(const Buffer& buffer, int dst,
                                     const SendOptions& options = {}) = 0;
  virtual std::unique_ptr<Work> Recv(const Buffer& buffer, int src,
                                     const RecvOptions& options = {}) = 0;

  // In place over every rank's `buffer` (same count and dtype everywhere).
  virtual std::unique_ptr<Work> AllReduce(const Buffer& buffer,
                                          const AllReduceOptions& options = {}) = 0;
  // `input` has size() * output.count elements; rank r receives the reduction of chunk r.
  virtual std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                              const ReduceScatterOptions& options = {}) = 0;
  // `output` has size() * input.count elements: chunk r is rank r's input.
  virtual std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                          const AllGatherOptions& options = {}) = 0;
  // Every rank's `buffer` gets the root's.
  virtual std::unique_ptr<Work> Broadcast(const Buffer& buffer,
                                          const BroadcastOptions& options = {}) = 0;
  virtual std::unique_ptr<Work> Barrier(const BarrierOptions& options = {}) = 0;
};

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_COMMUNICATOR_H_
