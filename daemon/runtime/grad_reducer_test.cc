#include "daemon/runtime/grad_reducer.h"

#include <chrono>
#include <string>
#include <optional>
#include <thread>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/comm/conformance.h"
#include "daemon/comm/factory.h"
#include "daemon/comm/fake/fake_communicator.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace {

using comm::Backend;

// The parameters of one replica, in the order given to the reducer. The ones that the final
// backward leaves without a gradient come first, so that their buckets come last and every
// other bucket can start during the backward.
struct Model {
  at::Tensor unused;      // float32 [4]: never used, its gradient stays undefined
  at::Tensor early_only;  // float32 [4]: used by the first backward only
  at::Tensor w1;          // float32 [8, 5]
  at::Tensor b1;          // float32 [5]
  at::Tensor w2;          // float32 [5, 7], non-contiguous (a transposed leaf)
  at::Tensor w3;          // float64 [7, 3]
  at::Tensor b3;          // float64 [3]

  std::vector<at::Tensor> params() const { return {unused, early_only, w1, b1, w2, w3, b3}; }
};

at::Tensor Leaf(at::Tensor t) { return t.detach().requires_grad_(true); }

// Every replica starts from the same values, as data-parallel replicas do. The generator is
// global: call from the test thread only (rank threads get models and inputs made here).
Model MakeModel() {
  at::manual_seed(7);
  Model m;
  m.unused = Leaf(at::randn({4}));
  m.early_only = Leaf(at::randn({4}));
  m.w1 = Leaf(at::randn({8, 5}));
  m.b1 = Leaf(at::randn({5}));
  m.w2 = Leaf(at::randn({7, 5}).t());
  m.w3 = Leaf(at::randn({7, 3}, at::kDouble));
  m.b3 = Leaf(at::randn({3}, at::kDouble));
  return m;
}

// A replica's input for backward `pass` (0 or 1) on `rank`: each differs. Test thread only.
at::Tensor Input(int rank, int pass) {
  at::manual_seed(100 + 10 * rank + pass);
  return at::randn({6, 8});
}

// One forward and backward: a chain through every parameter but `unused`, with `early_only`
// only in pass 0, and a switch from float32 to float64 half-way.
void Backward(const Model& m, const at::Tensor& x, int pass) {
  at::Tensor h = at::tanh(x.matmul(m.w1) + m.b1);
  at::Tensor h2 = at::relu(h.matmul(m.w2));
  at::Tensor out = h2.to(at::kDouble).matmul(m.w3) + m.b3;
  at::Tensor loss = out.pow(2).mean();
  if (pass == 0) loss = loss + (m.early_only * h.mean()).sum().to(at::kDouble);
  torch::autograd::backward({loss});
}

// The expected gradients: every rank's two backwards, each on a fresh copy of the model,
// summed over ranks; an undefined gradient counts as zeros.
std::vector<at::Tensor> ExpectedGrads(int size) {
  std::vector<at::Tensor> sum;
  for (const at::Tensor& p : MakeModel().params()) sum.push_back(at::zeros_like(p));
  for (int r = 0; r < size; ++r) {
    Model m = MakeModel();
    Backward(m, Input(r, 0), 0);
    Backward(m, Input(r, 1), 1);
    std::vector<at::Tensor> params = m.params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].grad().defined()) sum[i] += params[i].grad();
    }
  }
  return sum;
}

// The engine's waiter in small: a deadline, no abort flag.
absl::Status WaitFor(std::unique_ptr<comm::Work> work, at::Tensor /*keep*/,
                     const std::string& what) {
  absl::Status s = work->Wait(std::chrono::seconds(30));
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

struct RankResult {
  absl::Status created;
  absl::Status finished;
  int buckets = -1;
  int early = -1;
  std::vector<at::Tensor> grads;
  // Bytes of bucket buffers: after Create, once armed, after Finish.
  int64_t created_bytes = -1, armed_bytes = -1, finished_bytes = -1;
};

// One replica's step, on its own thread: an unarmed backward, an armed one, Finish.
// With `transient` (parameter offload), the reducer is created while the parameters' storage
// is swapped out (their sizes given as Options::numels), and its buffers exist only during the
// armed backward and Finish.
RankResult RunRank(comm::Communicator* c, size_t bucket_bytes, const Model& m,
                   const at::Tensor& x0, const at::Tensor& x1, bool transient = false,
                   std::optional<at::ScalarType> wire = std::nullopt) {
  RankResult result;
  GradReducer::Options options;
  options.bucket_bytes = bucket_bytes;
  options.wire_dtype = wire;
  std::vector<at::Tensor> values;
  if (transient) {
    at::NoGradGuard no_grad;
    options.transient = true;
    for (at::Tensor p : m.params()) {
      options.numels.push_back(p.numel());
      values.push_back(p.detach().clone());
      p.set_(at::empty({0}, p.options()));
    }
  }
  absl::StatusOr<std::unique_ptr<GradReducer>> reducer =
      GradReducer::Create(m.params(), c, options);
  result.created = reducer.status();
  if (!reducer.ok()) return result;
  result.created_bytes = (*reducer)->buffer_bytes();
  if (transient) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> params = m.params();
    for (size_t i = 0; i < params.size(); ++i) params[i].set_(values[i]);
    // set_ made autograd drop the leaves' accumulators: without this no bucket starts early.
    // (No assertion here: this runs on the rank's thread, and Catch2 is not thread-safe; the
    // main thread checks `created`.)
    result.created = (*reducer)->Rebind();
    if (!result.created.ok()) return result;
  }
  Backward(m, x0, 0);
  (*reducer)->BeginFinalBackward();
  result.armed_bytes = (*reducer)->buffer_bytes();
  Backward(m, x1, 1);
  result.finished = (*reducer)->Finish(WaitFor);
  result.finished_bytes = (*reducer)->buffer_bytes();
  result.buckets = (*reducer)->buckets();
  result.early = (*reducer)->buckets_started_early();
  for (const at::Tensor& p : m.params()) result.grads.push_back(p.grad());
  return result;
}

// A group of `size` ranks, each with the test model and its two inputs (rank r's at 2r, 2r + 1).
struct Ranks {
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  std::vector<Model> models;
  std::vector<at::Tensor> inputs;
};

Ranks MakeRanks(Backend backend, comm::Store* store, int size, const std::string& group) {
  Ranks ranks{comm::MakeGroupConcurrently(backend, size, group, store), {}, {}};
  REQUIRE(ranks.comms.size() == static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    ranks.models.push_back(MakeModel());
    ranks.inputs.push_back(Input(r, 0));
    ranks.inputs.push_back(Input(r, 1));
  }
  return ranks;
}

void CheckReduction(Backend backend, comm::Store* store, int size, size_t bucket_bytes,
                    int want_buckets, int want_early, bool transient = false) {
  const std::string group =
      absl::StrCat("grad_reducer/", backend == Backend::kUcx ? "ucx" : "fake", "/", size, "/",
                   bucket_bytes, transient ? "/transient" : "");
  Ranks ranks = MakeRanks(backend, store, size, group);
  auto& comms = ranks.comms;
  auto& models = ranks.models;
  auto& inputs = ranks.inputs;
  std::vector<RankResult> results(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      results[r] = RunRank(comms[r].get(), bucket_bytes, models[r], inputs[2 * r],
                           inputs[2 * r + 1], transient);
    });
  }
  for (std::thread& t : threads) t.join();

  const std::vector<at::Tensor> want = ExpectedGrads(size);
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r << " of " << group);
    REQUIRE(results[r].created.ok());
    INFO(results[r].finished.ToString());
    REQUIRE(results[r].finished.ok());
    CHECK(results[r].buckets == want_buckets);
    CHECK(results[r].early == want_early);
    // The model's gradients: 4 + 4 + 40 + 5 + 35 float32, 21 + 3 float64.
    const int64_t all = 88 * 4 + 24 * 8;
    CHECK(results[r].armed_bytes == all);
    CHECK(results[r].created_bytes == (transient ? 0 : all));
    CHECK(results[r].finished_bytes == (transient ? 0 : all));
    REQUIRE(results[r].grads.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("param " << i);
      REQUIRE(results[r].grads[i].defined());
      CHECK(results[r].grads[i].scalar_type() == want[i].scalar_type());
      CHECK(at::allclose(results[r].grads[i], want[i], /*rtol=*/1e-6, /*atol=*/1e-6));
    }
  }
}

// Bucket layouts of the test model (reverse order: b3 w3 | w2 | b1 w1 | early_only unused):
//  - 1 byte: one bucket per param (7); all but early_only's and unused's start early.
//  - 100 bytes: [b3] [w3] [w2] [b1] [w1] [early_only unused] (a param that does not fit
//    closes the bucket; one larger than the cap gets its own); 5 of 6 start early.
//  - 1 GiB: one bucket per dtype, float64 first; only the float64 one starts early.
void CheckAllLayouts(Backend backend, comm::Store* store, int size) {
  CheckReduction(backend, store, size, 1, 7, 5);
  CheckReduction(backend, store, size, 100, 6, 5);
  CheckReduction(backend, store, size, size_t{1} << 30, 2, 1);
}

TEST_CASE("GradReducer sums gradients as Options::wire_dtype when asked", "[runtime][comm]") {
  // bf16 on the wire (allreduce_amp_master_params=False at O2): each sum is a bf16 value, within
  // bf16's precision of the exact one; the gradients keep their own dtypes.
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  for (size_t bucket_bytes : {size_t{1}, size_t{1} << 30}) {
    Ranks ranks = MakeRanks(Backend::kFake, store.get(), 2,
                            absl::StrCat("grad_reducer/wire/", bucket_bytes));
    std::vector<RankResult> results(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        results[r] = RunRank(ranks.comms[r].get(), bucket_bytes, ranks.models[r],
                             ranks.inputs[2 * r], ranks.inputs[2 * r + 1], false, at::kBFloat16);
      });
    }
    for (std::thread& t : threads) t.join();
    const std::vector<at::Tensor> want = ExpectedGrads(2);
    int inexact_in_bf16 = 0;  // of the exact sums: some are not bf16 values, or this proves nothing
    for (int r = 0; r < 2; ++r) {
      REQUIRE(results[r].created.ok());
      REQUIRE(results[r].finished.ok());
      REQUIRE(results[r].grads.size() == want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        INFO("rank " << r << " param " << i << " bucket_bytes " << bucket_bytes);
        const at::Tensor& got = results[r].grads[i];
        CHECK(got.scalar_type() == want[i].scalar_type());
        CHECK(got.to(at::kBFloat16).to(got.scalar_type()).equal(got));
        CHECK(at::allclose(got, want[i], /*rtol=*/2e-2, /*atol=*/1e-3));
        if (!want[i].to(at::kBFloat16).to(want[i].scalar_type()).equal(want[i])) {
          ++inexact_in_bf16;
        }
      }
    }
    CHECK(inexact_in_bf16 > 0);
  }
}

TEST_CASE("GradReducer sums gradients over a fake group, overlapped with backward",
          "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  SECTION("2 ranks") { CheckAllLayouts(Backend::kFake, store.get(), 2); }
  SECTION("3 ranks") { CheckAllLayouts(Backend::kFake, store.get(), 3); }
}

TEST_CASE("GradReducer sums gradients over a UCX group, overlapped with backward",
          "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  SECTION("2 ranks") { CheckAllLayouts(Backend::kUcx, store.get(), 2); }
  SECTION("3 ranks") { CheckAllLayouts(Backend::kUcx, store.get(), 3); }
}

TEST_CASE("A transient GradReducer holds its buckets only while it reduces", "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  CheckReduction(Backend::kFake, store.get(), 2, 100, 6, 5, /*transient=*/true);
  CheckReduction(Backend::kUcx, store.get(), 3, size_t{1} << 30, 2, 1, /*transient=*/true);
}

TEST_CASE("GradReducer reports a failed peer instead of hanging, then stays broken",
          "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  const std::string group = "grad_reducer/failure";
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      comm::MakeGroupConcurrently(Backend::kFake, 2, group, store.get());
  REQUIRE(comms.size() == 2);
  Model m0 = MakeModel();
  Model m1 = MakeModel();
  const at::Tensor x0 = Input(0, 1);
  const at::Tensor x1 = Input(1, 1);
  absl::Status finished;
  absl::Status again;
  // Rank 1 arms its reducer and runs the final backward, whose hooks start the buckets that are
  // complete, then dies instead of finishing; rank 0 must see the failure in Finish.
  std::thread peer([&] {
    auto reducer = GradReducer::Create(m1.params(), comms[1].get(), {1});
    if (!reducer.ok()) return;
    (*reducer)->BeginFinalBackward();
    Backward(m1, x1, 1);
    comm::FailFakeRank(group, 1);
  });
  std::thread self([&] {
    auto reducer = GradReducer::Create(m0.params(), comms[0].get(), {1});
    if (!reducer.ok()) {
      finished = reducer.status();
      return;
    }
    (*reducer)->BeginFinalBackward();
    Backward(m0, x0, 1);
    finished = (*reducer)->Finish(WaitFor);
    (*reducer)->BeginFinalBackward();
    again = (*reducer)->Finish(WaitFor);
  });
  peer.join();
  self.join();
  INFO(finished.ToString());
  CHECK(finished.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(finished.message(), "all-reducing gradient bucket"));
  CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("GradReducer gives up when the waiter does, keeping the buffer alive",
          "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      comm::MakeGroupConcurrently(Backend::kFake, 2, "grad_reducer/abandon", store.get());
  REQUIRE(comms.size() == 2);
  // Rank 1 never joins the reduction: rank 0's waiter times out at once and keeps the work.
  Model m = MakeModel();
  auto reducer = GradReducer::Create(m.params(), comms[0].get(), {1});
  REQUIRE(reducer.ok());
  (*reducer)->BeginFinalBackward();
  Backward(m, Input(0, 1), 1);
  std::vector<at::Tensor> kept;
  std::vector<std::unique_ptr<comm::Work>> abandoned;
  absl::Status s = (*reducer)->Finish(
      [&](std::unique_ptr<comm::Work> work, at::Tensor keep, const std::string& what) {
        absl::Status w = work->Wait(std::chrono::milliseconds(1));
        abandoned.push_back(std::move(work));
        kept.push_back(keep);
        return w.ok() ? w : absl::DeadlineExceededError(what);
      });
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(kept.size() == 1);
  CHECK(kept[0].defined());
  CHECK(kept[0].numel() == 3);  // bucket 0 holds b3 alone
  // The group's collectives are out of step now: the reducer refuses to go on.
  CHECK((*reducer)->Finish(WaitFor).code() == absl::StatusCode::kFailedPrecondition);
  reducer->reset();
  comms.clear();
}

TEST_CASE("GradReducer is a no-op without a group", "[runtime]") {
  Model m = MakeModel();
  auto no_comm = GradReducer::Create(m.params(), nullptr, {});
  REQUIRE(no_comm.ok());
  (*no_comm)->BeginFinalBackward();
  Backward(m, Input(0, 1), 1);
  const at::Tensor w1_grad = m.w1.grad().clone();
  int waits = 0;
  auto count = [&](std::unique_ptr<comm::Work>, at::Tensor, const std::string&) {
    ++waits;
    return absl::OkStatus();
  };
  CHECK((*no_comm)->Finish(count).ok());
  CHECK(waits == 0);
  CHECK((*no_comm)->buckets() == 0);
  CHECK(at::equal(m.w1.grad(), w1_grad));
  CHECK_FALSE(m.unused.grad().defined());  // untouched, not even zeroed

  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  std::vector<std::unique_ptr<comm::Communicator>> one =
      comm::MakeGroupConcurrently(Backend::kFake, 1, "grad_reducer/single", store.get());
  REQUIRE(one.size() == 1);
  auto single = GradReducer::Create(m.params(), one[0].get(), {});
  REQUIRE(single.ok());
  (*single)->BeginFinalBackward();
  CHECK((*single)->Finish(count).ok());
  CHECK(waits == 0);
  CHECK((*single)->buckets() == 0);
}

TEST_CASE("GradReducer::Finish needs BeginFinalBackward first", "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      comm::MakeGroupConcurrently(Backend::kFake, 2, "grad_reducer/unarmed", store.get());
  REQUIRE(comms.size() == 2);
  Model m = MakeModel();
  auto reducer = GradReducer::Create(m.params(), comms[0].get(), {});
  REQUIRE(reducer.ok());
  Backward(m, Input(0, 0), 0);  // unarmed: the hooks start nothing
  CHECK((*reducer)->Finish(WaitFor).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("GradReducer::Create rejects what it cannot reduce", "[runtime]") {
  Model m = MakeModel();
  auto code = [](std::vector<at::Tensor> params) {
    return GradReducer::Create(std::move(params), nullptr, {}).status().code();
  };
  CHECK(code({m.w1, at::Tensor()}) == absl::StatusCode::kInvalidArgument);
  CHECK(code({at::zeros({2})}) == absl::StatusCode::kInvalidArgument);    // no requires_grad
  CHECK(code({m.w1 * 2}) == absl::StatusCode::kInvalidArgument);         // not a leaf
  CHECK(code({m.w1, m.b1, m.w1}) == absl::StatusCode::kInvalidArgument);  // twice
  CHECK(code({Leaf(at::zeros({2}, at::kComplexFloat))}) == absl::StatusCode::kInvalidArgument);
  CHECK(code(m.params()) == absl::StatusCode::kOk);
}

}  // namespace
}  // namespace rannc

namespace rannc {
namespace {

// Reduce-scatter mode over the test model, with `buckets` of its params (see Model).
struct ScatterResult {
  absl::Status bound, finished;
  int early = -1;
  // Collectives this rank had issued when autograd reached the first layer (h's gradient),
  // beyond those before the armed backward.
  int64_t issued_before_first_layer = -1;
  std::vector<at::Tensor> shards;
  std::vector<bool> grads_left;  // per param: a .grad() after Finish
  int64_t bound_bytes = -1, finished_bytes = -1;
};

ScatterResult RunScatterRank(comm::Communicator* c, const std::string& group,
                             const std::vector<std::vector<int>>& buckets, const Model& m,
                             const at::Tensor& x0, const at::Tensor& x1) {
  ScatterResult result;
  GradReducer::Options options;
  options.scatter_buckets = buckets;
  absl::StatusOr<std::unique_ptr<GradReducer>> reducer =
      GradReducer::Create(m.params(), c, options);
  result.bound = reducer.status();
  if (!reducer.ok()) return result;
  result.bound = (*reducer)->BindGrads();
  if (!result.bound.ok()) return result;
  result.bound_bytes = (*reducer)->buffer_bytes();
  Backward(m, x0, 0);  // accumulates into the buckets; starts nothing
  const int64_t before = comm::FakeCollectivesIssued(group, c->rank());
  (*reducer)->BeginFinalBackward();
  // The armed backward, observed where autograd has finished layers 3 and 2 (their
  // AccumulateGrad nodes run as soon as they are ready) and starts on layer 1.
  at::Tensor h = at::tanh(x1.matmul(m.w1) + m.b1);
  h.register_hook([&](const at::Tensor& grad) {
    result.issued_before_first_layer = comm::FakeCollectivesIssued(group, c->rank()) - before;
    return grad;
  });
  at::Tensor h2 = at::relu(h.matmul(m.w2));
  at::Tensor out = h2.to(at::kDouble).matmul(m.w3) + m.b3;
  torch::autograd::backward({out.pow(2).mean()});
  result.finished = (*reducer)->Finish(WaitFor, &result.shards);
  result.finished_bytes = (*reducer)->buffer_bytes();
  result.early = (*reducer)->buckets_started_early();
  for (const at::Tensor& p : m.params()) result.grads_left.push_back(p.grad().defined());
  return result;
}

// Buckets of the test model (params: 0 unused, 1 early_only, 2 w1, 3 b1, 4 w2, 5 w3, 6 b3),
// last layer first. Bucket sizes 3 + 21, 35, 5 + 40, 4 + 4 elements: odd ones get padding.
const std::vector<std::vector<int>> kScatterBuckets = {{6, 5}, {4}, {3, 2}, {1, 0}};

void CheckScatter(Backend backend, comm::Store* store, int size) {
  const std::string group = absl::StrCat(
      "grad_reducer/scatter/", backend == Backend::kUcx ? "ucx" : "fake", "/", size);
  Ranks ranks = MakeRanks(backend, store, size, group);
  auto& comms = ranks.comms;
  auto& models = ranks.models;
  auto& inputs = ranks.inputs;
  std::vector<ScatterResult> results(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      results[r] = RunScatterRank(comms[r].get(), group, kScatterBuckets, models[r],
                                  inputs[2 * r], inputs[2 * r + 1]);
    });
  }
  for (std::thread& t : threads) t.join();

  // The expected sums, bucket by bucket, flattened and padded as the reducer lays them out.
  const std::vector<at::Tensor> want = ExpectedGrads(size);
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r << " of " << group);
    REQUIRE(results[r].bound.ok());
    INFO(results[r].finished.ToString());
    REQUIRE(results[r].finished.ok());
    REQUIRE(results[r].shards.size() == kScatterBuckets.size());
    int64_t bound_bytes = 0;
    for (size_t b = 0; b < kScatterBuckets.size(); ++b) {
      INFO("bucket " << b);
      std::vector<at::Tensor> pieces;
      for (int i : kScatterBuckets[b]) pieces.push_back(want[i].reshape(-1));
      at::Tensor flat = at::cat(pieces);
      const int64_t padded = (flat.numel() + size - 1) / size * size;
      flat = at::cat({flat, at::zeros({padded - flat.numel()}, flat.options())});
      bound_bytes += flat.nbytes();
      const int64_t chunk = padded / size;
      const at::Tensor& got = results[r].shards[b];
      REQUIRE(got.numel() == chunk);
      CHECK(got.scalar_type() == flat.scalar_type());
      CHECK(at::allclose(got, flat.narrow(0, r * chunk, chunk), /*rtol=*/1e-6, /*atol=*/1e-6));
    }
    // The buckets were the gradients from BindGrads to Finish, and only then.
    CHECK(results[r].bound_bytes == bound_bytes);
    CHECK(results[r].finished_bytes == 0);
    for (size_t i = 0; i < results[r].grads_left.size(); ++i) {
      INFO("param " << i);
      CHECK_FALSE(results[r].grads_left[i]);
    }
    // early_only and unused get no gradient in the armed backward: their bucket starts in
    // Finish, the three others during the backward.
    CHECK(results[r].early == 3);
    if (backend == Backend::kFake) {
      // Overlap: layer 3's and layer 2's buckets were issued before autograd reached layer 1.
      CHECK(results[r].issued_before_first_layer == 2);
    }
  }
}

TEST_CASE("GradReducer reduce-scatters bucket by bucket during the backward", "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  SECTION("fake, 2 ranks") { CheckScatter(Backend::kFake, store.get(), 2); }
  SECTION("fake, 3 ranks") { CheckScatter(Backend::kFake, store.get(), 3); }
  SECTION("ucx, 2 ranks") { CheckScatter(Backend::kUcx, store.get(), 2); }
  SECTION("ucx, 3 ranks") { CheckScatter(Backend::kUcx, store.get(), 3); }
}

TEST_CASE("GradReducer refuses reduce-scatter buckets that do not partition the params",
          "[runtime][comm]") {
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      comm::MakeGroupConcurrently(Backend::kFake, 1, "grad_reducer/scatter/bad", store.get());
  REQUIRE(comms.size() == 1);
  Model m = MakeModel();
  auto create = [&](std::vector<std::vector<int>> buckets, comm::Communicator* c) {
    GradReducer::Options options;
    options.scatter_buckets = std::move(buckets);
    return GradReducer::Create(m.params(), c, options).status();
  };
  const std::vector<std::pair<std::vector<std::vector<int>>, const char*>> bad = {
      {{{6, 5}, {4}, {3, 2}, {1}}, "param 0 is in no bucket"},
      {{{6, 5}, {4, 6}, {3, 2}, {1, 0}}, "param 6 is in two buckets"},
      {{{6, 5}, {4, 7}, {3, 2}, {1, 0}}, "names param 7 of 7"},
      {{{6, 4}, {5}, {3, 2}, {1, 0}}, "mixes dtypes"},
      {{{6, 5}, {}, {4, 3, 2}, {1, 0}}, "bucket 1 is empty"}};
  for (const auto& [buckets, message] : bad) {
    absl::Status s = create(buckets, comms[0].get());
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), message));
  }
  CHECK(create(kScatterBuckets, nullptr).code() == absl::StatusCode::kInvalidArgument);
  // A group of one: every shard is its whole (padding-free) bucket.
  auto reducer = [&] {
    GradReducer::Options options;
    options.scatter_buckets = kScatterBuckets;
    return GradReducer::Create(m.params(), comms[0].get(), options);
  }();
  REQUIRE(reducer.ok());
  REQUIRE((*reducer)->BindGrads().ok());
  (*reducer)->BeginFinalBackward();
  Backward(m, Input(0, 1), 1);
  const at::Tensor w2_grad = m.w2.grad().clone();
  CHECK((*reducer)->Finish(WaitFor).code() == absl::StatusCode::kInvalidArgument);
  std::vector<at::Tensor> shards;
  REQUIRE((*reducer)->Finish(WaitFor, &shards).ok());
  REQUIRE(shards.size() == 4);
  CHECK(at::equal(shards[1], w2_grad.reshape(-1)));
}

}  // namespace
}  // namespace rannc
