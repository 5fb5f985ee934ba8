#include "daemon/comm/ucx/ring.h"

#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "daemon/common/catch_threads.h"

namespace rannc {
namespace comm {
namespace {

// Eager in-memory transport: a send copies into the receiver's mailbox and completes at once;
// a receive matches at Wait. Enough for the ring, whose receives of one tag are waited in order.
class Mailboxes {
 public:
  void Put(int src, int dst, uint64_t tag, std::vector<char> bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    boxes_[{src, dst, tag}].push_back(std::move(bytes));
    cv_.notify_all();
  }
  std::vector<char> Take(int src, int dst, uint64_t tag) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& box = boxes_[{src, dst, tag}];
    cv_.wait(lock, [&] { return !box.empty(); });
    std::vector<char> bytes = std::move(box.front());
    box.pop_front();
    return bytes;
  }
  bool Empty() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, box] : boxes_) {
      if (!box.empty()) return false;
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, uint64_t>, std::deque<std::vector<char>>> boxes_;
};

class Done : public P2pRequest {
 public:
  absl::Status Wait() override { return absl::OkStatus(); }
};

class PendingRecv : public P2pRequest {
 public:
  PendingRecv(Mailboxes* boxes, void* data, size_t bytes, int src, int dst, uint64_t tag)
      : boxes_(boxes), data_(data), bytes_(bytes), src_(src), dst_(dst), tag_(tag) {}
  absl::Status Wait() override {
    std::vector<char> got = boxes_->Take(src_, dst_, tag_);
    if (got.size() != bytes_) return absl::InternalError("size mismatch");
    if (bytes_ > 0) std::memcpy(data_, got.data(), bytes_);
    return absl::OkStatus();
  }

 private:
  Mailboxes* boxes_;
  void* data_;
  size_t bytes_;
  int src_, dst_;
  uint64_t tag_;
};

class MemP2p : public P2p {
 public:
  MemP2p(Mailboxes* boxes, int rank, int size) : boxes_(boxes), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::unique_ptr<P2pRequest> StartSend(const void* data, size_t bytes, int dst,
                                        uint64_t tag) override {
    THREAD_CHECK(tag < (uint64_t{1} << kRingTagBits));
    const char* p = static_cast<const char*>(data);
    boxes_->Put(rank_, dst, tag, std::vector<char>(p, p + bytes));
    return std::make_unique<Done>();
  }
  std::unique_ptr<P2pRequest> StartRecv(void* data, size_t bytes, int src,
                                        uint64_t tag) override {
    return std::make_unique<PendingRecv>(boxes_, data, bytes, src, rank_, tag);
  }

 private:
  Mailboxes* boxes_;
  int rank_, size_;
};

// Runs body(p2p) on `n` threads, one per rank, and checks every transfer was consumed.
void OnRanks(int n, const std::function<void(P2p&)>& body) {
  Mailboxes boxes;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      MemP2p p2p(&boxes, r, n);
      body(p2p);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(boxes.Empty());
}

template <typename T>
T Value(int rank, size_t i) {
  return T(int((rank * 7 + i * 3) % 23) - 5);  // small integers: exact in every dtype
}

template <typename T>
void CheckAllReduce(DataType dtype, int n, size_t count, ReduceOp op, size_t chunk_bytes) {
  OnRanks(n, [&](P2p& p2p) {
    std::vector<T> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = Value<T>(p2p.rank(), i);
    RingScratch scratch;
    absl::Status s = RingAllReduce(p2p, 3, {data.data(), count, dtype}, op, &scratch,
                                   {chunk_bytes});
    std::lock_guard<std::mutex> lock(::rannc::testing::CatchMutex());
    REQUIRE(s.ok());
    for (size_t i = 0; i < count; ++i) {
      double expect = Value<T>(0, i);
      for (int r = 1; r < n; ++r) {
        const double v = Value<T>(r, i);
        if (op == ReduceOp::kSum || op == ReduceOp::kAvg) expect += v;
        if (op == ReduceOp::kMax) expect = std::max(expect, v);
        if (op == ReduceOp::kMin) expect = std::min(expect, v);
      }
      if (op == ReduceOp::kAvg) expect = double(T(T(expect) / T(n)));
      if (double(data[i]) != expect) {
        FAIL("rank " << p2p.rank() << " element " << i << ": " << double(data[i])
                     << " != " << expect);
      }
    }
  });
}

TEST_CASE("ring all-reduce: every op, group sizes 1..5, uneven counts, chunking") {
  for (int n = 1; n <= 5; ++n) {
    for (size_t count : {0, 1, 3, 7, 1000, 4099}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        CAPTURE(n, count, int(op));
        CheckAllReduce<float>(DataType::kFloat32, n, count, op, 64);
      }
    }
  }
}

TEST_CASE("ring all-reduce: every dtype") {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg}) {
    CAPTURE(int(op));
    CheckAllReduce<double>(DataType::kFloat64, 3, 1001, op, 256);
    CheckAllReduce<int64_t>(DataType::kInt64, 3, 1001, op, 256);
    CheckAllReduce<int32_t>(DataType::kInt32, 4, 1001, op, 256);
    CheckAllReduce<int8_t>(DataType::kInt8, 4, 1001, op, 256);
  }
  CheckAllReduce<uint8_t>(DataType::kUInt8, 4, 1001, ReduceOp::kMax, 256);
}

TEST_CASE("16-bit floats reduce through float") {
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    const int n = 3;
    const size_t count = 777;
    OnRanks(n, [&](P2p& p2p) {
      // Integers up to 256 are exact in both formats; encode them through ScaleDown's path.
      std::vector<uint16_t> data(count), one(count);
      std::vector<float> f(count);
      for (size_t i = 0; i < count; ++i) f[i] = float((p2p.rank() + i) % 50);
      // Build 16-bit values from the float ones: 0 + x via ReduceInto on a float source is not
      // possible, so start from zero bits and add integers one at a time.
      std::fill(data.begin(), data.end(), 0);
      const uint16_t one_bits = dtype == DataType::kFloat16 ? 0x3c00 : 0x3f80;
      std::fill(one.begin(), one.end(), one_bits);
      for (size_t i = 0; i < count; ++i) {
        for (int k = 0; k < int(f[i]); ++k) ReduceInto(dtype, ReduceOp::kSum, &data[i], &data[i], &one[i], 1);
      }
      RingScratch scratch;
      THREAD_CHECK(RingAllReduce(p2p, 1, {data.data(), count, dtype}, ReduceOp::kSum, &scratch,
                               {128}).ok());
      // Compare with the same sum built by repeated +1 from zero.
      for (size_t i = 0; i < count; i += 37) {
        int expect = 0;
        for (int r = 0; r < n; ++r) expect += int((r + i) % 50);
        uint16_t want = 0;
        for (int k = 0; k < expect; ++k) ReduceInto(dtype, ReduceOp::kSum, &want, &want, &one[0], 1);
        THREAD_CHECK(data[i] == want);
      }
    });
  }
}

TEST_CASE("float16 conversion rounds to nearest even, keeps inf") {
  // 2049 is not representable in float16: 2048 + 1 rounds to even (2048).
  uint16_t a = 0x6800;  // 2048
  uint16_t b = 0x3c00;  // 1
  uint16_t out;
  ReduceInto(DataType::kFloat16, ReduceOp::kSum, &out, &a, &b, 1);
  CHECK(out == 0x6800);
  uint16_t big = 0x7bff;  // 65504, the largest finite
  ReduceInto(DataType::kFloat16, ReduceOp::kSum, &out, &big, &big, 1);
  CHECK(out == 0x7c00);
  uint16_t tiny = 0x0001;  // smallest subnormal survives the round trip
  ReduceInto(DataType::kFloat16, ReduceOp::kMax, &out, &tiny, &tiny, 1);
  CHECK(out == 0x0001);
}

TEST_CASE("ring reduce-scatter and all-gather") {
  for (int n = 1; n <= 4; ++n) {
    for (size_t per : {0, 1, 5, 333}) {
      CAPTURE(n, per);
      OnRanks(n, [&](P2p& p2p) {
        std::vector<int32_t> in(per * n), out(per, -1);
        for (size_t i = 0; i < in.size(); ++i) in[i] = Value<int32_t>(p2p.rank(), i);
        const std::vector<int32_t> before = in;
        RingScratch scratch;
        absl::Status s = RingReduceScatter(p2p, 9, {in.data(), in.size(), DataType::kInt32},
                                           {out.data(), per, DataType::kInt32}, ReduceOp::kSum,
                                           &scratch, {16});
        std::vector<int32_t> gathered(per * n, -1);
        absl::Status g = RingAllGather(p2p, 10, {out.data(), per, DataType::kInt32},
                                       {gathered.data(), gathered.size(), DataType::kInt32},
                                       {8});
        std::lock_guard<std::mutex> lock(::rannc::testing::CatchMutex());
        REQUIRE(s.ok());
        REQUIRE(g.ok());
        CHECK(in == before);
        for (size_t i = 0; i < per * n; ++i) {
          int32_t expect = 0;
          for (int r = 0; r < n; ++r) expect += Value<int32_t>(r, i);
          if (i / per == size_t(p2p.rank())) CHECK(out[i % per] == expect);
          CHECK(gathered[i] == expect);
        }
      });
    }
  }
}

TEST_CASE("ring reduce-scatter rejects mismatched sizes") {
  OnRanks(2, [&](P2p& p2p) {
    std::vector<float> in(5), out(2);
    RingScratch scratch;
    absl::Status s = RingReduceScatter(p2p, 0, Buffer::Of(in.data(), 5), Buffer::Of(out.data(), 2),
                                       ReduceOp::kSum, &scratch);
    THREAD_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  });
}

TEST_CASE("chain broadcast from every root") {
  for (int n = 1; n <= 5; ++n) {
    for (int root = 0; root < n; ++root) {
      OnRanks(n, [&](P2p& p2p) {
        std::vector<int64_t> data(1003, -1);
        if (p2p.rank() == root) {
          for (size_t i = 0; i < data.size(); ++i) data[i] = int64_t(i) * 11 + root;
        }
        THREAD_CHECK(ChainBroadcast(p2p, 5, {data.data(), data.size(), DataType::kInt64}, root,
                                  {64}).ok());
        bool all = true;
        for (size_t i = 0; i < data.size(); ++i) all = all && data[i] == int64_t(i) * 11 + root;
        THREAD_CHECK(all);
      });
    }
  }
}

TEST_CASE("dissemination barrier holds every rank until all arrive") {
  for (int n = 1; n <= 5; ++n) {
    std::atomic<int> arrived{0};
    OnRanks(n, [&](P2p& p2p) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * p2p.rank()));
      arrived++;
      THREAD_CHECK(DisseminationBarrier(p2p, 2).ok());
      THREAD_CHECK(arrived.load() == n);
    });
  }
}

}  // namespace
}  // namespace comm
}  // namespace rannc
