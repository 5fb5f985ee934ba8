// Bandwidth of the UCX backend: send/recv rank 0 -> 1 and all_reduce over all ranks, float32,
// median of repetitions after warm-up. Ranks are either threads of one process (as a daemon's
// CPU devices use it) or processes meeting through a gRPC store (as ranks on different daemons
// do; rank 0's process serves the store). Rank 0 prints one line per measurement,
// "op bytes seconds" (the slowest rank's time), for benchmarks/comm_bandwidth.py to tabulate.
//
//   bazel build -c opt //benchmarks:comm_bench
//   bazel-bin/benchmarks/comm_bench --ranks 4 --sizes_mib 1,4,16 --reps 5
//   # one process per rank:
//   comm_bench --ranks 4 --rank 0 --serve_store 127.0.0.1:PORT ... &
//   comm_bench --ranks 4 --rank R --store 127.0.0.1:PORT ...        (R = 1..3)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "daemon/comm/grpc_store.h"
#include "daemon/comm/ucx/ucx_communicator.h"
#include "daemon/common/stats.h"

using namespace rannc::comm;
using Clock = std::chrono::steady_clock;

namespace {

using rannc::Median;

struct Settings {
  int ranks = 4, reps = 5, warmup = 2;
  std::vector<size_t> sizes_mib = {1, 4, 16, 64, 256};
};

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// The slowest rank's `seconds`, on every rank.
double MaxOverRanks(Communicator& c, double seconds) {
  double v = seconds;
  Check(c.AllReduce({&v, 1, DataType::kFloat64}, {ReduceOp::kMax})->Wait());
  return v;
}

void RunRank(Communicator& c, const Settings& s) {
  const int r = c.rank();
  for (size_t mib : s.sizes_mib) {
    const size_t count = (mib << 20) / 4;
    std::vector<float> buf(count, 1.0f);  // touched before timing: fresh pages fault slowly
    std::vector<double> p2p, allreduce;
    for (int it = 0; it < s.warmup + s.reps; ++it) {
      Check(c.Barrier()->Wait());
      auto start = Clock::now();
      if (r == 0) Check(c.Send(Buffer::Of(buf.data(), count), 1)->Wait());
      if (r == 1) Check(c.Recv(Buffer::Of(buf.data(), count), 0)->Wait());
      double t = MaxOverRanks(c, std::chrono::duration<double>(Clock::now() - start).count());
      if (it >= s.warmup) p2p.push_back(t);
      Check(c.Barrier()->Wait());
      start = Clock::now();
      Check(c.AllReduce(Buffer::Of(buf.data(), count))->Wait());
      t = MaxOverRanks(c, std::chrono::duration<double>(Clock::now() - start).count());
      if (it >= s.warmup) allreduce.push_back(t);
    }
    if (r == 0) {
      std::printf("sendrecv %zu %.9f\n", mib << 20, Median(p2p));
      std::printf("allreduce %zu %.9f\n", mib << 20, Median(allreduce));
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  int rank = -1;  // >= 0: this process is that one rank
  std::string store_address, serve_store;
  size_t chunk = size_t(1) << 20;
  bool peer_errors = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks") s.ranks = std::stoi(value);
    else if (flag == "--reps") s.reps = std::stoi(value);
    else if (flag == "--warmup") s.warmup = std::stoi(value);
    else if (flag == "--chunk_kib") chunk = std::stoul(value) << 10;
    else if (flag == "--peer_errors") peer_errors = value != "0";
    else if (flag == "--rank") rank = std::stoi(value);
    else if (flag == "--store") store_address = value;
    else if (flag == "--serve_store") serve_store = value;
    else if (flag == "--sizes_mib") {
      s.sizes_mib.clear();
      size_t start = 0;
      while (start < value.size()) {
        size_t end = value.find(',', start);
        if (end == std::string::npos) end = value.size();
        s.sizes_mib.push_back(std::stoul(value.substr(start, end - start)));
        start = end + 1;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  UcxOptions ucx;
  ucx.chunk_bytes = chunk;
  ucx.peer_error_handling = peer_errors;

  if (rank >= 0) {
    // One rank per process: rank 0 serves the store the others meet through.
    std::unique_ptr<StoreServiceImpl> service;
    std::unique_ptr<grpc::Server> server;
    if (!serve_store.empty()) {
      service = std::make_unique<StoreServiceImpl>(MakeInMemoryStore());
      grpc::ServerBuilder builder;
      builder.AddListeningPort(serve_store, grpc::InsecureServerCredentials());
      builder.RegisterService(service.get());
      server = builder.BuildAndStart();
      if (server == nullptr) {
        std::fprintf(stderr, "cannot serve the store on %s\n", serve_store.c_str());
        return 1;
      }
      store_address = serve_store;
    }
    std::unique_ptr<Store> store = MakeGrpcStore(store_address);
    auto c = MakeUcxCommunicator(store.get(), "bench", rank, s.ranks, std::chrono::seconds(60),
                                 ucx);
    Check(c.status());
    RunRank(**c, s);
    Check((*c)->Barrier()->Wait());  // the store's server outlives every rank's last use
    return 0;
  }

  auto store = MakeInMemoryStore();
  std::vector<std::unique_ptr<Communicator>> comms(s.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < s.ranks; ++r) {
    threads.emplace_back([&, r] {
      auto c = MakeUcxCommunicator(store.get(), "bench", r, s.ranks, std::chrono::seconds(60), ucx);
      Check(c.status());
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < s.ranks; ++r) threads.emplace_back([&, r] { RunRank(*comms[r], s); });
  for (auto& t : threads) t.join();
  return 0;
}
