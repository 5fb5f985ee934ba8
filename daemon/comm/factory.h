// Picks a Communicator backend. Each rank of a group calls MakeCommunicator with the same
// group name, size and store; the call returns once the group's ranks have met (or fails with
// DEADLINE_EXCEEDED naming the ranks that did not come).
//
//   absl::StatusOr<std::unique_ptr<Communicator>> c =
//       MakeCommunicator(Backend::kUcx, {store, "job1/stage0", rank, size});
//
// Thread-safe; ranks of one group are typically created concurrently from their devices' threads.
#ifndef RANNC_DAEMON_COMM_FACTORY_H_
#define RANNC_DAEMON_COMM_FACTORY_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace comm {

enum class Backend { kFake, kUcx, kNccl };

struct GroupOptions {
  Store* store = nullptr;     // not owned; outlives the communicator's setup
  std::string group;          // unique name of the group, prefixes its store keys
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds setup_timeout = std::chrono::seconds(60);
  // NCCL only (the other backends ignore it): the rank's CUDA device; -1 means the calling
  // thread's current device.
  int cuda_device = -1;
};

// Whether this build has `backend` (NCCL needs a CUDA build; the others are always there).
bool BackendBuiltIn(Backend backend);

// UNIMPLEMENTED for a backend this build lacks: NCCL is built in only with
// --define=rannc_nccl=1 (which defines RANNC_WITH_NCCL and needs CUDA and NCCL).
absl::StatusOr<std::unique_ptr<Communicator>> MakeCommunicator(Backend backend,
                                                               const GroupOptions& options);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_FACTORY_H_
