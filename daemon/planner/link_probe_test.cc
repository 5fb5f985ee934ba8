// The communicator link probe on CPU devices over the in-process backends (the same code path
// NCCL takes between GPUs): every field measured and plausible, the k it measures, the checks
// on its options.
#include "daemon/planner/link_probe.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <vector>

namespace rannc {
namespace {

CommLinkProbeOptions CpuProbe(comm::Backend backend, int devices) {
  CommLinkProbeOptions o;
  o.backend = backend;
  o.devices.assign(devices, c10::Device(c10::kCPU));
  o.p2p_bytes = 4 << 20;
  o.allreduce_bytes = 1 << 20;
  o.repeats = 2;
  return o;
}

std::vector<int> Ks(const planner::Links& links) {
  std::vector<int> ks;
  for (const auto& [k, bw] : links.allreduce_bytes_per_s) ks.push_back(k);
  return ks;
}

TEST_CASE("The link probe measures p2p and all-reduce over the jobs' communicator", "[probe]") {
  for (comm::Backend backend : {comm::Backend::kFake, comm::Backend::kUcx}) {
    for (int devices : {2, 3, 5}) {
      INFO("backend " << static_cast<int>(backend) << ", " << devices << " devices");
      absl::StatusOr<planner::Links> links = MeasureCommLinks(CpuProbe(backend, devices));
      INFO(links.status().ToString());
      REQUIRE(links.ok());
      // Between 1 MB/s and 1 TB/s, and latencies under a second: measured, not defaults.
      CHECK(links->p2p_bytes_per_s > 1e6);
      CHECK(links->p2p_bytes_per_s < 1e12);
      CHECK(links->p2p_latency_s > 0);
      CHECK(links->p2p_latency_s < 1);
      CHECK(links->p2p_latency_s != planner::Links().p2p_latency_s);
      CHECK(links->allreduce_latency_s > 0);
      CHECK(links->allreduce_latency_s < 1);
      const std::vector<int> want =
          devices == 2 ? std::vector<int>{2} : devices == 3 ? std::vector<int>{2, 3}
                                                            : std::vector<int>{2, 4, 5};
      CHECK(Ks(*links) == want);
      for (const auto& [k, bw] : links->allreduce_bytes_per_s) {
        INFO("k " << k);
        CHECK(bw > 1e6);
        CHECK(bw < 1e12);
      }
    }
  }
}

TEST_CASE("The link probe refuses what it cannot measure", "[probe]") {
  CommLinkProbeOptions one = CpuProbe(comm::Backend::kFake, 1);
  CHECK(MeasureCommLinks(one).status().code() == absl::StatusCode::kInvalidArgument);
  CommLinkProbeOptions odd = CpuProbe(comm::Backend::kFake, 2);
  odd.p2p_bytes = 4097;
  CHECK(MeasureCommLinks(odd).status().code() == absl::StatusCode::kInvalidArgument);
  CommLinkProbeOptions tiny = CpuProbe(comm::Backend::kFake, 2);
  tiny.allreduce_bytes = 64;
  CHECK(MeasureCommLinks(tiny).status().code() == absl::StatusCode::kInvalidArgument);
  CommLinkProbeOptions none = CpuProbe(comm::Backend::kFake, 2);
  none.repeats = 0;
  CHECK(MeasureCommLinks(none).status().code() == absl::StatusCode::kInvalidArgument);
  // The host link is an accelerator's (a CPU device's copies are p2p's memcpys).
  CHECK(MeasureHostLink(c10::Device(c10::kCPU)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(MeasureHostLink(c10::Device(c10::kCUDA, 0), 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(MeasureHostMemory(0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MeasureHostMemory(1 << 20, 0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MeasureHostStep(0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MeasureHostStep(1 << 20, 0).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("The host's memory is measured as an add moves it", "[probe]") {
  absl::StatusOr<double> bandwidth = MeasureHostMemory(16 << 20, 2);
  INFO(bandwidth.status().ToString());
  REQUIRE(bandwidth.ok());
  // Any machine this runs on moves more than 100 MB/s and less than 100 TB/s.
  CHECK(*bandwidth > 1e8);
  CHECK(*bandwidth < 1e14);
}

TEST_CASE("The host's optimizer step is measured as the daemon's AdamW moves memory", "[probe]") {
  absl::StatusOr<double> bandwidth = MeasureHostStep(16 << 20, 2);
  INFO(bandwidth.status().ToString());
  REQUIRE(bandwidth.ok());
  CHECK(*bandwidth > 1e8);
  CHECK(*bandwidth < 1e14);
}

}  // namespace
}  // namespace rannc
