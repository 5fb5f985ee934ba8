// Rendezvous for the data plane, apart from it (as c10d's Store): ranks of a group publish and
// read small values (UCX worker addresses, NCCL unique ids) under string keys. Inside one daemon
// the in-memory store serves every device; across daemons, comm/grpc_store.h's client reaches
// one daemon's store over the gRPC control plane (its calls can fail: UNAVAILABLE).
//
//   std::unique_ptr<Store> store = MakeInMemoryStore();
//   store->Set("group/addr/0", bytes);
//   absl::StatusOr<std::string> peer = store->Get("group/addr/1", std::chrono::seconds(30));
//
// Thread-safe: every method may be called from any thread.
#ifndef RANNC_DAEMON_COMM_STORE_H_
#define RANNC_DAEMON_COMM_STORE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {
namespace comm {

class Store {
 public:
  virtual ~Store() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set; DEADLINE_EXCEEDED naming the key after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the integer under `key` (0 when unset) and returns the new value.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Waits until every key is set.
  virtual absl::Status Wait(const std::vector<std::string>& keys,
                            std::chrono::milliseconds timeout) = 0;
};

std::unique_ptr<Store> MakeInMemoryStore();

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_STORE_H_
