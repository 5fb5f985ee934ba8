// The NCCL backend of Communicator, for buffers in CUDA device memory: one NCCL communicator
// (ncclComm_t) per rank of a group, made once when the group is set up, and one internal CUDA
// stream (non-blocking) per communicator on which every operation is enqueued.
//
//   std::unique_ptr<Store> store = MakeInMemoryStore();
//   // on each of `size` threads (one per GPU) or daemons sharing a store:
//   GroupOptions options{store.get(), "job1/stage0/replicas", rank, size};
//   options.cuda_device = rank;  // -1: the calling thread's current device
//   absl::StatusOr<std::unique_ptr<Communicator>> c = MakeNcclCommunicator(options);
//   Buffer grad{device_ptr, n, DataType::kFloat32, DeviceKind::kCuda, rank};
//   std::unique_ptr<Work> w = (*c)->AllReduce(grad, {ReduceOp::kAvg});
//   absl::Status s = w->Wait(std::chrono::seconds(30));
//
// Rendezvous: rank 0 makes an ncclUniqueId and Sets it under "<group>/nccl/<k>/id" (k numbers
// the re-creations of a group under one store, counted at "<group>/nccl/joins"); the other ranks
// Get it, waiting up to options.setup_timeout. Then every rank calls ncclCommInitRank on its
// device, which blocks until all ranks of the group have called it (NCCL offers no timeout
// there). Two ranks of one group must not share a CUDA device (NCCL refuses it).
//
// Buffers: DeviceKind::kCuda on the communicator's device only; anything else fails the Work
// with INVALID_ARGUMENT (host memory is the UCX backend's).
//
// Stream ordering (the caller's side): each operation makes the communicator's stream wait for
// the work enqueued so far on the device's legacy default stream (cudaStreamLegacy, which is
// LibTorch's default stream). By CUDA's legacy-stream rules that also covers earlier work on
// blocking streams. Work on a non-blocking stream (e.g. a LibTorch pool stream) is NOT covered:
// synchronize it before issuing the operation. Once Work::Wait returned OK the operation has
// finished on the device, so any later work on any stream sees its result.
//
// Point to point: NCCL has no tags. RecvOptions/SendOptions::tag are ignored, and the k-th send
// from rank a to rank b matches the k-th receive on b from a (issue order per peer): both ranks
// must issue their transfers between them in the same order, with the same counts and dtypes.
// Sends and receives are not enqueued at once: they are held and launched together, as one
// NCCL group (ncclGroupStart/End), when a collective is issued on the communicator (before it),
// when any of its Works is waited on or polled (IsCompleted), so that patterns such as "every
// rank receives from its left, then sends to its right" do not deadlock as they would one
// NCCL call at a time. A Wait from another thread than the issuing one also launches them, so
// a set of transfers that must run together has to be issued before any thread waits.
// Collectives are launched when issued (they overlap with the caller's later work).
//
// Work::Wait polls the operation's CUDA event and ncclCommGetAsyncError: OK when the event
// completed; UNAVAILABLE (a peer or the network failed) or INTERNAL (another NCCL or CUDA error)
// with NCCL's message; DEADLINE_EXCEEDED after the timeout, the operation still running. The
// first launch of a point-to-point group between two ranks sets up their connection and blocks
// the launching thread (inside Wait) until the peer launches too: that wait is not bounded by
// the timeout. To keep collectives from blocking like that when issued, the communicator is
// made with every collective connection set up at creation (NCCL_RUNTIME_CONNECT=0 unless the
// environment sets it).
//
// Threads: as communicator.h says (one issuing thread at a time; Works waited from any
// thread). Every method sets the communicator's device for its CUDA calls and restores the
// calling thread's current device.
//
// Lifetimes: Works may outlive the communicator. Destroying it drops transfers that were never
// launched (their Works fail with CANCELLED); when its stream is idle and NCCL reported no
// error it calls ncclCommDestroy, otherwise ncclCommAbort, which stops what is in flight (those
// Works fail with CANCELLED).
#ifndef RANNC_DAEMON_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define RANNC_DAEMON_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"
#include "daemon/comm/factory.h"

namespace rannc {
namespace comm {

// Creates rank options.rank of the NCCL group options.group on CUDA device options.cuda_device
// (-1: the calling thread's current device). INVALID_ARGUMENT for bad options or a device that
// does not exist; DEADLINE_EXCEEDED when rank 0's id does not arrive within
// options.setup_timeout; INTERNAL / UNAVAILABLE with NCCL's message when ncclCommInitRank fails.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const GroupOptions& options);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_NCCL_NCCL_COMMUNICATOR_H_
