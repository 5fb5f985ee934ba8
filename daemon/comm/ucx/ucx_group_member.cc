// Test helper for ucx_cross_process_test: one rank of a UCX group in a process of its own, as a
// rank on another daemon would be, meeting the others through a gRPC store.
//
//   ucx_group_member STORE_ADDRESS GROUP RANK SIZE SETUP_TIMEOUT_MS
//
// It all-reduces 1 Mi floats (rank r contributes r + 1 everywhere), passes a 4 KiB message
// around the ring with send/recv, and meets the others at a barrier. Exit status: 0 when every
// result is right, 1 for a wrong result, 2 when the group cannot be set up, 3 for a failed
// operation; the reason goes to stderr.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/comm/grpc_store.h"
#include "daemon/comm/ucx/ucx_communicator.h"

int main(int argc, char** argv) {
  using namespace rannc::comm;
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s STORE_ADDRESS GROUP RANK SIZE SETUP_TIMEOUT_MS\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[3]);
  const int size = std::atoi(argv[4]);
  const std::chrono::milliseconds timeout(std::atoi(argv[5]));
  std::unique_ptr<Store> store = MakeGrpcStore(argv[1]);
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeUcxCommunicator(store.get(), argv[2], rank, size, timeout);
  if (!made.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, std::string(made.status().message()).c_str());
    return 2;
  }
  Communicator& c = **made;
  auto wait = [&](std::unique_ptr<Work> w, const char* what) {
    absl::Status s = w->Wait(std::chrono::seconds(30));
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, std::string(s.message()).c_str());
      std::exit(3);
    }
  };

  std::vector<float> data(1 << 20, static_cast<float>(rank + 1));
  wait(c.AllReduce(Buffer::Of(data.data(), data.size())), "all-reduce");
  const float sum = static_cast<float>(size * (size + 1) / 2);
  for (float v : data) {
    if (v != sum) {
      std::fprintf(stderr, "rank %d: all-reduce gave %g, expected %g\n", rank, v, sum);
      return 1;
    }
  }

  std::vector<float> out(1024, static_cast<float>(rank)), in(1024, -1);
  std::unique_ptr<Work> sent = c.Send(Buffer::Of(out.data(), out.size()), (rank + 1) % size);
  wait(c.Recv(Buffer::Of(in.data(), in.size()), (rank + size - 1) % size), "recv");
  wait(std::move(sent), "send");
  if (in[0] != static_cast<float>((rank + size - 1) % size) || in.back() != in[0]) {
    std::fprintf(stderr, "rank %d: received %g from the left\n", rank, in[0]);
    return 1;
  }
  wait(c.Barrier(), "barrier");
  return 0;
}
