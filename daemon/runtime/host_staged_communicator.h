// A Communicator for CUDA buffers over a backend that moves host memory only (fake, UCX as
// Debian builds it): each CUDA buffer an operation reads is copied to host memory before the
// operation is issued, and each one it writes is copied back from host memory when the
// operation's Work completes (in Wait, or in IsCompleted once it reports completion). Host
// buffers pass through untouched.
//
//   std::unique_ptr<comm::Communicator> c = StageThroughHost(*MakeCommunicator(kUcx, options));
//   c->AllReduce(BufferOf(cuda_tensor));  // through a host copy
//
// This is the engine's path for CUDA devices without NCCL (several plan devices on one GPU, a
// test on one GPU, a cluster whose daemons cannot reach each other through NCCL): correct, and
// as slow as two copies per operation. The copies run on the calling thread's current stream
// of the buffer's device and wait for it (LibTorch's synchronous copies), so the caller's
// earlier work on that stream is what is sent. Thread-safety and lifetimes as the inner
// communicator's; each Work keeps its host copies.
#ifndef RANNC_DAEMON_RUNTIME_HOST_STAGED_COMMUNICATOR_H_
#define RANNC_DAEMON_RUNTIME_HOST_STAGED_COMMUNICATOR_H_

#include <memory>

#include "daemon/comm/communicator.h"

namespace rannc {

std::unique_ptr<comm::Communicator> StageThroughHost(std::unique_ptr<comm::Communicator> inner);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_HOST_STAGED_COMMUNICATOR_H_
