#include "daemon/planner/link_probe.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "absl/strings/str_cat.h"
#include "daemon/comm/store.h"
#include "daemon/common/status.h"
#include "daemon/optim/optimizer.h"
#include "daemon/runtime/host_staged_communicator.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSmallBytes = 4096;  // latency probes

// What one rank's body runs with: its communicator and a float32 tensor factory on its device.
struct Rank {
  int rank;
  comm::Communicator& comm;
  c10::Device device;
  std::chrono::milliseconds timeout;

  at::Tensor Floats(uint64_t bytes, float value) const {
    return at::full({static_cast<int64_t>(bytes / 4)}, value,
                    at::TensorOptions().dtype(at::kFloat).device(device));
  }
};

using Body = std::function<absl::Status(const Rank&)>;

// Runs `body` on one thread for each of the first `size` devices, each with its device current
// and its rank's communicator of a fresh group; the first error, if any.
absl::Status RunGroup(const CommLinkProbeOptions& o, comm::Store* store, const std::string& group,
                      int size, const Body& body) {
  std::vector<absl::Status> results(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      const c10::Device device = o.devices[r];
      results[r] = TorchCall(absl::StatusCode::kInternal, "probing the links", [&] {
        c10::OptionalDeviceGuard current;
        if (!device.is_cpu()) current.reset_device(device);
        comm::GroupOptions g{store, group, r, size, o.timeout};
        if (device.is_cuda()) g.cuda_device = device.index();
        absl::StatusOr<std::unique_ptr<comm::Communicator>> made =
            comm::MakeCommunicator(o.backend, g);
        if (!made.ok()) return made.status();
        std::unique_ptr<comm::Communicator> c = std::move(*made);
        // As the engine does: a host backend moves a CUDA buffer through host memory.
        if (device.is_cuda() && o.backend != comm::Backend::kNccl) {
          c = StageThroughHost(std::move(c));
        }
        return body(Rank{r, *c, device, o.timeout});
      });
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WaitAll(std::vector<std::unique_ptr<comm::Work>> works,
                     std::chrono::milliseconds timeout) {
  for (auto& w : works) {
    absl::Status s = w->Wait(timeout);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Seconds of the fastest of `repeats` runs of `op` after one warm-up (`check` runs after it),
// each run started right after a barrier of the group.
absl::StatusOr<double> Fastest(const Rank& r, int repeats,
                               const std::function<std::vector<std::unique_ptr<comm::Work>>()>& op,
                               const std::function<absl::Status()>& check = nullptr) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= repeats; ++i) {
    absl::Status s = r.comm.Barrier()->Wait(r.timeout);
    if (!s.ok()) return s;
    const Clock::time_point start = Clock::now();
    s = WaitAll(op(), r.timeout);
    if (!s.ok()) return s;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (i == 0) {
      if (check) {
        s = check();
        if (!s.ok()) return s;
      }
      continue;
    }
    best = std::min(best, seconds);
  }
  return best;
}

std::vector<std::unique_ptr<comm::Work>> One(std::unique_ptr<comm::Work> w) {
  std::vector<std::unique_ptr<comm::Work>> works;
  works.push_back(std::move(w));
  return works;
}

}  // namespace

absl::StatusOr<planner::Links> MeasureCommLinks(const CommLinkProbeOptions& o) {
  const int n = static_cast<int>(o.devices.size());
  if (n < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("probing links needs at least 2 devices, not ", n));
  }
  for (uint64_t bytes : {o.p2p_bytes, o.allreduce_bytes}) {
    if (bytes < kSmallBytes || bytes % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "probe sizes must be multiples of 4 bytes, at least ", kSmallBytes, ", not ", bytes));
    }
  }
  if (o.repeats < 1) return absl::InvalidArgumentError("repeats must be at least 1");
  std::unique_ptr<comm::Store> store = comm::MakeInMemoryStore();
  planner::Links links;

  // Point to point between devices 0 and 1: the receiver's time for the big transfer, the
  // sender's for the round trip.
  double p2p_s = 0, round_trip_s = 0;
  absl::Status s = RunGroup(o, store.get(), "probe/p2p", 2, [&](const Rank& r) -> absl::Status {
    at::Tensor big = r.Floats(o.p2p_bytes, static_cast<float>(r.rank));
    at::Tensor small = r.Floats(kSmallBytes, 0);
    absl::StatusOr<comm::Buffer> big_buf = BufferOf(big), small_buf = BufferOf(small);
    if (!big_buf.ok()) return big_buf.status();
    if (!small_buf.ok()) return small_buf.status();
    absl::StatusOr<double> bw = Fastest(r, o.repeats, [&] {
      return One(r.rank == 0 ? r.comm.Send(*big_buf, 1) : r.comm.Recv(*big_buf, 0));
    });
    if (!bw.ok()) return bw.status();
    absl::StatusOr<double> trip = Fastest(r, o.repeats, [&] {
      std::vector<std::unique_ptr<comm::Work>> works;
      if (r.rank == 0) {
        works.push_back(r.comm.Send(*small_buf, 1));
        works.push_back(r.comm.Recv(*small_buf, 1));
      } else {
        // The answer goes once the question is in; a failed receive shows as the sender's
        // timeout.
        if (r.comm.Recv(*small_buf, 0)->Wait(r.timeout).ok()) {
          works.push_back(r.comm.Send(*small_buf, 0));
        }
      }
      return works;
    });
    if (!trip.ok()) return trip.status();
    if (r.rank == 1) p2p_s = *bw;
    if (r.rank == 0) round_trip_s = *trip;
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  links.p2p_bytes_per_s = o.p2p_bytes / p2p_s;
  links.p2p_latency_s = round_trip_s / 2;

  // All-reduce over the first k devices: k = 2, 4, 8, ... and n.
  std::vector<int> ks;
  for (int k = 2; k < n; k *= 2) ks.push_back(k);
  ks.push_back(n);
  for (int k : ks) {
    double algbw_seconds = 0, latency = 0;
    s = RunGroup(o, store.get(), absl::StrCat("probe/allreduce", k), k,
                 [&](const Rank& r) -> absl::Status {
                   at::Tensor t = r.Floats(o.allreduce_bytes, static_cast<float>(r.rank + 1));
                   absl::StatusOr<comm::Buffer> buf = BufferOf(t);
                   if (!buf.ok()) return buf.status();
                   const float want = k * (k + 1) / 2.0f;  // exact in float32
                   absl::StatusOr<double> time = Fastest(
                       r, o.repeats, [&] { return One(r.comm.AllReduce(*buf)); },
                       [&]() -> absl::Status {
                         if (at::all(t == want).item<bool>()) return absl::OkStatus();
                         return absl::InternalError(absl::StrCat(
                             "the link probe's all-reduce over ", k, " devices summed wrong"));
                       });
                   if (!time.ok()) return time.status();
                   absl::StatusOr<double> small = absl::InternalError("unset");
                   if (k == n) {
                     at::Tensor tiny = r.Floats(kSmallBytes, 1);
                     absl::StatusOr<comm::Buffer> tiny_buf = BufferOf(tiny);
                     if (!tiny_buf.ok()) return tiny_buf.status();
                     small = Fastest(r, o.repeats, [&] { return One(r.comm.AllReduce(*tiny_buf)); });
                     if (!small.ok()) return small.status();
                   }
                   if (r.rank == 0) {
                     algbw_seconds = *time;
                     if (k == n) latency = *small;
                   }
                   return absl::OkStatus();
                 });
    if (!s.ok()) return s;
    links.allreduce_bytes_per_s[k] = o.allreduce_bytes / algbw_seconds;
    if (k == n) links.allreduce_latency_s = latency;
  }
  return links;
}

absl::StatusOr<double> MeasureHostLink(c10::Device device, uint64_t bytes, int repeats) {
  if (device.is_cpu() || bytes == 0 || repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the host link is measured for an accelerator, with bytes and repeats > 0, not ",
        device.str(), ", ", bytes, " bytes, ", repeats, " repeats"));
  }
  double up = 0, down = 0;
  absl::Status s = TorchCall(absl::StatusCode::kInternal, "probing the host link", [&] {
    const c10::DeviceGuard current(device);
    const c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream stream = impl.getStream(device);
    const auto n = static_cast<int64_t>(bytes);
    at::Tensor host = at::zeros({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    at::Tensor on_device = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device));
    // c10::Event has no host wait in every LibTorch this builds with: spun on (a copy of
    // 128 MiB takes milliseconds).
    auto await = [](const c10::Event& e) {
      while (!e.query()) std::this_thread::yield();
    };
    auto copy_seconds = [&](at::Tensor& to, const at::Tensor& from) {
      c10::Event before(device.type()), after(device.type());
      before.record(stream);
      await(before);  // nothing queued earlier is timed
      const Clock::time_point start = Clock::now();
      to.copy_(from, /*non_blocking=*/true);
      after.record(stream);
      await(after);
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    up = down = std::numeric_limits<double>::infinity();
    for (int i = 0; i <= repeats; ++i) {  // the first of each is a warm-up
      const double u = copy_seconds(on_device, host), d = copy_seconds(host, on_device);
      if (i == 0) continue;
      up = std::min(up, u);
      down = std::min(down, d);
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return static_cast<double>(bytes) / std::max(up, down);
}

absl::StatusOr<double> MeasureHostMemory(uint64_t bytes, int repeats) {
  if (bytes < 4 || repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the host's memory is measured over at least 4 bytes and 1 repeat, not ", bytes,
        " bytes, ", repeats, " repeats"));
  }
  double fastest = std::numeric_limits<double>::infinity();
  absl::Status s = TorchCall(absl::StatusCode::kInternal, "probing the host's memory", [&] {
    const auto n = static_cast<int64_t>(bytes / 4);
    at::Tensor a = at::zeros({n}, at::kFloat);  // touched: no page faults in the timed adds
    const at::Tensor b = at::ones({n}, at::kFloat);
    for (int i = 0; i <= repeats; ++i) {  // the first is a warm-up
      const Clock::time_point start = Clock::now();
      a.add_(b);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (i > 0) fastest = std::min(fastest, seconds);
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return 3.0 * static_cast<double>(bytes / 4 * 4) / fastest;
}

absl::StatusOr<double> MeasureHostStep(uint64_t bytes, int repeats, bool pinned) {
  if (bytes < 4 || repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the host's optimizer step is measured over at least 4 bytes and 1 repeat, not ", bytes,
        " bytes, ", repeats, " repeats"));
  }
  const auto n = static_cast<int64_t>(bytes / 4);
  const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat).pinned_memory(pinned);
  at::Tensor param;
  absl::Status made = TorchCall(absl::StatusCode::kInternal, "making the step's tensors", [&] {
    param = at::zeros({n}, options).requires_grad_(true);
    param.mutable_grad() = at::full({n}, 1e-3, options);
    return absl::OkStatus();
  });
  if (!made.ok()) return made;
  const HyperParams hyper = DefaultHyperParams(OptimizerKind::kAdamW);
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      MakeOptimizer(OptimizerKind::kAdamW, {ParamGroup{{param}, hyper}});
  if (!opt.ok()) return opt.status();
  double fastest = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= repeats; ++i) {  // the first makes the moments
    const Clock::time_point start = Clock::now();
    absl::Status stepped = (*opt)->Step({hyper});
    if (!stepped.ok()) return stepped;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (i > 0) fastest = std::min(fastest, seconds);
  }
  return 7.0 * static_cast<double>(n * 4) / fastest;
}

}  // namespace rannc
