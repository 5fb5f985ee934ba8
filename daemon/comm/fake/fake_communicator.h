// The in-memory Communicator backend ("fake"): every rank of a group lives in this process
// (one thread per rank), and operations copy and reduce host memory directly. It is what
// tests of the layers above use, and the reference the real backends (UCX, NCCL) are checked
// against by the conformance suite (comm/conformance.h).
//
//   std::unique_ptr<Store> store = MakeInMemoryStore();
//   // On each rank's thread:
//   absl::StatusOr<std::unique_ptr<Communicator>> c =
//       MakeFakeCommunicator({store.get(), "test/group", rank, size});
//   std::unique_ptr<Work> w = (*c)->AllReduce(Buffer::Of(data, n));
//   absl::Status s = w->Wait(std::chrono::seconds(10));
//
//   FailFakeRank("test/group", 1);  // test-only: rank 1 dies, waits on it fail with UNAVAILABLE
//   FakeCollectivesIssued("test/group", 0);  // test-only: collectives rank 0 has issued
//
// Semantics follow comm/communicator.h exactly, and are strict where real backends may be
// lenient, so tests catch misuse early:
//  - A Send completes only once the matching Recv was issued (no eager buffering); a Recv
//    whose count or dtype differs from the Send's fails both with INVALID_ARGUMENT.
//  - Collectives are matched by issue order; ranks that issue different operations, counts,
//    dtypes, reduce ops or roots at the same position fail it on every rank with
//    INVALID_ARGUMENT.
//  - Wait's DEADLINE_EXCEEDED names the operation, the group and the ranks that did not come.
//  - Destroying a communicator counts as the rank leaving: its peers' pending and later
//    operations involving it fail with UNAVAILABLE rather than hang.
//  - Host memory only (DeviceKind::kCpu).
//
// Threads and lifetimes: as communicator.h says; Works may outlive their communicator. Setup
// (MakeFakeCommunicator) blocks until all `options.size` ranks of the group have called it, up
// to options.setup_timeout. A group name may be reused once every communicator of the previous
// group with that name is destroyed (or while it lives, when the same store is used: the store
// numbers the group's incarnations). After a failed setup, retry under a new group name or with
// a fresh store: the failed attempt's join still counts in the store.
#ifndef RANNC_DAEMON_COMM_FAKE_FAKE_COMMUNICATOR_H_
#define RANNC_DAEMON_COMM_FAKE_FAKE_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"
#include "daemon/comm/factory.h"

namespace rannc {
namespace comm {

// Joins rank options.rank of the in-process group options.group. INVALID_ARGUMENT for bad
// options or a rank that already joined; DEADLINE_EXCEEDED naming the missing ranks when the
// group does not fill up within options.setup_timeout.
absl::StatusOr<std::unique_ptr<Communicator>> MakeFakeCommunicator(const GroupOptions& options);

// Test-only failure injection: marks `rank` of every live fake group named `group` dead. Its
// pending operations and those of its peers that involve it, and every later one, fail with
// UNAVAILABLE "rank <rank> of group <group> is gone". A no-op when no such group lives.
void FailFakeRank(const std::string& group, int rank);

// Test-only observation: how many collectives (all-reduces, barriers, ...; not sends or
// receives) `rank` of the live fake groups named `group` has issued so far; 0 when none lives.
// Lets a test count the collectives a layer above issues.
int64_t FakeCollectivesIssued(const std::string& group, int rank);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_FAKE_FAKE_COMMUNICATOR_H_
