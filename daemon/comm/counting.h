// A Communicator that counts the bytes its operations hand to the data plane, for the daemon's
// metrics (rannc_job_data_plane_bytes_total): each Send's buffer and each collective's local
// contribution (AllReduce's and Broadcast's buffer, ReduceScatter's and AllGather's input),
// counted when the operation is issued. Receives are not counted: their bytes are another
// rank's sends. Everything else forwards to the wrapped communicator.
//
//   auto bytes = std::make_shared<std::atomic<uint64_t>>(0);
//   std::unique_ptr<Communicator> c = CountBytes(std::move(inner), bytes);
//
// Thread-safety: as the wrapped communicator's; the counter is atomic and may be shared by
// many communicators.
#ifndef RANNC_DAEMON_COMM_COUNTING_H_
#define RANNC_DAEMON_COMM_COUNTING_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "daemon/comm/communicator.h"

namespace rannc {
namespace comm {

// `inner` itself when `bytes` is null.
std::unique_ptr<Communicator> CountBytes(std::unique_ptr<Communicator> inner,
                                         std::shared_ptr<std::atomic<uint64_t>> bytes);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_COUNTING_H_
