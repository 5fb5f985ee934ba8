#include "daemon/comm/fake/fake_communicator.h"

#include <chrono>
#include <thread>

#include <catch2/catch.hpp>

#include "daemon/comm/conformance.h"
#include "daemon/comm/factory.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace comm {
namespace {

using Catch::Contains;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Group = std::vector<std::unique_ptr<Communicator>>;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST_CASE("fake: conformance suite", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  RunConformanceSuite([&](int size, const std::string& group) {
    return MakeGroupConcurrently(Backend::kFake, size, group, store.get());
  });
}

TEST_CASE("fake: a wait times out naming the op, the group and the missing ranks", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeGroupConcurrently(Backend::kFake, 3, "fake/timeout", store.get());
  REQUIRE(g.size() == 3);

  float x = 1;
  std::unique_ptr<Work> w = g[0]->AllReduce(Buffer::Of(&x, 1));
  absl::Status s = w->Wait(milliseconds(20));
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(s), Contains("all_reduce") && Contains("fake/timeout") &&
                             Contains("ranks 1, 2 of 3 have not issued it"));
  CHECK_FALSE(w->IsCompleted());

  // The operation keeps running: once the others come, waiting again succeeds.
  float y = 2, z = 3;
  std::unique_ptr<Work> w1 = g[1]->AllReduce(Buffer::Of(&y, 1));
  absl::Status s1 = w->Wait(milliseconds(20));
  CHECK_THAT(Message(s1), Contains("rank 2 of 3 have not issued it"));
  std::unique_ptr<Work> w2 = g[2]->AllReduce(Buffer::Of(&z, 1));
  CHECK(w->Wait(seconds(10)).ok());
  CHECK(w1->Wait(seconds(10)).ok());
  CHECK(w2->Wait(seconds(10)).ok());
  CHECK(x == 6);

  // A receive names the peer that has not sent.
  std::unique_ptr<Work> r = g[1]->Recv(Buffer::Of(&x, 1), 2, {5});
  absl::Status rs = r->Wait(milliseconds(10));
  CHECK(rs.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(rs), Contains("recv from rank 2 (tag 5)") &&
                              Contains("rank 2 has not issued the matching send"));
}

TEST_CASE("fake: setup times out naming the ranks that did not join", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  GroupOptions options{store.get(), "fake/setup", 1, 3, milliseconds(20)};
  absl::StatusOr<std::unique_ptr<Communicator>> c = MakeFakeCommunicator(options);
  CHECK(c.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(c.status()), Contains("ranks 0, 2 of 3 did not join"));
}

TEST_CASE("fake: a failed rank fails pending and later waits with UNAVAILABLE", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeGroupConcurrently(Backend::kFake, 3, "fake/fail", store.get());
  REQUIRE(g.size() == 3);

  float a = 1, b = 2, c = 3;
  std::unique_ptr<Work> reduce = g[0]->AllReduce(Buffer::Of(&a, 1));
  std::unique_ptr<Work> recv = g[1]->Recv(Buffer::Of(&b, 1), 2);
  std::unique_ptr<Work> unrelated_recv = g[0]->Recv(Buffer::Of(&c, 1), 1, {3});
  absl::Status pending;
  const auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] { pending = reduce->Wait(); });  // no timeout: must not hang
  std::this_thread::sleep_for(milliseconds(10));
  FailFakeRank("fake/fail", 2);
  waiter.join();
  CHECK(std::chrono::steady_clock::now() - start < seconds(5));
  CHECK(pending.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(pending), Contains("rank 2 of group fake/fail is gone"));

  absl::Status r = recv->Wait(seconds(5));
  CHECK(r.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(r), Contains("rank 2 of group fake/fail is gone"));

  // Later operations involving rank 2 fail at once; those between live ranks still work.
  CHECK(g[0]->Send(Buffer::Of(&a, 1), 2)->Wait(seconds(5)).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(g[1]->Barrier()->Wait(seconds(5)).code() == absl::StatusCode::kUnavailable);
  float d = 42;
  CHECK(g[1]->Send(Buffer::Of(&d, 1), 0, {3})->Wait(seconds(5)).ok());
  CHECK(unrelated_recv->Wait(seconds(5)).ok());
  CHECK(c == 42);
}

TEST_CASE("fake: destroying a communicator fails its peers' waits on it", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeGroupConcurrently(Backend::kFake, 2, "fake/leave", store.get());
  REQUIRE(g.size() == 2);
  float x = 0;
  std::unique_ptr<Work> recv = g[0]->Recv(Buffer::Of(&x, 1), 1);
  g[1].reset();
  absl::Status s = recv->Wait(seconds(5));
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Message(s), Contains("rank 1 of group fake/leave is gone"));
}

TEST_CASE("fake: mismatched collectives fail on every rank", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeGroupConcurrently(Backend::kFake, 3, "fake/mismatch", store.get());
  REQUIRE(g.size() == 3);
  std::vector<float> data(8, 1);

  SECTION("different kinds") {
    std::unique_ptr<Work> w0 = g[0]->AllReduce(Buffer::Of(data.data(), 4));
    std::unique_ptr<Work> w1 = g[1]->Broadcast(Buffer::Of(data.data() + 4, 4));
    // Fails before the third rank arrives: waiting for it could take forever.
    absl::Status s0 = w0->Wait(seconds(5));
    CHECK(s0.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s0), Contains("rank 0 issued all_reduce of 4 float32 (sum)") &&
                                Contains("rank 1 issued broadcast"));
    CHECK(w1->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
    CHECK(g[2]->Barrier()->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
    // The group's next collective is unaffected.
    std::vector<std::unique_ptr<Work>> next;
    for (auto& c : g) next.push_back(c->Barrier());
    for (auto& w : next) CHECK(w->Wait(seconds(5)).ok());
  }
  SECTION("different counts, dtypes or ops") {
    float a[3] = {1, 2, 3};
    Buffer ints{data.data(), 4, DataType::kInt32};
    std::unique_ptr<Work> w0 = g[0]->AllReduce(Buffer::Of(a, 2));
    std::unique_ptr<Work> w1 = g[1]->AllReduce(Buffer::Of(a, 3));
    std::unique_ptr<Work> w2 = g[2]->AllReduce(Buffer::Of(a, 2), {ReduceOp::kMax});
    CHECK(w0->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
    CHECK(w1->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
    CHECK(w2->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
    std::unique_ptr<Work> v0 = g[0]->AllReduce(ints);
    std::unique_ptr<Work> v1 = g[1]->AllReduce(Buffer::Of(data.data(), 4));
    CHECK(v0->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("one rank's arguments are wrong") {
    std::vector<float> out(3 * 2);
    std::unique_ptr<Work> w0 = g[0]->AllGather(Buffer::Of(data.data(), 2), Buffer::Of(out.data(), 5));
    std::unique_ptr<Work> w1 =
        g[1]->AllGather(Buffer::Of(data.data(), 2), Buffer::Of(out.data(), 6));
    absl::Status s1 = w1->Wait(seconds(5));
    CHECK(s1.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s1), Contains("the output has 5 elements, expected size() * input.count"));
  }
}

TEST_CASE("fake: recv with another count or dtype than the send", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeGroupConcurrently(Backend::kFake, 2, "fake/p2p_mismatch", store.get());
  REQUIRE(g.size() == 2);
  float a[4] = {1, 2, 3, 4}, b[4] = {};
  std::unique_ptr<Work> send = g[0]->Send(Buffer::Of(a, 4), 1);
  std::unique_ptr<Work> recv = g[1]->Recv(Buffer::Of(b, 3), 0);
  absl::Status s = recv->Wait(seconds(5));
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Contains("expects 3 float32 but the matching send has 4 float32"));
  CHECK(send->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);

  Buffer ints{a, 4, DataType::kInt32};
  std::unique_ptr<Work> send2 = g[0]->Send(ints, 1);
  CHECK(g[1]->Recv(Buffer::Of(b, 4), 0)->Wait(seconds(5)).code() ==
        absl::StatusCode::kInvalidArgument);
  // Bad peers and CUDA memory are refused at once.
  CHECK(g[0]->Send(Buffer::Of(a, 4), 2)->Wait(seconds(5)).code() ==
        absl::StatusCode::kInvalidArgument);
  Buffer cuda = Buffer::Of(a, 4);
  cuda.device = DeviceKind::kCuda;
  absl::Status c = g[0]->Send(cuda, 1)->Wait(seconds(5));
  CHECK(c.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(c), Contains("host memory only"));
}

TEST_CASE("fake: a group name can be reused after the group is destroyed", "[comm]") {
  for (int attempt = 0; attempt < 3; ++attempt) {
    // A fresh store each time (the registry must have dropped the old group), and a shared one.
    std::unique_ptr<Store> fresh = MakeInMemoryStore();
    Group g = MakeGroupConcurrently(Backend::kFake, 2, "fake/reused", fresh.get());
    REQUIRE(g.size() == 2);
    float x = 1, y = 2;
    std::unique_ptr<Work> a = g[0]->AllReduce(Buffer::Of(&x, 1));
    std::unique_ptr<Work> b = g[1]->AllReduce(Buffer::Of(&y, 1));
    CHECK(a->Wait(seconds(5)).ok());
    CHECK(b->Wait(seconds(5)).ok());
    CHECK(x == 3);
  }
  std::unique_ptr<Store> shared = MakeInMemoryStore();
  for (int attempt = 0; attempt < 3; ++attempt) {
    Group g = MakeGroupConcurrently(Backend::kFake, 3, "fake/reused_shared", shared.get());
    REQUIRE(g.size() == 3);
    std::vector<std::unique_ptr<Work>> works;
    for (auto& c : g) works.push_back(c->Barrier());
    for (auto& w : works) CHECK(w->Wait(seconds(5)).ok());
  }
}

TEST_CASE("fake: two groups of the same size do not share state", "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group a = MakeGroupConcurrently(Backend::kFake, 2, "fake/a", store.get());
  Group b = MakeGroupConcurrently(Backend::kFake, 2, "fake/b", store.get());
  REQUIRE(a.size() == 2);
  REQUIRE(b.size() == 2);
  float x = 1, y = 10;
  // One rank of each group: neither completes, since they are different groups.
  std::unique_ptr<Work> wa = a[0]->AllReduce(Buffer::Of(&x, 1));
  std::unique_ptr<Work> wb = b[1]->AllReduce(Buffer::Of(&y, 1));
  CHECK(wa->Wait(milliseconds(10)).code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(wb->Wait(milliseconds(10)).code() == absl::StatusCode::kDeadlineExceeded);
  FailFakeRank("fake/a", 1);
  CHECK(wa->Wait(seconds(5)).code() == absl::StatusCode::kUnavailable);
  CHECK_FALSE(wb->IsCompleted());
}

TEST_CASE("fake: FakeCollectivesIssued counts a rank's collectives, not its transfers",
          "[comm]") {
  std::unique_ptr<Store> store = MakeInMemoryStore();
  CHECK(FakeCollectivesIssued("fake/count", 0) == 0);
  Group g = MakeGroupConcurrently(Backend::kFake, 2, "fake/count", store.get());
  REQUIRE(g.size() == 2);
  float x = 1, y = 2;
  std::unique_ptr<Work> first = g[0]->AllReduce(Buffer::Of(&x, 1));
  std::unique_ptr<Work> second = g[0]->Barrier({});
  std::unique_ptr<Work> send = g[0]->Send(Buffer::Of(&x, 1), 1, {7});
  std::unique_ptr<Work> recv = g[1]->Recv(Buffer::Of(&y, 1), 0, {7});
  CHECK(FakeCollectivesIssued("fake/count", 0) == 2);  // issued, though not yet completed
  CHECK(FakeCollectivesIssued("fake/count", 1) == 0);
  CHECK(FakeCollectivesIssued("fake/other", 0) == 0);
  CHECK(send->Wait(seconds(5)).ok());
  CHECK(recv->Wait(seconds(5)).ok());
}

}  // namespace
}  // namespace comm
}  // namespace rannc
