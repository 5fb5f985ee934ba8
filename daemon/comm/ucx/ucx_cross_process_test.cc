// UCX groups whose ranks are separate processes, meeting through the gRPC store (as ranks on
// different daemons do): the ranks run //daemon/comm/ucx:ucx_group_member.
#include <chrono>
#include <string>
#include <vector>

#include "daemon/comm/process_testing.h"

namespace rannc {
namespace comm {
namespace {

using testing::Reap;
using testing::Spawn;
using testing::StoreServer;

std::string MemberBinary() { return testing::Runfile("daemon/comm/ucx/ucx_group_member"); }

TEST_CASE("Ranks in separate processes form a UCX group through the gRPC store", "[comm]") {
  StoreServer store;
  for (int size : {2, 3}) {
    INFO(size << " processes");
    const std::string group = "cross" + std::to_string(size);
    std::vector<pid_t> pids;
    for (int r = 0; r < size; ++r) {
      pids.push_back(Spawn({MemberBinary(), store.address(), group, std::to_string(r),
                            std::to_string(size), "30000"}));
    }
    for (int r = 0; r < size; ++r) {
      INFO("rank " << r);
      CHECK(Reap(pids[r], std::chrono::seconds(60)) == 0);
    }
  }
}

TEST_CASE("A rank whose peer never comes fails its setup within the timeout", "[comm]") {
  StoreServer store;
  const auto start = std::chrono::steady_clock::now();
  pid_t alone = Spawn({MemberBinary(), store.address(), "alone", "0", "2", "1500"});
  CHECK(Reap(alone, std::chrono::seconds(30)) == 2);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
}

}  // namespace
}  // namespace comm
}  // namespace rannc
