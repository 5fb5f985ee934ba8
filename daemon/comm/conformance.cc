#include "daemon/comm/conformance.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/comm/half.h"

namespace rannc {
namespace comm {
namespace {

using Group = std::vector<std::unique_ptr<Communicator>>;

constexpr DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                  DataType::kBFloat16, DataType::kInt64,   DataType::kInt32,
                                  DataType::kInt8,     DataType::kUInt8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

const char* OpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

bool IsHalf(DataType t) { return t == DataType::kFloat16 || t == DataType::kBFloat16; }
bool IsFloat(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || IsHalf(t);
}

// Host memory of one dtype, read and written as double: every value the suite uses (small
// integers, their averages) is exact or within tolerance in every dtype.
class HostBuffer {
 public:
  HostBuffer(DataType dtype, size_t count)
      : storage_(std::max<size_t>(1, (count * ElementSize(dtype) + 7) / 8)),
        dtype_(dtype),
        count_(count) {}

  Buffer buffer() { return {storage_.data(), count_, dtype_}; }
  size_t count() const { return count_; }
  DataType dtype() const { return dtype_; }

  double Get(size_t i) const {
    const char* p = bytes() + i * ElementSize(dtype_);
    switch (dtype_) {
      case DataType::kFloat32: return Load<float>(p);
      case DataType::kFloat64: return Load<double>(p);
      case DataType::kFloat16: return Float16ToFloat(Load<uint16_t>(p));
      case DataType::kBFloat16: return BFloat16ToFloat(Load<uint16_t>(p));
      case DataType::kInt64: return static_cast<double>(Load<int64_t>(p));
      case DataType::kInt32: return Load<int32_t>(p);
      case DataType::kInt8: return Load<int8_t>(p);
      case DataType::kUInt8: return Load<uint8_t>(p);
    }
    return 0;
  }

  void Set(size_t i, double v) {
    char* p = bytes() + i * ElementSize(dtype_);
    switch (dtype_) {
      case DataType::kFloat32: return Put<float>(p, static_cast<float>(v));
      case DataType::kFloat64: return Put<double>(p, v);
      case DataType::kFloat16: return Put<uint16_t>(p, FloatToFloat16(static_cast<float>(v)));
      case DataType::kBFloat16: return Put<uint16_t>(p, FloatToBFloat16(static_cast<float>(v)));
      case DataType::kInt64: return Put<int64_t>(p, static_cast<int64_t>(v));
      case DataType::kInt32: return Put<int32_t>(p, static_cast<int32_t>(v));
      case DataType::kInt8: return Put<int8_t>(p, static_cast<int8_t>(v));
      case DataType::kUInt8: return Put<uint8_t>(p, static_cast<uint8_t>(v));
    }
  }

  template <typename F>
  void Fill(F value) {
    for (size_t i = 0; i < count_; ++i) Set(i, value(i));
  }

 private:
  template <typename T>
  static T Load(const char* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  template <typename T>
  static void Put(char* p, T v) {
    std::memcpy(p, &v, sizeof v);
  }
  char* bytes() { return reinterpret_cast<char*>(storage_.data()); }
  const char* bytes() const { return reinterpret_cast<const char*>(storage_.data()); }

  std::vector<uint64_t> storage_;  // uint64_t: aligned for every dtype
  DataType dtype_;
  size_t count_;
};

// What went wrong on one rank's thread. Catch2's assertions are not thread-safe, so threads
// collect messages and the test thread checks them after joining.
class Errors {
 public:
  void Add(std::string message) {
    if (list_.size() < 20) list_.push_back(std::move(message));
  }
  bool empty() const { return list_.empty(); }
  std::string Joined() const { return absl::StrJoin(list_, "\n"); }

  // Waits on `work`; after a first failure, briefly, so a hung backend fails the section in
  // about one timeout rather than one per operation.
  bool Wait(Work& work, const std::string& what) {
    const std::chrono::milliseconds timeout =
        list_.empty() ? kConformanceWaitTimeout : std::chrono::milliseconds(1000);
    absl::Status s = work.Wait(timeout);
    if (!s.ok()) Add(absl::StrCat(what, ": ", s.ToString()));
    return s.ok();
  }

  // Compares every element with `expected(i)`, reporting the first mismatch and their number.
  template <typename F>
  void ExpectValues(const std::string& what, const HostBuffer& b, F expected,
                    double tolerance = 0) {
    size_t bad = 0, first = 0;
    double got_first = 0, want_first = 0;
    for (size_t i = 0; i < b.count(); ++i) {
      const double got = b.Get(i), want = expected(i);
      if (std::fabs(got - want) > tolerance * std::max(1.0, std::fabs(want))) {
        if (bad++ == 0) {
          first = i;
          got_first = got;
          want_first = want;
        }
      }
    }
    if (bad > 0) {
      Add(absl::StrCat(what, " (", DataTypeName(b.dtype()), ", ", b.count(), " elements): ",
                       bad, " wrong, first at ", first, ": got ", got_first, ", expected ",
                       want_first));
    }
  }

 private:
  std::vector<std::string> list_;
};

// Runs body(rank, errors) on one thread per rank, then checks that no rank reported errors.
template <typename Body>
void OnEveryRank(int size, Body body) {
  std::vector<Errors> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { body(r, errors[r]); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r << " of " << size << ":\n" << errors[r].Joined());
    CHECK(errors[r].empty());
  }
}

Group MakeGroup(const GroupMaker& make, int size, const std::string& section) {
  static std::atomic<int> serial{0};
  const std::string name = absl::StrCat("conformance/", section, "/", size, "/", serial++);
  Group group = make(size, name);
  INFO("group " << name);
  REQUIRE(group.size() == static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    REQUIRE(group[r] != nullptr);
    CHECK(group[r]->rank() == r);
    CHECK(group[r]->size() == size);
    CHECK(group[r]->backend() != nullptr);
  }
  return group;
}

// A value every dtype holds exactly (uint8 and int8 included).
double Pattern(int a, int b, size_t i) { return static_cast<double>((a * 7 + b * 13 + i * 3) % 50); }

// ---- Point to point ----

void SendRecvSizes(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "send_recv_sizes");
  struct Case {
    DataType dtype;
    size_t count;
  };
  std::vector<Case> cases;
  for (DataType t : kAllTypes) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{1000}}) cases.push_back({t, count});
  }
  cases.push_back({DataType::kFloat32, (size_t{4} << 20) / 4});  // 4 MiB
  cases.push_back({DataType::kUInt8, size_t{4} << 20});

  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    std::vector<HostBuffer> sent, received;
    std::vector<std::unique_ptr<Work>> works;
    std::vector<std::string> names;
    sent.reserve(cases.size() * size);
    received.reserve(cases.size() * size);
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      for (size_t k = 0; k < cases.size(); ++k) {
        const uint32_t tag = static_cast<uint32_t>(k);
        sent.emplace_back(cases[k].dtype, cases[k].count);
        sent.back().Fill([&](size_t i) { return Pattern(rank, peer + static_cast<int>(k), i); });
        received.emplace_back(cases[k].dtype, cases[k].count);
        received.back().Fill([](size_t) { return 77; });
        // Alternate which goes first so neither order is favoured.
        if ((k + rank) % 2 == 0) {
          works.push_back(c.Send(sent.back().buffer(), peer, {tag}));
          works.push_back(c.Recv(received.back().buffer(), peer, {tag}));
        } else {
          works.push_back(c.Recv(received.back().buffer(), peer, {tag}));
          works.push_back(c.Send(sent.back().buffer(), peer, {tag}));
        }
      }
    }
    for (size_t w = 0; w < works.size(); ++w) {
      errors.Wait(*works[w], absl::StrCat("p2p operation #", w));
    }
    size_t n = 0;
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      for (size_t k = 0; k < cases.size(); ++k, ++n) {
        errors.ExpectValues(absl::StrCat("recv from rank ", peer, " tag ", k), received[n],
                            [&](size_t i) { return Pattern(peer, rank + static_cast<int>(k), i); });
      }
    }
  });
}

void SendRecvOrdering(const GroupMaker& make, int size, bool matches_by_tag) {
  Group g = MakeGroup(make, size, "send_recv_ordering");
  constexpr int kMessages = 12;
  constexpr int kTags = 3;
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    const int right = (rank + 1) % size;
    const int left = (rank + size - 1) % size;
    // Message m has tag m % 3 and m + 1 elements: a backend matching out of issue order, or
    // across tags, sees a count mismatch or wrong values.
    std::vector<HostBuffer> out, in;
    out.reserve(kMessages);
    in.reserve(kMessages);
    for (int m = 0; m < kMessages; ++m) {
      out.emplace_back(DataType::kInt32, m + 1);
      out.back().Fill([&](size_t i) { return 1000 * m + 10 * rank + static_cast<double>(i); });
      in.emplace_back(DataType::kInt32, m + 1);
    }
    std::vector<std::unique_ptr<Work>> sends, recvs(kMessages);
    for (int m = 0; m < kMessages; ++m) {
      sends.push_back(c.Send(out[m].buffer(), right, {static_cast<uint32_t>(m % kTags)}));
    }
    if (matches_by_tag) {
      // Receives posted tag by tag, highest tag first: a different order than the sends'.
      for (int tag = kTags - 1; tag >= 0; --tag) {
        for (int m = tag; m < kMessages; m += kTags) {
          recvs[m] = c.Recv(in[m].buffer(), left, {static_cast<uint32_t>(tag)});
        }
      }
    } else {
      for (int m = 0; m < kMessages; ++m) {
        recvs[m] = c.Recv(in[m].buffer(), left, {static_cast<uint32_t>(m % kTags)});
      }
    }
    for (int m = kMessages - 1; m >= 0; --m) errors.Wait(*recvs[m], absl::StrCat("recv ", m));
    for (int m = kMessages - 1; m >= 0; --m) errors.Wait(*sends[m], absl::StrCat("send ", m));
    for (int m = 0; m < kMessages; ++m) {
      errors.ExpectValues(absl::StrCat("message ", m, " (tag ", m % kTags, ")"), in[m],
                          [&](size_t i) { return 1000 * m + 10 * left + static_cast<double>(i); });
    }
  });
}

void SendRecvRing(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "send_recv_ring");
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    const int right = (rank + 1) % size;
    const int left = (rank + size - 1) % size;
    // Every rank's token moves one step right per send; after 3 rounds of size - 1 steps a
    // rank holds the token that started 3 * (size - 1) ranks to its left. Relaying what was
    // received makes each step depend on the previous one.
    HostBuffer token(DataType::kInt64, 1025);
    token.Fill([&](size_t i) { return Pattern(rank, 5, i); });
    constexpr int kRounds = 3;
    for (int round = 0; round < kRounds; ++round) {
      for (int step = 0; step < size - 1; ++step) {
        HostBuffer incoming(DataType::kInt64, 1025);
        std::unique_ptr<Work> recv = c.Recv(incoming.buffer(), left);
        std::unique_ptr<Work> send = c.Send(token.buffer(), right);
        if (!errors.Wait(*send, absl::StrCat("round ", round, " send")) ||
            !errors.Wait(*recv, absl::StrCat("round ", round, " recv"))) {
          return;
        }
        token = incoming;
      }
    }
    const int origin = ((rank - kRounds * (size - 1)) % size + size) % size;
    errors.ExpectValues(absl::StrCat("ring token (from rank ", origin, ")"), token,
                        [&](size_t i) { return Pattern(origin, 5, i); });
  });
}

// ---- Collectives ----

// Rank r's element i for reductions: b + 2 * ((r + i) % n) with b = i % 20, so the maximum
// moves between ranks, sums stay below 128 (int8), and the sum n*b + n*(n-1) divides by n.
double ReduceInput(int rank, int size, size_t i) {
  return static_cast<double>(i % 20) + 2.0 * static_cast<double>((rank + i) % size);
}

double ReduceExpected(ReduceOp op, int size, size_t i) {
  const double b = static_cast<double>(i % 20);
  switch (op) {
    case ReduceOp::kSum: return size * b + size * (size - 1.0);
    case ReduceOp::kAvg: return b + (size - 1.0);
    case ReduceOp::kMax: return b + 2.0 * (size - 1);
    case ReduceOp::kMin: return b;
  }
  return 0;
}

double Tolerance(DataType dtype, ReduceOp op) {
  if (IsHalf(dtype)) return 1e-2;
  if (IsFloat(dtype) && op == ReduceOp::kAvg) return 1e-6;
  return 0;
}

void AllReduceOpsAndTypes(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "all_reduce");
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    for (DataType dtype : kAllTypes) {
      for (ReduceOp op : kAllOps) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1025}}) {
          const std::string what = absl::StrCat("all_reduce ", OpName(op), " of ", count, " ",
                                                DataTypeName(dtype));
          HostBuffer b(dtype, count);
          b.Fill([&](size_t i) { return ReduceInput(rank, size, i); });
          std::unique_ptr<Work> w = c.AllReduce(b.buffer(), {op});
          if (!errors.Wait(*w, what)) continue;
          errors.ExpectValues(what, b, [&](size_t i) { return ReduceExpected(op, size, i); },
                              Tolerance(dtype, op));
        }
      }
    }
  });
}

void AllReduceLarge(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "all_reduce_large");
  constexpr size_t kCount = size_t{8} << 20;  // 32 MiB of float32
  OnEveryRank(size, [&](int rank, Errors& errors) {
    HostBuffer b(DataType::kFloat32, kCount);
    b.Fill([&](size_t i) { return ReduceInput(rank, size, i); });
    std::unique_ptr<Work> w = g[rank]->AllReduce(b.buffer(), {ReduceOp::kSum});
    if (!errors.Wait(*w, "all_reduce of 8M float32")) return;
    errors.ExpectValues("all_reduce of 8M float32", b,
                        [&](size_t i) { return ReduceExpected(ReduceOp::kSum, size, i); });
  });
}

void ReduceScatterCases(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "reduce_scatter");
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    for (DataType dtype : {DataType::kFloat32, DataType::kInt64, DataType::kBFloat16,
                           DataType::kInt8, DataType::kFloat64}) {
      for (ReduceOp op : kAllOps) {
        for (size_t count : {size_t{1}, size_t{7}, size_t{1025}}) {
          const std::string what = absl::StrCat("reduce_scatter ", OpName(op), " of ", count,
                                                " per rank, ", DataTypeName(dtype));
          HostBuffer in(dtype, count * size), out(dtype, count);
          in.Fill([&](size_t j) { return ReduceInput(rank, size, j); });
          out.Fill([](size_t) { return 77; });
          std::unique_ptr<Work> w = c.ReduceScatter(in.buffer(), out.buffer(), {op});
          if (!errors.Wait(*w, what)) continue;
          errors.ExpectValues(
              what, out, [&](size_t i) { return ReduceExpected(op, size, rank * count + i); },
              Tolerance(dtype, op));
        }
      }
    }
  });
}

void AllGatherCases(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "all_gather");
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kInt8,
                           DataType::kFloat64, DataType::kInt64}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1025}}) {
        const std::string what =
            absl::StrCat("all_gather of ", count, " per rank, ", DataTypeName(dtype));
        HostBuffer in(dtype, count), out(dtype, count * size);
        in.Fill([&](size_t i) { return Pattern(rank, 1, i); });
        out.Fill([](size_t) { return 77; });
        std::unique_ptr<Work> w = c.AllGather(in.buffer(), out.buffer());
        if (!errors.Wait(*w, what)) continue;
        errors.ExpectValues(what, out, [&](size_t j) {
          return Pattern(static_cast<int>(j / count), 1, j % count);
        });
      }
    }
  });
}

void BroadcastFromEveryRoot(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "broadcast");
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    for (int root = 0; root < size; ++root) {
      for (DataType dtype : {DataType::kFloat32, DataType::kInt32, DataType::kUInt8,
                             DataType::kBFloat16}) {
        std::vector<size_t> counts = {1, 1025};
        if (dtype == DataType::kFloat32) counts.push_back(size_t{1} << 20);
        for (size_t count : counts) {
          const std::string what = absl::StrCat("broadcast from root ", root, " of ", count,
                                                " ", DataTypeName(dtype));
          HostBuffer b(dtype, count);
          if (rank == root) {
            b.Fill([&](size_t i) { return Pattern(root, 2, i); });
          } else {
            b.Fill([](size_t) { return 77; });
          }
          std::unique_ptr<Work> w = c.Broadcast(b.buffer(), {root});
          if (!errors.Wait(*w, what)) continue;
          errors.ExpectValues(what, b, [&](size_t i) { return Pattern(root, 2, i); });
        }
      }
    }
  });
}

void BarrierWaitsForAll(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "barrier");
  constexpr int kRounds = 5;
  std::vector<std::atomic<int>> arrived(kRounds);
  for (std::atomic<int>& a : arrived) a = 0;
  OnEveryRank(size, [&](int rank, Errors& errors) {
    for (int round = 0; round < kRounds; ++round) {
      // A different rank comes last each round.
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * ((rank + round) % size)));
      arrived[round]++;
      std::unique_ptr<Work> w = g[rank]->Barrier();
      if (!errors.Wait(*w, absl::StrCat("barrier ", round))) return;
      const int seen = arrived[round].load();
      if (seen != size) {
        errors.Add(absl::StrCat("left barrier ", round, " when only ", seen, " of ", size,
                                " ranks had arrived"));
      }
    }
  });
}

void BackToBack(const GroupMaker& make, int size) {
  Group g = MakeGroup(make, size, "back_to_back");
  constexpr int kOps = 40;
  OnEveryRank(size, [&](int rank, Errors& errors) {
    Communicator& c = *g[rank];
    std::vector<HostBuffer> a, b;  // per op: the (input and) output buffers
    a.reserve(kOps);
    b.reserve(kOps);
    std::vector<std::unique_ptr<Work>> works;
    for (int k = 0; k < kOps; ++k) {
      switch (k % 4) {
        case 0:  // all_reduce sum; counts vary so misordered matching shows
          a.emplace_back(DataType::kFloat32, 7 + k);
          a.back().Fill([&](size_t i) { return ReduceInput(rank, size, i + k); });
          b.emplace_back(DataType::kFloat32, 0);
          works.push_back(c.AllReduce(a.back().buffer(), {ReduceOp::kSum}));
          break;
        case 1:  // all_gather
          a.emplace_back(DataType::kInt32, 3);
          a.back().Fill([&](size_t i) { return Pattern(rank, k, i); });
          b.emplace_back(DataType::kInt32, 3 * size);
          works.push_back(c.AllGather(a.back().buffer(), b.back().buffer()));
          break;
        case 2: {  // broadcast, root rotating
          const int root = (k / 4) % size;
          a.emplace_back(DataType::kInt64, 5);
          a.back().Fill([&](size_t i) { return rank == root ? Pattern(root, k, i) : 77; });
          b.emplace_back(DataType::kInt64, 0);
          works.push_back(c.Broadcast(a.back().buffer(), {root}));
          break;
        }
        case 3:
          a.emplace_back(DataType::kFloat32, 0);
          b.emplace_back(DataType::kFloat32, 0);
          works.push_back(c.Barrier());
          break;
      }
    }
    for (int k = kOps - 1; k >= 0; --k) {
      errors.Wait(*works[k], absl::StrCat("collective #", k));
    }
    for (int k = 0; k < kOps; ++k) {
      const std::string what = absl::StrCat("collective #", k);
      switch (k % 4) {
        case 0:
          errors.ExpectValues(what, a[k], [&](size_t i) {
            const double base = static_cast<double>((i + k) % 20);
            double sum = 0;
            for (int r = 0; r < size; ++r) sum += base + 2.0 * ((r + i + k) % size);
            return sum;
          });
          break;
        case 1:
          errors.ExpectValues(what, b[k], [&](size_t j) {
            return Pattern(static_cast<int>(j / 3), k, j % 3);
          });
          break;
        case 2:
          errors.ExpectValues(what, a[k], [&](size_t i) { return Pattern((k / 4) % size, k, i); });
          break;
      }
    }
  });
}

void TwoGroupsConcurrently(const GroupMaker& make, int size) {
  Group first = MakeGroup(make, size, "two_groups_a");
  Group second = MakeGroup(make, size, "two_groups_b");
  OnEveryRank(size, [&](int thread, Errors& errors) {
    // The same thread is rank `thread` of the first group and the mirrored rank of the second.
    Communicator& a = *first[thread];
    Communicator& b = *second[size - 1 - thread];
    for (int round = 0; round < 10; ++round) {
      HostBuffer x(DataType::kInt64, 33), y(DataType::kFloat32, 65);
      x.Fill([&](size_t i) { return ReduceInput(a.rank(), size, i + round); });
      y.Fill([&](size_t i) { return ReduceInput(b.rank(), size, i); });
      std::unique_ptr<Work> wa, wb;
      // Odd threads issue on the second group first: the groups must not depend on each other.
      if (thread % 2 == 0) {
        wa = a.AllReduce(x.buffer(), {ReduceOp::kSum});
        wb = b.AllReduce(y.buffer(), {ReduceOp::kMax});
      } else {
        wb = b.AllReduce(y.buffer(), {ReduceOp::kMax});
        wa = a.AllReduce(x.buffer(), {ReduceOp::kSum});
      }
      std::unique_ptr<Work> ring_send, ring_recv;
      HostBuffer out(DataType::kInt32, 9), in(DataType::kInt32, 9);
      if (size > 1) {
        out.Fill([&](size_t i) { return Pattern(b.rank(), round, i); });
        ring_recv = b.Recv(in.buffer(), (b.rank() + size - 1) % size, {7});
        ring_send = b.Send(out.buffer(), (b.rank() + 1) % size, {7});
      }
      const bool ok_b = errors.Wait(*wb, absl::StrCat("second group all_reduce ", round));
      const bool ok_a = errors.Wait(*wa, absl::StrCat("first group all_reduce ", round));
      if (!ok_a || !ok_b) return;
      errors.ExpectValues(absl::StrCat("first group round ", round), x, [&](size_t i) {
        double sum = 0;
        for (int r = 0; r < size; ++r) sum += ReduceInput(r, size, i + round);
        return sum;
      });
      errors.ExpectValues(absl::StrCat("second group round ", round), y,
                          [&](size_t i) { return ReduceExpected(ReduceOp::kMax, size, i); });
      if (size > 1) {
        if (!errors.Wait(*ring_send, "second group send") ||
            !errors.Wait(*ring_recv, "second group recv")) {
          return;
        }
        const int left = (b.rank() + size - 1) % size;
        errors.ExpectValues(absl::StrCat("second group ring round ", round), in,
                            [&](size_t i) { return Pattern(left, round, i); });
      }
    }
  });
}

}  // namespace

void RunConformanceSuite(const GroupMaker& make, const ConformanceOptions& options) {
  for (int size = 1; size <= std::min(options.max_size, 4); ++size) {
    DYNAMIC_SECTION("group of " << size) {
      SECTION("setup") { MakeGroup(make, size, "setup"); }
      if (size >= 2) {
        SECTION("send/recv of 0, 1, 1000 elements and 4 MiB, every dtype, every pair") {
          SendRecvSizes(make, size);
        }
        SECTION("send/recv match by tag and issue order") {
          SendRecvOrdering(make, size, options.matches_by_tag);
        }
        SECTION("send/recv around a ring") { SendRecvRing(make, size); }
      }
      SECTION("all_reduce: every op and dtype, 0, 1, 7 and 1025 elements") {
        AllReduceOpsAndTypes(make, size);
      }
      SECTION("all_reduce: 8M float32") { AllReduceLarge(make, size); }
      SECTION("reduce_scatter") { ReduceScatterCases(make, size); }
      SECTION("all_gather") { AllGatherCases(make, size); }
      SECTION("broadcast from every root") { BroadcastFromEveryRoot(make, size); }
      SECTION("barrier: no rank leaves before all arrived") { BarrierWaitsForAll(make, size); }
      SECTION("40 collectives issued before any wait") { BackToBack(make, size); }
      SECTION("two groups driven concurrently by the same threads") {
        TwoGroupsConcurrently(make, size);
      }
    }
  }
}

std::vector<std::unique_ptr<Communicator>> MakeGroupConcurrently(Backend backend, int size,
                                                                 const std::string& group,
                                                                 Store* store) {
  std::vector<absl::Status> statuses(size);
  std::vector<std::unique_ptr<Communicator>> made(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Communicator>> c =
          MakeCommunicator(backend, {store, group, r, size});
      statuses[r] = c.status();
      if (c.ok()) made[r] = std::move(*c);
    });
  }
  for (std::thread& t : threads) t.join();
  bool all_ok = true;
  for (int r = 0; r < size; ++r) {
    INFO("MakeCommunicator for rank " << r << " of " << group << ": " << statuses[r]);
    CHECK(statuses[r].ok());
    all_ok = all_ok && statuses[r].ok();
  }
  if (!all_ok) return {};
  return made;
}

}  // namespace comm
}  // namespace rannc
