#include "daemon/comm/ucx/ucx_communicator.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "daemon/comm/conformance.h"
#include "daemon/common/catch_threads.h"

namespace rannc {
namespace comm {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::vector<std::unique_ptr<Communicator>> MakeGroup(Store* store, const std::string& name,
                                                     int n) {
  std::vector<std::unique_ptr<Communicator>> comms(n);
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto c = MakeUcxCommunicator(GroupOptions{store, name, r, n, seconds(30)});
      std::lock_guard<std::mutex> lock(mu);
      REQUIRE(c.ok());
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

// Runs body(comm) on one thread per rank, as a daemon's CPU devices do.
void OnRanks(std::vector<std::unique_ptr<Communicator>>& comms,
             const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&] { body(*c); });
  for (auto& t : threads) t.join();
}

TEST_CASE("ucx passes the backend conformance suite", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  RunConformanceSuite([&](int n, const std::string& group) {
    return MakeGroupConcurrently(Backend::kUcx, n, group, store.get());
  });
}

TEST_CASE("send/recv of 0, small, 4 MiB and 64 MiB, in order") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "p2p", 2);
  for (size_t count : {size_t(0), size_t(3), size_t(1) << 20, size_t(16) << 20}) {
    CAPTURE(count);
    OnRanks(comms, [&](Communicator& c) {
      std::vector<float> data(count);
      if (c.rank() == 0) {
        for (size_t i = 0; i < count; ++i) data[i] = float(i % 1000);
        THREAD_REQUIRE_OK(c.Send(Buffer::Of(data.data(), count), 1)->Wait(seconds(30)));
      } else {
        THREAD_REQUIRE_OK(c.Recv(Buffer::Of(data.data(), count), 0)->Wait(seconds(30)));
        bool same = true;
        for (size_t i = 0; i < count; ++i) same = same && data[i] == float(i % 1000);
        THREAD_CHECK(same);
      }
    });
  }
}

TEST_CASE("several messages keep their order per tag; tags match apart") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "order", 3);
  OnRanks(comms, [&](Communicator& c) {
    constexpr int kMessages = 20;
    std::vector<int64_t> values(kMessages * 2);
    std::vector<std::unique_ptr<Work>> works;
    const int peer = (c.rank() + 1) % 3, from = (c.rank() + 2) % 3;
    // Receives first for tag 7, then tag 1; sends in the other order.
    for (int i = 0; i < kMessages; ++i) {
      works.push_back(c.Recv({&values[i], 1, DataType::kInt64}, from, {7}));
    }
    for (int i = 0; i < kMessages; ++i) {
      works.push_back(c.Recv({&values[kMessages + i], 1, DataType::kInt64}, from, {1}));
    }
    std::vector<int64_t> out(kMessages * 2);
    for (int i = 0; i < kMessages; ++i) {
      out[kMessages + i] = 1000 + i;
      works.push_back(c.Send({&out[kMessages + i], 1, DataType::kInt64}, peer, {1}));
    }
    for (int i = 0; i < kMessages; ++i) {
      out[i] = i;
      works.push_back(c.Send({&out[i], 1, DataType::kInt64}, peer, {7}));
    }
    for (auto& w : works) THREAD_REQUIRE_OK(w->Wait(seconds(30)));
    for (int i = 0; i < kMessages; ++i) {
      THREAD_CHECK(values[i] == i);
      THREAD_CHECK(values[kMessages + i] == 1000 + i);
    }
  });
}

TEST_CASE("a receive of the wrong size fails with an actionable error") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "size", 2);
  OnRanks(comms, [&](Communicator& c) {
    std::vector<float> data(8);
    if (c.rank() == 0) {
      c.Send(Buffer::Of(data.data(), 8), 1)->Wait(seconds(5)).IgnoreError();
    } else {
      absl::Status s = c.Recv(Buffer::Of(data.data(), 4), 0)->Wait(seconds(30));
      THREAD_CHECK(!s.ok());
    }
  });
}

template <typename T>
T Value(int rank, size_t i) {
  return T(int((rank * 5 + i * 3) % 19) - 4);
}

template <typename T>
void CheckAllReduce(std::vector<std::unique_ptr<Communicator>>& comms, DataType dtype,
                    size_t count, ReduceOp op) {
  const int n = comms.size();
  OnRanks(comms, [&](Communicator& c) {
    std::vector<T> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = Value<T>(c.rank(), i);
    THREAD_REQUIRE_OK(c.AllReduce({data.data(), count, dtype}, {op})->Wait(seconds(60)));
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      double expect = Value<T>(0, i);
      for (int r = 1; r < n; ++r) {
        const double v = Value<T>(r, i);
        if (op == ReduceOp::kSum || op == ReduceOp::kAvg) expect += v;
        if (op == ReduceOp::kMax) expect = std::max(expect, v);
        if (op == ReduceOp::kMin) expect = std::min(expect, v);
      }
      if (op == ReduceOp::kAvg) expect = double(T(T(expect) / T(n)));
      if (double(data[i]) != expect) ++wrong;
    }
    THREAD_CHECK(wrong == 0);
  });
}

TEST_CASE("all_reduce: group sizes 1..4, every op, uneven counts") {
  for (int n = 1; n <= 4; ++n) {
    auto store = MakeInMemoryStore();
    auto comms = MakeGroup(store.get(), "ar", n);
    for (size_t count : {size_t(0), size_t(1), size_t(5), size_t(1001), size_t(1) << 20}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        CAPTURE(n, count, int(op));
        CheckAllReduce<float>(comms, DataType::kFloat32, count, op);
      }
    }
  }
}

TEST_CASE("all_reduce: every dtype") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "dtypes", 3);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    CheckAllReduce<double>(comms, DataType::kFloat64, 4097, op);
    CheckAllReduce<int64_t>(comms, DataType::kInt64, 4097, op);
    CheckAllReduce<int32_t>(comms, DataType::kInt32, 4097, op);
    CheckAllReduce<int8_t>(comms, DataType::kInt8, 4097, op);
  }
  CheckAllReduce<uint8_t>(comms, DataType::kUInt8, 4097, ReduceOp::kMax);
  // float16 and bfloat16: 1.0 + 1.0 + 1.0 == 3.0 exactly.
  for (auto [dtype, one, three] : {std::tuple{DataType::kFloat16, 0x3c00, 0x4200},
                                   std::tuple{DataType::kBFloat16, 0x3f80, 0x4040}}) {
    OnRanks(comms, [&](Communicator& c) {
      std::vector<uint16_t> data(999, uint16_t(one));
      THREAD_REQUIRE_OK(c.AllReduce({data.data(), data.size(), dtype})->Wait(seconds(30)));
      bool all = true;
      for (uint16_t v : data) all = all && v == uint16_t(three);
      THREAD_CHECK(all);
    });
  }
}

TEST_CASE("reduce_scatter, all_gather, broadcast from each root, barrier") {
  for (int n = 1; n <= 4; ++n) {
    auto store = MakeInMemoryStore();
    auto comms = MakeGroup(store.get(), "colls", n);
    const size_t per = 1237;
    OnRanks(comms, [&](Communicator& c) {
      std::vector<int32_t> in(per * n), out(per);
      for (size_t i = 0; i < in.size(); ++i) in[i] = Value<int32_t>(c.rank(), i);
      THREAD_REQUIRE_OK(c.ReduceScatter({in.data(), in.size(), DataType::kInt32},
                                  {out.data(), per, DataType::kInt32})
                      ->Wait(seconds(30)));
      std::vector<int32_t> all(per * n);
      THREAD_REQUIRE_OK(c.AllGather({out.data(), per, DataType::kInt32},
                              {all.data(), all.size(), DataType::kInt32})
                      ->Wait(seconds(30)));
      size_t wrong = 0;
      for (size_t i = 0; i < all.size(); ++i) {
        int32_t expect = 0;
        for (int r = 0; r < n; ++r) expect += Value<int32_t>(r, i);
        if (all[i] != expect) ++wrong;
        if (i / per == size_t(c.rank()) && out[i % per] != expect) ++wrong;
      }
      THREAD_CHECK(wrong == 0);
      for (int root = 0; root < n; ++root) {
        std::vector<float> b(100003, -1.0f);
        if (c.rank() == root) {
          for (size_t i = 0; i < b.size(); ++i) b[i] = float(i % 777 + root);
        }
        THREAD_REQUIRE_OK(c.Broadcast(Buffer::Of(b.data(), b.size()), {root})->Wait(seconds(30)));
        bool same = true;
        for (size_t i = 0; i < b.size(); ++i) same = same && b[i] == float(i % 777 + root);
        THREAD_CHECK(same);
      }
      THREAD_REQUIRE_OK(c.Barrier()->Wait(seconds(30)));
    });
  }
}

TEST_CASE("back-to-back collectives and p2p issued before waiting") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "b2b", 4);
  OnRanks(comms, [&](Communicator& c) {
    constexpr int kOps = 8;
    std::vector<std::vector<float>> bufs(kOps, std::vector<float>(30011));
    std::vector<std::unique_ptr<Work>> works;
    float token = float(c.rank()), got = -1;
    works.push_back(c.Recv(Buffer::Of(&got, 1), (c.rank() + 3) % 4, {42}));
    for (int k = 0; k < kOps; ++k) {
      for (size_t i = 0; i < bufs[k].size(); ++i) bufs[k][i] = float(k + c.rank());
      works.push_back(c.AllReduce(Buffer::Of(bufs[k].data(), bufs[k].size())));
    }
    works.push_back(c.Send(Buffer::Of(&token, 1), (c.rank() + 1) % 4, {42}));
    works.push_back(c.Barrier());
    for (auto& w : works) THREAD_REQUIRE_OK(w->Wait(seconds(60)));
    for (int k = 0; k < kOps; ++k) THREAD_CHECK(bufs[k][12345] == float(4 * k + 6));
    THREAD_CHECK(got == float((c.rank() + 3) % 4));
  });
}

TEST_CASE("create and destroy 20 times") {
  auto store = MakeInMemoryStore();
  for (int i = 0; i < 20; ++i) {
    auto comms = MakeGroup(store.get(), "loop", 3);
    OnRanks(comms, [&](Communicator& c) {
      float x = 1;
      THREAD_REQUIRE_OK(c.AllReduce(Buffer::Of(&x, 1))->Wait(seconds(30)));
      THREAD_CHECK(x == 3);
    });
  }
}

TEST_CASE("a peer destroyed mid-receive fails the waiting rank instead of hanging") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "lost", 2);
  std::vector<float> data(1 << 16);
  std::unique_ptr<Work> recv = comms[1]->Recv(Buffer::Of(data.data(), data.size()), 0);
  std::unique_ptr<Work> coll = comms[1]->AllReduce(Buffer::Of(data.data(), 16));
  CHECK(recv->Wait(milliseconds(100)).code() == absl::StatusCode::kDeadlineExceeded);
  comms[0].reset();
  absl::Status s = recv->Wait(seconds(20));
  INFO(s.ToString());
  CHECK((s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded));
  CHECK(s.message().find("rank 0") != std::string::npos);
  absl::Status cs = coll->Wait(seconds(20));
  INFO(cs.ToString());
  CHECK(cs.code() == absl::StatusCode::kUnavailable);
  // Later operations with the lost rank fail at once.
  CHECK(comms[1]->Send(Buffer::Of(data.data(), 4), 0)->Wait(seconds(5)).code() ==
        absl::StatusCode::kUnavailable);
  comms[1].reset();
}

TEST_CASE("setup names the missing rank after the timeout") {
  auto store = MakeInMemoryStore();
  auto c = MakeUcxCommunicator(store.get(), "alone", 0, 2, milliseconds(300));
  REQUIRE(!c.ok());
  CHECK(c.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(c.status().message().find("rank 1") != std::string::npos);
}

TEST_CASE("invalid arguments fail the Work, not the process") {
  auto store = MakeInMemoryStore();
  auto comms = MakeGroup(store.get(), "args", 1);
  float x = 0;
  CHECK(comms[0]->Send(Buffer::Of(&x, 1), 3)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(MakeUcxCommunicator(store.get(), "bad", 2, 2, seconds(1)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  float y = 5;
  auto r = comms[0]->Recv(Buffer::Of(&x, 1), 0);
  REQUIRE(comms[0]->Send(Buffer::Of(&y, 1), 0)->Wait(seconds(5)).ok());
  REQUIRE(r->Wait(seconds(5)).ok());
  CHECK(x == 5);
}

}  // namespace
}  // namespace comm
}  // namespace rannc
