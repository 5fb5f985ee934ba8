// Bandwidth of the UCX backend with ranks as threads of one process (as a daemon's CPU devices
// use it): send/recv rank 0 -> 1 and all_reduce over all ranks, float32, median of repetitions
// after warm-up. Prints one line per measurement, "op bytes seconds", for
// benchmarks/comm_bandwidth.py to tabulate.
//
//   bazel build -c opt //daemon/comm/ucx:comm_bench
//   bazel-bin/daemon/comm/ucx/comm_bench --ranks 4 --sizes_mib 1,4,16 --reps 5
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "daemon/comm/ucx/ucx_communicator.h"

using namespace rannc::comm;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int ranks = 4, reps = 5, warmup = 2;
  size_t chunk = size_t(1) << 20;
  bool peer_errors = false;
  std::vector<size_t> sizes_mib = {1, 4, 16, 64, 256};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks") ranks = std::stoi(value);
    else if (flag == "--reps") reps = std::stoi(value);
    else if (flag == "--warmup") warmup = std::stoi(value);
    else if (flag == "--chunk_kib") chunk = std::stoul(value) << 10;
    else if (flag == "--peer_errors") peer_errors = value != "0";
    else if (flag == "--sizes_mib") {
      sizes_mib.clear();
      size_t start = 0;
      while (start < value.size()) {
        size_t end = value.find(',', start);
        if (end == std::string::npos) end = value.size();
        sizes_mib.push_back(std::stoul(value.substr(start, end - start)));
        start = end + 1;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  auto store = MakeInMemoryStore();
  UcxOptions ucx;
  ucx.chunk_bytes = chunk;
  ucx.peer_error_handling = peer_errors;
  std::vector<std::unique_ptr<Communicator>> comms(ranks);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto c = MakeUcxCommunicator(store.get(), "bench", r, ranks, std::chrono::seconds(60), ucx);
        if (!c.ok()) {
          std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
          std::exit(1);
        }
        comms[r] = std::move(*c);
      });
    }
    for (auto& t : threads) t.join();
  }
  auto check = [](absl::Status s) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(1);
    }
  };
  for (size_t mib : sizes_mib) {
    const size_t count = (mib << 20) / 4;
    std::vector<std::vector<float>> bufs(ranks);
    std::vector<std::thread> threads;
    // Each rank touches its own buffer (this VM faults fresh pages slowly).
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] { bufs[r].assign(count, 1.0f); });
    }
    for (auto& t : threads) t.join();
    threads.clear();
    std::vector<double> p2p, allreduce;
    std::vector<double> times(ranks);
    for (int it = 0; it < warmup + reps; ++it) {
      // send/recv 0 -> 1, timed on the receiver from a barrier.
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          Communicator& c = *comms[r];
          check(c.Barrier()->Wait());
          const auto start = Clock::now();
          if (r == 0) check(c.Send(Buffer::Of(bufs[r].data(), count), 1)->Wait());
          if (r == 1) check(c.Recv(Buffer::Of(bufs[r].data(), count), 0)->Wait());
          times[r] = std::chrono::duration<double>(Clock::now() - start).count();
        });
      }
      for (auto& t : threads) t.join();
      threads.clear();
      if (it >= warmup) p2p.push_back(std::max(times[0], times[1]));
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          Communicator& c = *comms[r];
          check(c.Barrier()->Wait());
          const auto start = Clock::now();
          check(c.AllReduce(Buffer::Of(bufs[r].data(), count))->Wait());
          times[r] = std::chrono::duration<double>(Clock::now() - start).count();
        });
      }
      for (auto& t : threads) t.join();
      threads.clear();
      if (it >= warmup) allreduce.push_back(*std::max_element(times.begin(), times.end()));
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("sendrecv %zu %.9f\n", mib << 20, median(p2p));
    std::printf("allreduce %zu %.9f\n", mib << 20, median(allreduce));
    std::fflush(stdout);
  }
  return 0;
}
