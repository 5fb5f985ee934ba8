// The backend conformance suite: the behaviour of comm/communicator.h that every Communicator
// backend (fake, UCX, NCCL) must show, as Catch2 checks. A backend's test calls it from one
// TEST_CASE with a function that makes a group:
//
//   TEST_CASE("ucx: conformance", "[comm]") {
//     std::unique_ptr<Store> store = MakeInMemoryStore();
//     RunConformanceSuite([&](int size, const std::string& group) {
//       return MakeGroupConcurrently(Backend::kUcx, size, group, store.get());
//     });
//   }
//
// What it runs, for groups of 1, 2, 3 and 4 ranks (3 is there for ring algorithms; up to
// ConformanceOptions::max_size), each in its own Catch2 SECTION with a freshly made group:
// send/recv of 0, 1 and 1000 elements in every dtype and of 4 MiB (float32, uint8) between every pair at once; matching by tag and issue
// order (several messages per tag, receives posted in another order); a ring of sends; all_reduce
// for every ReduceOp and DataType at 0, 1, 7 and 1025 elements and of 8M float32; reduce_scatter;
// all_gather; broadcast from every root; barrier; 40 collectives issued before any is waited on;
// two groups driven concurrently by the same threads. Point-to-point sections need two ranks
// (self-sends are not exercised).
//
// What a backend must know: each rank is driven by its own std::thread, which issues all of a
// section's operations (asynchronously, often many before waiting) and then waits on them, in
// any order, with a 60 s timeout (kConformanceWaitTimeout). Buffers are host memory
// (DeviceKind::kCpu): a device backend's test wraps its communicators to stage them through
// device memory (nccl/nccl_communicator_test.cc). Group names are unique per section ("conformance/<section>/<size>/<n>"),
// and every communicator of a group is destroyed before the next section starts. Expected
// values are small integers, exact in every dtype; kAvg of floats is checked to 1e-6 relative
// (1e-2 for float16 and bfloat16), of integers exactly (the sums divide evenly).
//
// Thread-safety: call from one test thread; the suite starts and joins its own threads and
// makes every Catch2 assertion on the calling thread.
#ifndef RANNC_DAEMON_COMM_CONFORMANCE_H_
#define RANNC_DAEMON_COMM_CONFORMANCE_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/comm/communicator.h"
#include "daemon/comm/factory.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace comm {

// How long the suite waits on any one operation before reporting it as hung.
inline constexpr std::chrono::milliseconds kConformanceWaitTimeout = std::chrono::seconds(60);

// Makes the `size` communicators of a new group named `group`, index = rank. Called on the
// test thread; returning fewer than `size` (e.g. after a failed setup) fails the section.
using GroupMaker =
    std::function<std::vector<std::unique_ptr<Communicator>>(int size, const std::string& group)>;

// What a backend cannot do, so the suite leaves it out. The defaults ask for everything.
struct ConformanceOptions {
  // Largest group to make (the sizes run are 1..max_size, at most 4). NCCL needs one GPU per
  // rank, so its test passes the machine's GPU count.
  int max_size = 4;
  // false: point-to-point messages match by issue order per peer only (NCCL ignores tags);
  // the ordering section then posts its receives in send order instead of tag by tag.
  bool matches_by_tag = true;
};

// Runs every check above inside the calling TEST_CASE (as SECTIONs).
void RunConformanceSuite(const GroupMaker& make, const ConformanceOptions& options = {});

// Creates ranks 0..size-1 of `group` with MakeCommunicator from one thread each, as daemons'
// device threads would (setup blocks until the group has met). Failed setups are reported as
// Catch2 check failures and yield an empty vector.
std::vector<std::unique_ptr<Communicator>> MakeGroupConcurrently(Backend backend, int size,
                                                                 const std::string& group,
                                                                 Store* store);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_CONFORMANCE_H_
