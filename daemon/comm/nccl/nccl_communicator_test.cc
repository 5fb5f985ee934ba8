// Runs on CUDA machines only (tagged gpu, manual): the conformance suite over one rank per GPU
// (up to 4), with the suite's host buffers staged through device memory, and NCCL-specific
// behaviour (timeouts, destruction mid-operation, refusal of host memory).
#include "daemon/comm/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
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

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// Device memory holding a copy of a host buffer for one operation.
class Staged {
 public:
  // Runs on the suite's rank threads, where Catch2 assertions are not allowed: a failure is
  // kept in status() and reported by the Work.
  Staged(const Buffer& host, int device) : host_(host), device_(device) {
    cudaSetDevice(device_);
    cudaError_t e = cudaMalloc(&data_, std::max<size_t>(1, host.bytes()));
    // A copy on the legacy default stream, which for pageable memory may still be in flight
    // when cudaMemcpy returns: the communicator must order its stream after it
    // (nccl_communicator.h's stream rule), which the suite's values check.
    if (e == cudaSuccess && host.bytes() > 0) {
      e = cudaMemcpy(data_, host.data, host.bytes(), cudaMemcpyHostToDevice);
    }
    if (e != cudaSuccess) status_ = absl::InternalError(cudaGetErrorString(e));
  }
  ~Staged() { cudaFree(data_); }

  const absl::Status& status() const { return status_; }

  Buffer buffer() const { return {data_, host_.count, host_.dtype, DeviceKind::kCuda, device_}; }

  absl::Status CopyBack() {
    if (host_.bytes() == 0) return absl::OkStatus();
    cudaSetDevice(device_);
    const cudaError_t e = cudaMemcpy(host_.data, data_, host_.bytes(), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
    return absl::OkStatus();
  }

 private:
  Buffer host_;
  int device_;
  void* data_ = nullptr;
  absl::Status status_;
};

// Copies the outputs back to host memory once the operation completed.
class StagedWork : public Work {
 public:
  StagedWork(std::unique_ptr<Work> inner, std::vector<std::unique_ptr<Staged>> inputs,
             std::vector<std::unique_ptr<Staged>> outputs)
      : inner_(std::move(inner)), inputs_(std::move(inputs)), outputs_(std::move(outputs)) {}

  absl::Status Wait(std::chrono::milliseconds timeout) override {
    for (const auto* list : {&inputs_, &outputs_}) {
      for (const auto& staged : *list) {
        if (!staged->status().ok()) return staged->status();
      }
    }
    absl::Status s = inner_->Wait(timeout);
    if (!s.ok() || copied_) return s;
    for (auto& out : outputs_) {
      absl::Status c = out->CopyBack();
      if (!c.ok()) return c;
    }
    copied_ = true;
    return s;
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }

 private:
  std::unique_ptr<Work> inner_;
  std::vector<std::unique_ptr<Staged>> inputs_, outputs_;
  bool copied_ = false;
};

// Gives the host-memory conformance suite an NCCL communicator: each operation's buffers are
// copied to the rank's device when issued and back when waited on.
class HostStaging : public Communicator {
 public:
  HostStaging(std::unique_ptr<Communicator> inner, int device)
      : inner_(std::move(inner)), device_(device) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }

  std::unique_ptr<Work> Send(const Buffer& b, int dst, const SendOptions& o) override {
    auto in = Stage(b);
    auto w = inner_->Send(in->buffer(), dst, o);
    return Wrap(std::move(w), std::move(in), nullptr);
  }
  std::unique_ptr<Work> Recv(const Buffer& b, int src, const RecvOptions& o) override {
    auto out = Stage(b);
    auto w = inner_->Recv(out->buffer(), src, o);
    return Wrap(std::move(w), nullptr, std::move(out));
  }
  std::unique_ptr<Work> AllReduce(const Buffer& b, const AllReduceOptions& o) override {
    auto out = Stage(b);
    auto w = inner_->AllReduce(out->buffer(), o);
    return Wrap(std::move(w), nullptr, std::move(out));
  }
  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      const ReduceScatterOptions& o) override {
    auto in = Stage(input), out = Stage(output);
    auto w = inner_->ReduceScatter(in->buffer(), out->buffer(), o);
    return Wrap(std::move(w), std::move(in), std::move(out));
  }
  std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                  const AllGatherOptions& o) override {
    auto in = Stage(input), out = Stage(output);
    auto w = inner_->AllGather(in->buffer(), out->buffer(), o);
    return Wrap(std::move(w), std::move(in), std::move(out));
  }
  std::unique_ptr<Work> Broadcast(const Buffer& b, const BroadcastOptions& o) override {
    auto out = Stage(b);
    auto w = inner_->Broadcast(out->buffer(), o);
    return Wrap(std::move(w), nullptr, std::move(out));
  }
  std::unique_ptr<Work> Barrier(const BarrierOptions& o) override { return inner_->Barrier(o); }

 private:
  std::unique_ptr<Staged> Stage(const Buffer& b) { return std::make_unique<Staged>(b, device_); }
  static std::unique_ptr<Work> Wrap(std::unique_ptr<Work> w, std::unique_ptr<Staged> in,
                                    std::unique_ptr<Staged> out) {
    std::vector<std::unique_ptr<Staged>> ins, outs;
    if (in) ins.push_back(std::move(in));
    if (out) outs.push_back(std::move(out));
    return std::make_unique<StagedWork>(std::move(w), std::move(ins), std::move(outs));
  }

  std::unique_ptr<Communicator> inner_;
  int device_;
};

// Ranks 0..size-1 of `group` on GPUs 0..size-1, each made on its own thread (creation blocks
// until all ranks have come). Empty, with the failures reported, when a rank's setup fails.
Group MakeNcclGroup(Store* store, const std::string& group, int size,
                    milliseconds setup_timeout = seconds(60)) {
  std::vector<absl::Status> statuses(size);
  Group made(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GroupOptions options{store, group, r, size, setup_timeout};
      options.cuda_device = r;
      absl::StatusOr<std::unique_ptr<Communicator>> c = MakeNcclCommunicator(options);
      statuses[r] = c.status();
      if (c.ok()) made[r] = std::move(*c);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r << " of " << group << ": " << statuses[r]);
    CHECK(statuses[r].ok());
    if (!statuses[r].ok()) return {};
  }
  return made;
}

TEST_CASE("nccl: conformance suite, one rank per GPU", "[comm][gpu]") {
  const int gpus = DeviceCount();
  REQUIRE(gpus >= 1);
  std::unique_ptr<Store> store = MakeInMemoryStore();
  ConformanceOptions options;
  options.max_size = std::min(gpus, 4);
  options.matches_by_tag = false;
  RunConformanceSuite(
      [&](int size, const std::string& group) {
        Group g = MakeNcclGroup(store.get(), group, size);
        Group staged;
        for (int r = 0; r < static_cast<int>(g.size()); ++r) {
          staged.push_back(std::make_unique<HostStaging>(std::move(g[r]), r));
        }
        return staged;
      },
      options);
}

TEST_CASE("nccl: host memory and foreign devices are refused", "[comm][gpu]") {
  REQUIRE(DeviceCount() >= 1);
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeNcclGroup(store.get(), "nccl/refuse", 1);
  REQUIRE(g.size() == 1);
  float x = 1;
  absl::Status host = g[0]->AllReduce(Buffer::Of(&x, 1))->Wait(seconds(5));
  CHECK(host.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(host), Contains("host memory") && Contains("UCX"));
  Buffer other{&x, 1, DataType::kFloat32, DeviceKind::kCuda, 1};
  CHECK(g[0]->Send(other, 0)->Wait(seconds(5)).code() == absl::StatusCode::kInvalidArgument);
  CHECK(g[0]->Broadcast(Buffer::Of(&x, 1), {3})->Wait(seconds(5)).code() ==
        absl::StatusCode::kInvalidArgument);
  // The communicator still works after refused operations.
  CHECK(g[0]->Barrier()->Wait(seconds(30)).ok());
}

TEST_CASE("nccl: setup names the missing id after the timeout", "[comm][gpu]") {
  REQUIRE(DeviceCount() >= 1);
  std::unique_ptr<Store> store = MakeInMemoryStore();
  GroupOptions options{store.get(), "nccl/alone", 1, 2, milliseconds(200)};
  options.cuda_device = 0;
  absl::StatusOr<std::unique_ptr<Communicator>> c = MakeNcclCommunicator(options);
  CHECK(c.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(c.status()), Contains("rank 0 of group nccl/alone"));
  options.cuda_device = DeviceCount();
  CHECK(MakeNcclCommunicator(options).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("nccl: a wait times out until the peer issues, then completes", "[comm][gpu]") {
  if (DeviceCount() < 2) {
    WARN("needs 2 GPUs");
    return;
  }
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeNcclGroup(store.get(), "nccl/timeout", 2);
  REQUIRE(g.size() == 2);
  float a[3] = {1, 2, 3}, b[3] = {10, 20, 30};
  auto g0 = std::make_unique<HostStaging>(std::move(g[0]), 0);
  auto g1 = std::make_unique<HostStaging>(std::move(g[1]), 1);
  std::unique_ptr<Work> w0 = g0->AllReduce(Buffer::Of(a, 3), {});
  absl::Status early = w0->Wait(milliseconds(200));
  CHECK(early.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(Message(early), Contains("all_reduce of 3 float32") && Contains("nccl/timeout"));
  CHECK_FALSE(w0->IsCompleted());
  std::unique_ptr<Work> w1 = g1->AllReduce(Buffer::Of(b, 3), {});
  CHECK(w0->Wait(seconds(30)).ok());
  CHECK(w1->Wait(seconds(30)).ok());
  CHECK(a[2] == 33);
  CHECK(b[0] == 11);
}

TEST_CASE("nccl: destroying a communicator mid-operation cancels it without hanging",
          "[comm][gpu]") {
  if (DeviceCount() < 2) {
    WARN("needs 2 GPUs");
    return;
  }
  std::unique_ptr<Store> store = MakeInMemoryStore();
  Group g = MakeNcclGroup(store.get(), "nccl/abort", 2);
  REQUIRE(g.size() == 2);
  auto g0 = std::make_unique<HostStaging>(std::move(g[0]), 0);
  float x[4] = {1, 2, 3, 4};
  std::unique_ptr<Work> stuck = g0->AllReduce(Buffer::Of(x, 4), {});  // rank 1 never joins
  std::unique_ptr<Work> never_launched = g0->Send(Buffer::Of(x, 4), 1, {});
  CHECK(stuck->Wait(milliseconds(100)).code() == absl::StatusCode::kDeadlineExceeded);
  const auto start = std::chrono::steady_clock::now();
  g0.reset();  // ncclCommAbort: the stream is busy
  CHECK(std::chrono::steady_clock::now() - start < seconds(30));
  CHECK(stuck->Wait(seconds(5)).code() == absl::StatusCode::kCancelled);
  absl::Status dropped = never_launched->Wait(seconds(5));
  CHECK(dropped.code() == absl::StatusCode::kCancelled);
  CHECK_THAT(Message(dropped), Contains("never launched"));
  g[1].reset();
}

#ifdef RANNC_WITH_NCCL
TEST_CASE("nccl: the factory makes NCCL communicators in an NCCL build", "[comm][gpu]") {
  REQUIRE(DeviceCount() >= 1);
  std::unique_ptr<Store> store = MakeInMemoryStore();
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeCommunicator(Backend::kNccl, {store.get(), "nccl/factory", 0, 1});
  REQUIRE(c.ok());
  CHECK(std::string((*c)->backend()) == "nccl");
}
#endif

}  // namespace
}  // namespace comm
}  // namespace rannc
