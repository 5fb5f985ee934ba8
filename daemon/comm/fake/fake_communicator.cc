#include "daemon/comm/fake/fake_communicator.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/comm/half.h"

namespace rannc {
namespace comm {
namespace {

using std::chrono::milliseconds;

enum class Kind { kSend, kRecv, kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kSend: return "send";
    case Kind::kRecv: return "recv";
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kReduceScatter: return "reduce_scatter";
    case Kind::kAllGather: return "all_gather";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

// One operation's outcome, shared by its Work and the group's pending queues; guarded by the
// group's mutex.
struct OpState {
  bool done = false;
  absl::Status status;
};

struct PendingP2p {
  Buffer buffer;
  std::shared_ptr<OpState> op;
};

// Sends and receives of one (src, dst, tag) not yet matched; at most one of the queues is
// non-empty, since an arrival matches the other queue's head first.
struct Channel {
  std::deque<PendingP2p> sends;
  std::deque<PendingP2p> recvs;
};

// What a rank issued at one position of the group's collective order; ranks must agree on it.
struct Signature {
  Kind kind = Kind::kBarrier;
  DataType dtype = DataType::kFloat32;
  size_t count = 0;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::string local_error;  // the issuing rank's own arguments are wrong

  bool operator==(const Signature& o) const {
    if (kind != o.kind) return false;
    if (kind == Kind::kBarrier) return true;
    if (dtype != o.dtype || count != o.count) return false;
    if ((kind == Kind::kAllReduce || kind == Kind::kReduceScatter) && op != o.op) return false;
    if (kind == Kind::kBroadcast && root != o.root) return false;
    return true;
  }

  std::string Describe() const {
    if (kind == Kind::kBarrier) return "barrier";
    std::string s = absl::StrCat(KindName(kind), " of ", count, " ", DataTypeName(dtype));
    if (kind == Kind::kAllReduce || kind == Kind::kReduceScatter) {
      absl::StrAppend(&s, " (", ReduceOpName(op), ")");
    }
    if (kind == Kind::kBroadcast) absl::StrAppend(&s, " from root ", root);
    return s;
  }
};

struct Contribution {
  bool arrived = false;
  Buffer input;
  Buffer output;
  std::shared_ptr<OpState> op;
};

// One position of the collective order, until every rank has issued it.
struct Slot {
  Signature signature;  // the first arriver's
  int first_rank = -1;
  absl::Status failure;
  int arrived = 0;
  std::vector<Contribution> ranks;
};

struct GroupState {
  GroupState(std::string name, int size)
      : name(std::move(name)), size(size), joined(size), dead(size), next_seq(size) {}

  const std::string name;
  const int size;

  std::mutex mu;
  std::condition_variable changed;  // any op completed
  std::vector<bool> joined;         // guarded by the registry's mutex
  int members = 0;                  // guarded by the registry's mutex
  std::vector<bool> dead;
  std::map<std::tuple<int, int, uint32_t>, Channel> channels;
  std::vector<uint64_t> next_seq;
  std::map<uint64_t, Slot> slots;
};

// Live groups by name and incarnation (the store's count of joins): a group re-created under
// the same name gets a fresh entry even while the old one's last communicators are still being
// destroyed.
struct Registry {
  std::mutex mu;
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<GroupState>> groups;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed: communicators may outlive main
  return *registry;
}

std::string GoneMessage(const GroupState& g, int rank) {
  return absl::StrCat("rank ", rank, " of group ", g.name, " is gone");
}

int FirstDead(const GroupState& g) {
  for (int r = 0; r < g.size; ++r) {
    if (g.dead[r]) return r;
  }
  return -1;
}

std::string RankList(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

// Callers hold g.mu and notify g.changed afterwards.
void Complete(OpState& op, absl::Status status) {
  if (op.done) return;
  op.done = true;
  op.status = std::move(status);
}

void MarkDeadLocked(GroupState& g, int rank) {
  if (g.dead[rank]) return;
  g.dead[rank] = true;
  const absl::Status gone = absl::UnavailableError(GoneMessage(g, rank));
  for (auto it = g.channels.begin(); it != g.channels.end();) {
    const int src = std::get<0>(it->first);
    const int dst = std::get<1>(it->first);
    if (src == rank || dst == rank) {
      for (PendingP2p& p : it->second.sends) Complete(*p.op, gone);
      for (PendingP2p& p : it->second.recvs) Complete(*p.op, gone);
      it = g.channels.erase(it);
    } else {
      ++it;
    }
  }
  // Every collective involves every rank: none pending can complete any more.
  for (auto& [seq, slot] : g.slots) {
    for (Contribution& c : slot.ranks) {
      if (c.arrived) Complete(*c.op, gone);
    }
  }
  g.slots.clear();
}

// ---- Reductions ----

template <typename T, typename A>
struct Plain {
  using Acc = A;
  static Acc Load(T v) { return static_cast<Acc>(v); }
  static T Store(Acc a) { return static_cast<T>(a); }
};
struct Half {
  using Acc = float;
  static float Load(uint16_t v) { return Float16ToFloat(v); }
  static uint16_t Store(float a) { return FloatToFloat16(a); }
};
struct BHalf {
  using Acc = float;
  static float Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Store(float a) { return FloatToBFloat16(a); }
};

// Element i of every output gets the reduction of element i of every input, in rank order.
// All inputs of an element are read before any output is written, so in-place use is safe.
template <typename T, typename Traits, typename Combine>
void ReduceLoop(const std::vector<const void*>& in, const std::vector<void*>& out, size_t count,
                Combine combine, bool average) {
  using Acc = typename Traits::Acc;
  const Acc n = static_cast<Acc>(in.size());
  for (size_t i = 0; i < count; ++i) {
    Acc acc = Traits::Load(static_cast<const T*>(in[0])[i]);
    for (size_t q = 1; q < in.size(); ++q) {
      acc = combine(acc, Traits::Load(static_cast<const T*>(in[q])[i]));
    }
    if (average) acc = acc / n;
    const T result = Traits::Store(acc);
    for (void* o : out) static_cast<T*>(o)[i] = result;
  }
}

template <typename T, typename Traits>
void ReduceTyped(ReduceOp op, const std::vector<const void*>& in, const std::vector<void*>& out,
                 size_t count) {
  using Acc = typename Traits::Acc;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      ReduceLoop<T, Traits>(in, out, count, [](Acc a, Acc b) -> Acc { return a + b; },
                            op == ReduceOp::kAvg);
      return;
    case ReduceOp::kMax:
      ReduceLoop<T, Traits>(in, out, count, [](Acc a, Acc b) -> Acc { return b > a ? b : a; },
                            false);
      return;
    case ReduceOp::kMin:
      ReduceLoop<T, Traits>(in, out, count, [](Acc a, Acc b) -> Acc { return b < a ? b : a; },
                            false);
      return;
  }
}

void Reduce(DataType dtype, ReduceOp op, const std::vector<const void*>& in,
            const std::vector<void*>& out, size_t count) {
  // Integers accumulate in int64 so that a sum of int8s wraps only once, at the store.
  switch (dtype) {
    case DataType::kFloat32: return ReduceTyped<float, Plain<float, float>>(op, in, out, count);
    case DataType::kFloat64:
      return ReduceTyped<double, Plain<double, double>>(op, in, out, count);
    case DataType::kFloat16: return ReduceTyped<uint16_t, Half>(op, in, out, count);
    case DataType::kBFloat16: return ReduceTyped<uint16_t, BHalf>(op, in, out, count);
    case DataType::kInt64:
      return ReduceTyped<int64_t, Plain<int64_t, int64_t>>(op, in, out, count);
    case DataType::kInt32:
      return ReduceTyped<int32_t, Plain<int32_t, int64_t>>(op, in, out, count);
    case DataType::kInt8: return ReduceTyped<int8_t, Plain<int8_t, int64_t>>(op, in, out, count);
    case DataType::kUInt8:
      return ReduceTyped<uint8_t, Plain<uint8_t, int64_t>>(op, in, out, count);
  }
}

// Runs a collective every rank has issued with agreeing signatures.
void Compute(const Slot& slot, int size) {
  const Signature& sig = slot.signature;
  const size_t elem = ElementSize(sig.dtype);
  switch (sig.kind) {
    case Kind::kAllReduce: {
      std::vector<const void*> in;
      std::vector<void*> out;
      for (const Contribution& c : slot.ranks) {
        in.push_back(c.input.data);
        out.push_back(c.input.data);
      }
      Reduce(sig.dtype, sig.op, in, out, sig.count);
      return;
    }
    case Kind::kReduceScatter: {
      for (int r = 0; r < size; ++r) {
        std::vector<const void*> in;
        for (const Contribution& c : slot.ranks) {
          in.push_back(static_cast<const char*>(c.input.data) + r * sig.count * elem);
        }
        Reduce(sig.dtype, sig.op, in, {slot.ranks[r].output.data}, sig.count);
      }
      return;
    }
    case Kind::kAllGather: {
      const size_t bytes = sig.count * elem;
      if (bytes == 0) return;
      for (int r = 0; r < size; ++r) {
        for (int q = 0; q < size; ++q) {
          char* dst = static_cast<char*>(slot.ranks[r].output.data) + q * bytes;
          const void* src = slot.ranks[q].input.data;
          if (dst != src) std::memmove(dst, src, bytes);  // in-place gathers alias
        }
      }
      return;
    }
    case Kind::kBroadcast: {
      const size_t bytes = sig.count * elem;
      const void* src = slot.ranks[sig.root].input.data;
      for (const Contribution& c : slot.ranks) {
        if (bytes > 0 && c.input.data != src) std::memcpy(c.input.data, src, bytes);
      }
      return;
    }
    case Kind::kBarrier:
    case Kind::kSend:
    case Kind::kRecv:
      return;
  }
}

// ---- Work ----

class FakeWork final : public Work {
 public:
  // `kind` and `peer` (p2p) or `seq` (collectives) say what to report when a wait times out.
  FakeWork(std::shared_ptr<GroupState> group, std::shared_ptr<OpState> op, Kind kind, int rank,
           int peer, uint32_t tag, uint64_t seq)
      : group_(std::move(group)),
        op_(std::move(op)),
        kind_(kind),
        rank_(rank),
        peer_(peer),
        tag_(tag),
        seq_(seq) {}

  absl::Status Wait(milliseconds timeout) override {
    GroupState& g = *group_;
    std::unique_lock<std::mutex> lock(g.mu);
    auto done = [this] { return op_->done; };
    // Beyond a year is "forever"; it also keeps now() + timeout from overflowing.
    if (timeout >= std::chrono::hours(24 * 365)) {
      g.changed.wait(lock, done);
    } else if (!g.changed.wait_for(lock, timeout, done)) {
      return absl::DeadlineExceededError(
          absl::StrCat(Describe(), " did not complete within ", timeout.count(), " ms: ",
                       MissingLocked()));
    }
    return op_->status;
  }

  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(group_->mu);
    return op_->done;
  }

 private:
  std::string Describe() const {
    const GroupState& g = *group_;
    if (kind_ == Kind::kSend) {
      return absl::StrCat("send to rank ", peer_, " (tag ", tag_, ") by rank ", rank_,
                          " of group ", g.name, " (fake)");
    }
    if (kind_ == Kind::kRecv) {
      return absl::StrCat("recv from rank ", peer_, " (tag ", tag_, ") by rank ", rank_,
                          " of group ", g.name, " (fake)");
    }
    return absl::StrCat(KindName(kind_), " #", seq_, " on rank ", rank_, " of group ", g.name,
                        " (fake)");
  }

  std::string MissingLocked() const {
    const GroupState& g = *group_;
    if (kind_ == Kind::kSend) {
      return absl::StrCat("rank ", peer_, " has not issued the matching recv");
    }
    if (kind_ == Kind::kRecv) {
      return absl::StrCat("rank ", peer_, " has not issued the matching send");
    }
    std::vector<int> missing;
    auto it = g.slots.find(seq_);
    for (int r = 0; r < g.size; ++r) {
      if (it == g.slots.end() || !it->second.ranks[r].arrived) missing.push_back(r);
    }
    return absl::StrCat(RankList(missing), " of ", g.size, " have not issued it");
  }

  std::shared_ptr<GroupState> group_;
  std::shared_ptr<OpState> op_;
  const Kind kind_;
  const int rank_;
  const int peer_;
  const uint32_t tag_;
  const uint64_t seq_;
};

absl::Status CheckBuffer(const Buffer& b, const char* what) {
  if (b.device != DeviceKind::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fake communicator: ", what, " is CUDA memory; the fake backend handles host memory "
        "only (use the NCCL backend for CUDA buffers)"));
  }
  if (b.data == nullptr && b.count > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fake communicator: ", what, " has ", b.count, " elements but no data"));
  }
  return absl::OkStatus();
}

// ---- Communicator ----

class FakeCommunicator final : public Communicator {
 public:
  FakeCommunicator(std::shared_ptr<GroupState> group, int rank, int64_t incarnation)
      : group_(std::move(group)), rank_(rank), incarnation_(incarnation) {}

  ~FakeCommunicator() override {
    // Leaving counts as dying: peers waiting on this rank get UNAVAILABLE instead of hanging.
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      MarkDeadLocked(*group_, rank_);
    }
    group_->changed.notify_all();
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mu);
    if (--group_->members == 0) registry.groups.erase({group_->name, incarnation_});
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  const char* backend() const override { return "fake"; }

  std::unique_ptr<Work> Send(const Buffer& buffer, int dst, const SendOptions& options) override {
    return IssueP2p(Kind::kSend, buffer, dst, options.tag);
  }
  std::unique_ptr<Work> Recv(const Buffer& buffer, int src, const RecvOptions& options) override {
    return IssueP2p(Kind::kRecv, buffer, src, options.tag);
  }

  std::unique_ptr<Work> AllReduce(const Buffer& buffer,
                                  const AllReduceOptions& options) override {
    Signature sig{Kind::kAllReduce, buffer.dtype, buffer.count, options.op};
    AddLocalError(&sig, CheckBuffer(buffer, "the buffer"));
    return IssueCollective(sig, buffer, buffer);
  }

  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      const ReduceScatterOptions& options) override {
    Signature sig{Kind::kReduceScatter, output.dtype, output.count, options.op};
    AddLocalError(&sig, CheckBuffer(input, "the input"));
    AddLocalError(&sig, CheckBuffer(output, "the output"));
    AddLocalError(&sig, CheckChunks(input, output, "input", "output"));
    return IssueCollective(sig, input, output);
  }

  std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                  const AllGatherOptions& options) override {
    Signature sig{Kind::kAllGather, input.dtype, input.count};
    AddLocalError(&sig, CheckBuffer(input, "the input"));
    AddLocalError(&sig, CheckBuffer(output, "the output"));
    AddLocalError(&sig, CheckChunks(output, input, "output", "input"));
    return IssueCollective(sig, input, output);
  }

  std::unique_ptr<Work> Broadcast(const Buffer& buffer,
                                  const BroadcastOptions& options) override {
    Signature sig{Kind::kBroadcast, buffer.dtype, buffer.count, ReduceOp::kSum, options.root};
    AddLocalError(&sig, CheckBuffer(buffer, "the buffer"));
    if (options.root < 0 || options.root >= group_->size) {
      AddLocalError(&sig, absl::InvalidArgumentError(absl::StrCat(
                              "root ", options.root, " is not a rank of a group of ",
                              group_->size)));
    }
    return IssueCollective(sig, buffer, buffer);
  }

  std::unique_ptr<Work> Barrier(const BarrierOptions& options) override {
    return IssueCollective(Signature{Kind::kBarrier}, Buffer{}, Buffer{});
  }

 private:
  static void AddLocalError(Signature* sig, const absl::Status& s) {
    if (!s.ok() && sig->local_error.empty()) sig->local_error = std::string(s.message());
  }

  // `whole` must hold size() chunks of `chunk`'s count, in the same dtype.
  absl::Status CheckChunks(const Buffer& whole, const Buffer& chunk, const char* whole_name,
                           const char* chunk_name) const {
    if (whole.dtype != chunk.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("the ", whole_name, " is ",
                                                     DataTypeName(whole.dtype), " but the ",
                                                     chunk_name, " is ",
                                                     DataTypeName(chunk.dtype)));
    }
    if (whole.count != chunk.count * group_->size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", whole_name, " has ", whole.count, " elements, expected size() * ", chunk_name,
          ".count = ", group_->size, " * ", chunk.count));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<Work> Done(Kind kind, int peer, uint32_t tag, uint64_t seq,
                             absl::Status status) {
    auto op = std::make_shared<OpState>();
    op->done = true;
    op->status = std::move(status);
    return std::make_unique<FakeWork>(group_, op, kind, rank_, peer, tag, seq);
  }

  std::unique_ptr<Work> IssueP2p(Kind kind, const Buffer& buffer, int peer, uint32_t tag) {
    GroupState& g = *group_;
    const char* name = KindName(kind);
    if (peer < 0 || peer >= g.size) {
      return Done(kind, peer, tag, 0,
                  absl::InvalidArgumentError(absl::StrCat(
                      name, " on rank ", rank_, " of group ", g.name, ": peer ", peer,
                      " is not a rank of a group of ", g.size)));
    }
    absl::Status valid = CheckBuffer(buffer, "the buffer");
    if (!valid.ok()) return Done(kind, peer, tag, 0, valid);

    auto op = std::make_shared<OpState>();
    {
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.dead[rank_] || g.dead[peer]) {
        Complete(*op, absl::UnavailableError(GoneMessage(g, g.dead[rank_] ? rank_ : peer)));
      } else {
        const bool send = kind == Kind::kSend;
        const int src = send ? rank_ : peer;
        const int dst = send ? peer : rank_;
        Channel& ch = g.channels[{src, dst, tag}];
        std::deque<PendingP2p>& others = send ? ch.recvs : ch.sends;
        if (others.empty()) {
          (send ? ch.sends : ch.recvs).push_back({buffer, op});
        } else {
          PendingP2p other = std::move(others.front());
          others.pop_front();
          const PendingP2p mine{buffer, op};
          Match(send ? mine : other, send ? other : mine, src, dst, tag);
        }
      }
    }
    g.changed.notify_all();
    return std::make_unique<FakeWork>(group_, op, kind, rank_, peer, tag, 0);
  }

  void Match(const PendingP2p& send, const PendingP2p& recv, int src, int dst, uint32_t tag) {
    const Buffer& s = send.buffer;
    const Buffer& r = recv.buffer;
    if (s.count != r.count || s.dtype != r.dtype) {
      const absl::Status error = absl::InvalidArgumentError(absl::StrCat(
          "recv by rank ", dst, " from rank ", src, " (tag ", tag, ") of group ", group_->name,
          " expects ", r.count, " ", DataTypeName(r.dtype), " but the matching send has ",
          s.count, " ", DataTypeName(s.dtype),
          " (sends and recvs of one tag match in issue order)"));
      Complete(*send.op, error);
      Complete(*recv.op, error);
      return;
    }
    if (s.bytes() > 0 && s.data != r.data) std::memcpy(r.data, s.data, s.bytes());
    Complete(*send.op, absl::OkStatus());
    Complete(*recv.op, absl::OkStatus());
  }

  std::unique_ptr<Work> IssueCollective(const Signature& sig, const Buffer& input,
                                        const Buffer& output) {
    GroupState& g = *group_;
    auto op = std::make_shared<OpState>();
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(g.mu);
      seq = g.next_seq[rank_]++;
      const int dead = FirstDead(g);
      if (dead >= 0) {
        Complete(*op, absl::UnavailableError(GoneMessage(g, dead)));
      } else {
        Slot& slot = g.slots[seq];
        if (slot.ranks.empty()) slot.ranks.resize(g.size);
        slot.ranks[rank_] = {true, input, output, op};
        ++slot.arrived;
        const std::string where =
            absl::StrCat("collective #", seq, " of group ", g.name, ": ");
        if (slot.failure.ok()) {
          if (!sig.local_error.empty()) {
            slot.failure = absl::InvalidArgumentError(absl::StrCat(
                where, "rank ", rank_, " issued ", sig.Describe(), " but ", sig.local_error));
          } else if (slot.first_rank < 0) {
            slot.signature = sig;
            slot.first_rank = rank_;
          } else if (!(slot.signature == sig)) {
            slot.failure = absl::InvalidArgumentError(absl::StrCat(
                where, "rank ", slot.first_rank, " issued ", slot.signature.Describe(),
                " but rank ", rank_, " issued ", sig.Describe(),
                " (every rank must issue the group's collectives in the same order with the "
                "same count, dtype, reduce op and root)"));
          }
        }
        if (!slot.failure.ok()) {
          // Fail every rank now, not when the last one arrives: it may never.
          for (Contribution& c : slot.ranks) {
            if (c.arrived) Complete(*c.op, slot.failure);
          }
        }
        if (slot.arrived == g.size) {
          if (slot.failure.ok()) {
            Compute(slot, g.size);
            for (Contribution& c : slot.ranks) Complete(*c.op, absl::OkStatus());
          }
          g.slots.erase(seq);
        }
      }
    }
    g.changed.notify_all();
    return std::make_unique<FakeWork>(group_, op, sig.kind, rank_, -1, 0, seq);
  }

  std::shared_ptr<GroupState> group_;
  const int rank_;
  const int64_t incarnation_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeFakeCommunicator(const GroupOptions& options) {
  if (options.store == nullptr) {
    return absl::InvalidArgumentError("fake communicator: GroupOptions.store is null");
  }
  if (options.group.empty()) {
    return absl::InvalidArgumentError("fake communicator: GroupOptions.group is empty");
  }
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("fake communicator: rank ", options.rank, " is not in a group of size ",
                     options.size, " (need 0 <= rank < size)"));
  }
  const std::string prefix = absl::StrCat(options.group, "/fake");
  // Every `size` joins make one incarnation of the group; keys are per incarnation so that a
  // re-created group does not see the previous one's rendezvous keys in a reused store.
  absl::StatusOr<int64_t> joins = options.store->Add(absl::StrCat(prefix, "/joins"), 1);
  if (!joins.ok()) return joins.status();
  const int64_t incarnation = (*joins - 1) / options.size;
  const std::pair<std::string, int64_t> key{options.group, incarnation};

  std::shared_ptr<GroupState> group;
  Registry& registry = GetRegistry();
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    std::shared_ptr<GroupState>& entry = registry.groups[key];
    if (entry == nullptr) entry = std::make_shared<GroupState>(options.group, options.size);
    if (entry->size != options.size) {
      if (entry->members == 0) registry.groups.erase(key);
      return absl::InvalidArgumentError(absl::StrCat(
          "fake communicator: rank ", options.rank, " of group ", options.group, " says size ",
          options.size, " but another rank said ", entry->size));
    }
    if (entry->joined[options.rank]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fake communicator: rank ", options.rank, " of group ", options.group,
          " joined twice; each rank must join once (destroy the group before re-creating it)"));
    }
    entry->joined[options.rank] = true;
    ++entry->members;
    group = entry;
  }

  const std::string keys_prefix = absl::StrCat(prefix, "/", incarnation, "/rank/");
  absl::Status published = options.store->Set(absl::StrCat(keys_prefix, options.rank), "joined");
  std::vector<std::string> keys;
  for (int r = 0; r < options.size; ++r) keys.push_back(absl::StrCat(keys_prefix, r));
  absl::Status met =
      published.ok() ? options.store->Wait(keys, options.setup_timeout) : published;
  if (!met.ok()) {
    std::lock_guard<std::mutex> lock(registry.mu);
    std::vector<int> missing;
    for (int r = 0; r < options.size; ++r) {
      if (!group->joined[r]) missing.push_back(r);
    }
    group->joined[options.rank] = false;
    if (--group->members == 0) registry.groups.erase(key);
    return absl::DeadlineExceededError(absl::StrCat(
        "fake communicator: group ", options.group, " did not meet within ",
        options.setup_timeout.count(), " ms: ", RankList(missing), " of ", options.size,
        " did not join (every rank must call MakeCommunicator with the same group, size and "
        "store)"));
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<FakeCommunicator>(std::move(group), options.rank, incarnation));
}

void FailFakeRank(const std::string& group, int rank) {
  std::vector<std::shared_ptr<GroupState>> matches;
  {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mu);
    for (auto& [key, state] : registry.groups) {
      if (key.first == group && rank >= 0 && rank < state->size) matches.push_back(state);
    }
  }
  for (const std::shared_ptr<GroupState>& g : matches) {
    {
      std::lock_guard<std::mutex> lock(g->mu);
      MarkDeadLocked(*g, rank);
    }
    g->changed.notify_all();
  }
}

int64_t FakeCollectivesIssued(const std::string& group, int rank) {
  std::vector<std::shared_ptr<GroupState>> matches;
  {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mu);
    for (auto& [key, state] : registry.groups) {
      if (key.first == group && rank >= 0 && rank < state->size) matches.push_back(state);
    }
  }
  int64_t issued = 0;
  for (const std::shared_ptr<GroupState>& g : matches) {
    std::lock_guard<std::mutex> lock(g->mu);
    issued += static_cast<int64_t>(g->next_seq[rank]);
  }
  return issued;
}

}  // namespace comm
}  // namespace rannc
