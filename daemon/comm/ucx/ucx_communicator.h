// The UCX backend of Communicator: one UCP context and worker per rank, tag-matched messages
// between ranks of a group (shared memory and CMA between ranks of one host, TCP between hosts),
// and collectives from ring.h over those messages.
//
//   std::unique_ptr<Store> store = MakeInMemoryStore();
//   // on each of `size` threads (or daemons sharing a store):
//   absl::StatusOr<std::unique_ptr<Communicator>> c =
//       MakeUcxCommunicator(store.get(), "job1/stage0", rank, size, std::chrono::seconds(60));
//   std::unique_ptr<Work> w = (*c)->AllReduce(Buffer::Of(grad, n));
//   absl::Status s = w->Wait(std::chrono::seconds(30));
//
// Threads: each communicator owns an engine thread that alone touches its UCP worker (so the
// worker runs in UCS_THREAD_MODE_SINGLE, without UCX's locks). Communicator methods enqueue a
// task and wake the engine with ucp_worker_signal; point-to-point operations are posted to UCX
// as soon as the engine sees them, collectives run one at a time on the engine in issue order
// (p2p issued meanwhile is still posted, so p2p never waits behind a collective). The engine
// spins on ucp_worker_progress briefly and then sleeps on the worker's event fd.
//
// Rendezvous: rank r publishes its worker address under "<group>/ucx/addr/<r>" (the k-th
// re-creation of a group under one store uses "<group>/ucx/<k>/addr/<r>"), connects to every
// rank, and meets the others at "<group>/ucx/.../ready/<r>" before returning.
//
// Tags (64 bits): bit 63 = collective traffic; bits 62..48 = source rank; bits 47..0 = for
// collectives ring.h's tag (sequence, step, chunk), for p2p bit 47 = control (the goodbye a
// closing rank sends) and bits 31..0 the user's tag. So p2p and collectives never cross-match.
//
// Failures: a rank whose communicator is destroyed tells its peers; their operations with that
// rank then fail with UNAVAILABLE naming it. UCX endpoint errors (peer failure mode) do the same.
// A peer that silently stops answering shows as DEADLINE_EXCEEDED from Work::Wait.
//
// Lifetimes: destroying the communicator cancels what is in flight (those Works fail with
// CANCELLED), closes endpoints, and joins the engine; Works may outlive the communicator.
#ifndef RANNC_DAEMON_COMM_UCX_UCX_COMMUNICATOR_H_
#define RANNC_DAEMON_COMM_UCX_UCX_COMMUNICATOR_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"
#include "daemon/comm/factory.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace comm {

struct UcxOptions {
  // Bytes per pipelined message of a collective (ring.h's RingConfig::chunk_bytes).
  size_t chunk_bytes = size_t{1} << 20;
  // UCP_ERR_HANDLING_MODE_PEER on endpoints: a crashed peer process becomes an endpoint error
  // rather than a hang. Off by default because UCX 1.13 then refuses the shared-memory
  // transports (posix/sysv lack peer-failure support) and falls back to TCP: 3-4x slower
  // between ranks of one process, which cannot crash apart anyway (a destroyed communicator
  // still says goodbye). Turn it on for groups spanning daemons (the cluster issue).
  bool peer_error_handling = false;
};

// Creates rank `rank` of the group of `size` named `group`, meeting the others through `store`
// (not owned; used only during the call). Returns once every rank has connected, or
// DEADLINE_EXCEEDED naming the missing ranks after `setup_timeout`.
absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(
    Store* store, const std::string& group, int rank, int size,
    std::chrono::milliseconds setup_timeout, const UcxOptions& ucx = {});

// The same from the factory's GroupOptions (what MakeCommunicator(Backend::kUcx, ...) calls).
absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(const GroupOptions& options,
                                                                  const UcxOptions& ucx = {});

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_UCX_UCX_COMMUNICATOR_H_
