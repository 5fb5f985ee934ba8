#include "daemon/comm/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/optional.h"

namespace rannc {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status CudaStatus(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(error), ": ",
                                          cudaGetErrorString(error)));
}

// NCCL's result as a status: a failed peer or network is UNAVAILABLE (the caller may rebuild
// the group without it), misuse is INVALID_ARGUMENT, the rest INTERNAL.
absl::Status NcclStatus(ncclResult_t result, const std::string& what, ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": NCCL error: ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  switch (result) {
    case ncclSystemError:
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    case ncclRemoteError:
#endif
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt64: return ncclInt64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt8: return ncclInt8;
    case DataType::kUInt8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// Makes `device` current for the scope and restores the caller's: device threads of the
// runtime keep their own current device, and a Work may be waited from any thread.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

// What one Work waits on. `done` is recorded on the communicator's stream right after the
// operation's NCCL call; until then (a held send/recv) `launched` is false.
struct Op {
  explicit Op(std::string what) : what(std::move(what)) {}
  ~Op() {
    if (done != nullptr) cudaEventDestroy(done);
  }
  std::string what;
  cudaEvent_t done = nullptr;
  bool launched = false;
  absl::Status status;  // set when the op failed before or at launch
};

// State shared by the communicator and its Works (which may outlive it). `mu` serializes
// every NCCL call on `comm` and every change here.
struct Core {
  int rank = 0;
  int size = 1;
  int device = 0;
  std::string group;

  absl::Mutex mu;
  ncclComm_t comm = nullptr;  // null once destroyed or aborted
  cudaStream_t stream = nullptr;
  cudaEvent_t caller_ready = nullptr;  // recorded on the legacy stream before each launch
  bool aborted = false;                // destroyed with operations in flight
  absl::Status failure;                // the first asynchronous NCCL error

  struct Transfer {
    bool send;
    Buffer buffer;
    int peer;
    std::shared_ptr<Op> op;
  };
  std::vector<Transfer> held;  // sends and receives not yet launched, in issue order

  std::string Where() const {
    return absl::StrCat("group ", group, " (rank ", rank, " of ", size, ", cuda:", device, ")");
  }

  // Makes the stream wait for the caller's work on the legacy default stream (see the header).
  absl::Status OrderAfterCallerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status s = CudaStatus(cudaEventRecord(caller_ready, cudaStreamLegacy),
                                "recording the caller's stream position");
    if (s.ok()) {
      s = CudaStatus(cudaStreamWaitEvent(stream, caller_ready, 0),
                     "ordering the communicator's stream after the caller's");
    }
    return s;
  }

  // Checks that the communicator can still launch; the error every op then gets.
  absl::Status UsableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (comm == nullptr) {
      return absl::CancelledError(absl::StrCat("nccl communicator of ", Where(), " is destroyed"));
    }
    return failure;
  }

  void MarkLaunchedLocked(Op& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    op.status = CudaStatus(cudaEventRecord(op.done, stream), absl::StrCat(op.what, ": recording"));
    op.launched = op.status.ok();
  }

  // Launches the held sends and receives as one NCCL group.
  void LaunchHeldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (held.empty()) return;
    std::vector<Transfer> transfers = std::move(held);
    held.clear();
    absl::Status s = UsableLocked();
    if (s.ok()) {
      DeviceGuard guard(device);
      s = OrderAfterCallerLocked();
      if (s.ok()) {
        s = NcclStatus(ncclGroupStart(), "ncclGroupStart", comm);
        if (s.ok()) {
          for (const Transfer& t : transfers) {
            const ncclResult_t r =
                t.send ? ncclSend(t.buffer.data, t.buffer.count, NcclType(t.buffer.dtype), t.peer,
                                  comm, stream)
                       : ncclRecv(t.buffer.data, t.buffer.count, NcclType(t.buffer.dtype), t.peer,
                                  comm, stream);
            s = NcclStatus(r, t.op->what, comm);
            if (!s.ok()) break;
          }
          // The group must be closed even after a failed call inside it.
          absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd", comm);
          if (s.ok()) s = end;
        }
      }
      if (s.ok()) {
        for (const Transfer& t : transfers) MarkLaunchedLocked(*t.op);
        return;
      }
    }
    for (const Transfer& t : transfers) t.op->status = s;
  }

  // The first asynchronous error NCCL reported for the communicator, remembered.
  absl::Status AsyncErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!failure.ok() || comm == nullptr) return failure;
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) {
      failure = NcclStatus(r, absl::StrCat("ncclCommGetAsyncError on ", Where()), comm);
    } else if (async != ncclSuccess && async != ncclInProgress) {
      failure = NcclStatus(async, absl::StrCat("nccl communicator of ", Where()), comm);
    }
    return failure;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<Core> core, std::shared_ptr<Op> op)
      : core_(std::move(core)), op_(std::move(op)) {}

  absl::Status Wait(std::chrono::milliseconds timeout) override {
    const bool bounded = timeout != kNoTimeout;
    const Clock::time_point deadline = bounded ? Clock::now() + timeout : Clock::time_point();
    std::chrono::microseconds pause(20);
    while (true) {
      absl::optional<absl::Status> result = Poll();
      if (result.has_value()) return *result;
      if (bounded && Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            op_->what, " on nccl ", core_->Where(), " did not complete within ", timeout.count(),
            " ms; it keeps running on the device"));
      }
      // Back off from spinning: operations worth waiting on take microseconds to seconds.
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }

  bool IsCompleted() override { return Poll().has_value(); }

 private:
  // The op's outcome, or nothing while it runs.
  absl::optional<absl::Status> Poll() {
    absl::MutexLock lock(&core_->mu);
    if (!op_->launched && op_->status.ok()) core_->LaunchHeldLocked();
    if (!op_->status.ok()) return op_->status;
    if (!op_->launched) {
      return absl::CancelledError(
          absl::StrCat(op_->what, " was never launched: the communicator was destroyed"));
    }
    if (core_->aborted) {
      return absl::CancelledError(absl::StrCat(
          op_->what, " on nccl ", core_->Where(),
          " was stopped: the communicator was destroyed (ncclCommAbort) while it ran"));
    }
    const cudaError_t e = cudaEventQuery(op_->done);
    if (e != cudaSuccess && e != cudaErrorNotReady) return CudaStatus(e, op_->what);
    // Checked also once the event completed: NCCL's kernels return early when the
    // communicator fails, so a finished event alone does not prove the data arrived.
    absl::Status async = core_->AsyncErrorLocked();
    if (!async.ok()) {
      return absl::Status(async.code(), absl::StrCat(op_->what, ": ", async.message()));
    }
    if (e == cudaSuccess) return absl::OkStatus();
    return absl::nullopt;
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<Op> op_;
};

class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<Core> core, void* barrier_word)
      : core_(std::move(core)), barrier_word_(barrier_word) {}

  ~NcclCommunicator() override {
    absl::MutexLock lock(&core_->mu);
    for (Core::Transfer& t : core_->held) {
      t.op->status = absl::CancelledError(absl::StrCat(
          t.op->what, " was never launched: the nccl communicator of ", core_->Where(),
          " was destroyed before anyone waited on it"));
    }
    core_->held.clear();
    DeviceGuard guard(core_->device);
    // Destroying while the stream still runs would block until peers finish (or forever if
    // one is gone): abort instead, as after an error.
    const bool idle = cudaStreamQuery(core_->stream) == cudaSuccess;
    if (idle && core_->AsyncErrorLocked().ok()) {
      ncclCommDestroy(core_->comm);
    } else {
      ncclCommAbort(core_->comm);
      core_->aborted = !idle;
    }
    core_->comm = nullptr;
    cudaStreamDestroy(core_->stream);
    cudaEventDestroy(core_->caller_ready);
    cudaFree(barrier_word_);
  }

  int rank() const override { return core_->rank; }
  int size() const override { return core_->size; }
  const char* backend() const override { return "nccl"; }

  std::unique_ptr<Work> Send(const Buffer& buffer, int dst, const SendOptions&) override {
    return Transfer(true, buffer, dst);
  }
  std::unique_ptr<Work> Recv(const Buffer& buffer, int src, const RecvOptions&) override {
    return Transfer(false, buffer, src);
  }

  std::unique_ptr<Work> AllReduce(const Buffer& buffer,
                                  const AllReduceOptions& options) override {
    return Collective("all_reduce", {buffer}, absl::OkStatus(),
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclAllReduce(buffer.data, buffer.data, buffer.count,
                                             NcclType(buffer.dtype), NcclOp(options.op), comm,
                                             stream);
                      });
  }

  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      const ReduceScatterOptions& options) override {
    return Collective("reduce_scatter", {input, output}, SameTypeAndScaled(input, output, "input"),
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclReduceScatter(input.data, output.data, output.count,
                                                 NcclType(input.dtype), NcclOp(options.op), comm,
                                                 stream);
                      });
  }

  std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                  const AllGatherOptions&) override {
    return Collective("all_gather", {input, output}, SameTypeAndScaled(output, input, "output"),
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclAllGather(input.data, output.data, input.count,
                                             NcclType(input.dtype), comm, stream);
                      });
  }

  std::unique_ptr<Work> Broadcast(const Buffer& buffer, const BroadcastOptions& options) override {
    absl::Status root = absl::OkStatus();
    if (options.root < 0 || options.root >= core_->size) {
      root = absl::InvalidArgumentError(absl::StrCat("broadcast root ", options.root,
                                                     " is outside ", core_->Where()));
    }
    return Collective("broadcast", {buffer}, root, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclBroadcast(buffer.data, buffer.data, buffer.count, NcclType(buffer.dtype),
                           options.root, comm, stream);
    });
  }

  // NCCL has no barrier: an all-reduce of one int on a word of device memory, which completes
  // on a rank only after every rank has issued it.
  std::unique_ptr<Work> Barrier(const BarrierOptions&) override {
    const Buffer word{barrier_word_, 1, DataType::kInt32, DeviceKind::kCuda, core_->device};
    return Collective("barrier", {word}, absl::OkStatus(),
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum,
                                             comm, stream);
                      });
  }

 private:
  std::unique_ptr<Work> Failed(std::shared_ptr<Op> op, absl::Status status) {
    op->status = std::move(status);
    return std::make_unique<NcclWork>(core_, std::move(op));
  }

  absl::Status CheckBuffer(const Buffer& b, const std::string& what) const {
    if (b.device != DeviceKind::kCuda || b.device_index != core_->device) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the buffer is in ",
          b.device == DeviceKind::kCuda ? absl::StrCat("cuda:", b.device_index) : "host memory",
          " but the nccl communicator of ", core_->Where(),
          " needs memory on its own device (host memory goes over the UCX backend)"));
    }
    if (b.data == nullptr && b.count > 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null buffer of ", b.count,
                                                     " elements"));
    }
    return absl::OkStatus();
  }

  // `big` must hold size() times `small`'s elements, of the same dtype.
  absl::Status SameTypeAndScaled(const Buffer& big, const Buffer& small,
                                 const char* big_name) const {
    if (big.dtype != small.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("input is ", DataTypeName(big.dtype),
                                                     " but output is ", DataTypeName(small.dtype)));
    }
    if (big.count != small.count * core_->size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", big_name, " has ", big.count, " elements, expected size() * ", small.count,
          " = ", small.count * core_->size));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<Op> NewOp(std::string what) {
    auto op = std::make_shared<Op>(std::move(what));
    DeviceGuard guard(core_->device);
    op->status = CudaStatus(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming),
                            absl::StrCat(op->what, ": creating its event"));
    return op;
  }

  std::unique_ptr<Work> Transfer(bool send, const Buffer& buffer, int peer) {
    std::shared_ptr<Op> op =
        NewOp(absl::StrCat(send ? "send to" : "recv from", " rank ", peer, " of ",
                           buffer.count, " ", DataTypeName(buffer.dtype)));
    if (!op->status.ok()) return std::make_unique<NcclWork>(core_, std::move(op));
    if (peer < 0 || peer >= core_->size) {
      return Failed(op, absl::InvalidArgumentError(
                            absl::StrCat(op->what, ": no such rank in ", core_->Where())));
    }
    absl::Status valid = CheckBuffer(buffer, op->what);
    if (!valid.ok()) return Failed(op, valid);
    absl::MutexLock lock(&core_->mu);
    core_->held.push_back({send, buffer, peer, op});
    return std::make_unique<NcclWork>(core_, std::move(op));
  }

  template <typename Launch>
  std::unique_ptr<Work> Collective(const char* name, std::initializer_list<Buffer> buffers,
                                   absl::Status valid, Launch launch) {
    const Buffer& first = *buffers.begin();
    std::shared_ptr<Op> op =
        NewOp(absl::StrCat(name, " of ", first.count, " ", DataTypeName(first.dtype)));
    if (!op->status.ok()) return std::make_unique<NcclWork>(core_, std::move(op));
    for (const Buffer& b : buffers) {
      if (valid.ok()) valid = CheckBuffer(b, op->what);
    }
    if (!valid.ok()) return Failed(op, absl::Status(valid.code(), absl::StrCat(op->what, ": ",
                                                                               valid.message())));
    absl::MutexLock lock(&core_->mu);
    // Held transfers were issued first: launching them first keeps the issue order.
    core_->LaunchHeldLocked();
    absl::Status s = core_->UsableLocked();
    if (s.ok()) {
      DeviceGuard guard(core_->device);
      s = core_->OrderAfterCallerLocked();
      if (s.ok()) s = NcclStatus(launch(core_->comm, core_->stream), op->what, core_->comm);
      if (s.ok()) core_->MarkLaunchedLocked(*op);
    }
    if (!s.ok()) op->status = s;
    return std::make_unique<NcclWork>(core_, std::move(op));
  }

  std::shared_ptr<Core> core_;
  void* barrier_word_;  // one int32 of device memory, for Barrier
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const GroupOptions& options) {
  if (options.store == nullptr || options.group.empty() || options.size < 1 ||
      options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MakeNcclCommunicator: need a store, a group name and 0 <= rank < size; got group \"",
        options.group, "\" rank ", options.rank, " size ", options.size));
  }
  auto core = std::make_shared<Core>();
  core->rank = options.rank;
  core->size = options.size;
  core->group = options.group;
  int devices = 0;
  absl::Status s = CudaStatus(cudaGetDeviceCount(&devices), "MakeNcclCommunicator: counting devices");
  if (!s.ok()) return s;
  core->device = options.cuda_device;
  if (core->device < 0) {
    s = CudaStatus(cudaGetDevice(&core->device), "MakeNcclCommunicator: the current device");
    if (!s.ok()) return s;
  }
  if (core->device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("MakeNcclCommunicator: cuda:", core->device,
                                                   " does not exist (", devices, " devices)"));
  }

  // Connect every collective algorithm during the (already blocking) creation rather than at
  // a collective's first launch, where it would block the issuing thread until the peers issue
  // theirs: a thread driving two groups in different orders would then deadlock. NCCL reads it
  // once per process (at its first communicator), so it is set once here, before our first
  // NCCL call; an explicit setting in the environment wins.
  static std::once_flag runtime_connect;
  std::call_once(runtime_connect, [] { setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0); });

  // The k-th creation of this group under this store meets under its own key, so a group
  // re-created after destruction never reads the previous id.
  absl::StatusOr<int64_t> joined = options.store->Add(absl::StrCat(options.group, "/nccl/joins"), 1);
  if (!joined.ok()) return joined.status();
  const std::string id_key =
      absl::StrCat(options.group, "/nccl/", (*joined - 1) / options.size, "/id");
  ncclUniqueId id;
  if (options.rank == 0) {
    s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
    if (!s.ok()) return s;
    s = options.store->Set(id_key, std::string(id.internal, sizeof id.internal));
    if (!s.ok()) return s;
  } else {
    absl::StatusOr<std::string> got = options.store->Get(id_key, options.setup_timeout);
    if (!got.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "MakeNcclCommunicator: rank 0 of group ", options.group, " did not publish the NCCL id (",
          id_key, ") within ", options.setup_timeout.count(), " ms: ", got.status().message()));
    }
    if (got->size() != sizeof id.internal) {
      return absl::InternalError(absl::StrCat("MakeNcclCommunicator: ", id_key, " holds ",
                                              got->size(), " bytes, not an ncclUniqueId"));
    }
    std::memcpy(id.internal, got->data(), sizeof id.internal);
  }

  DeviceGuard guard(core->device);
  s = NcclStatus(ncclCommInitRank(&core->comm, options.size, id, options.rank),
                 absl::StrCat("ncclCommInitRank for ", core->Where()), nullptr);
  if (!s.ok()) return s;
  void* barrier_word = nullptr;
  s = CudaStatus(cudaStreamCreateWithFlags(&core->stream, cudaStreamNonBlocking),
                 "MakeNcclCommunicator: creating its stream");
  if (s.ok()) {
    s = CudaStatus(cudaEventCreateWithFlags(&core->caller_ready, cudaEventDisableTiming),
                   "MakeNcclCommunicator: creating an event");
  }
  if (s.ok()) {
    s = CudaStatus(cudaMalloc(&barrier_word, sizeof(int32_t)),
                   "MakeNcclCommunicator: allocating the barrier word");
  }
  if (!s.ok()) {
    ncclCommDestroy(core->comm);
    if (core->stream != nullptr) cudaStreamDestroy(core->stream);
    if (core->caller_ready != nullptr) cudaEventDestroy(core->caller_ready);
    return s;
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(std::move(core), barrier_word));
}

}  // namespace comm
}  // namespace rannc
