// The communicator link probe on GPUs: two shares of GPU 0 over UCX through host memory (what
// a daemon with --devices cuda:0/2 measures), and with two GPUs or more, NCCL between them,
// which must see more than a host copy's speed. Needs a CUDA LibTorch and a GPU (tag gpu; fails,
// not skips, without).
#include "daemon/planner/link_probe.h"

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <catch2/catch.hpp>

#include "daemon/planner/links.h"

namespace rannc {
namespace {

TEST_CASE("The link probe measures GPUs over the jobs' communicator", "[gpu]") {
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(at::hasCUDA());
  const int gpus = static_cast<int>(at::getNumGPUs());
  CommLinkProbeOptions shared;
  shared.backend = comm::Backend::kUcx;
  shared.devices = {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 0)};
  absl::StatusOr<planner::Links> staged = MeasureCommLinks(shared);
  INFO(staged.status().ToString());
  REQUIRE(staged.ok());
  WARN("GPU 0 shared, UCX through host memory: " << planner::DescribeLinks(*staged));
  CHECK(staged->p2p_bytes_per_s > 1e8);
  CHECK(staged->allreduce_bytes_per_s.count(2) == 1);
  // Page-locked host memory to GPU 0 and back: PCIe or NVLink-C2C, over 1 GB/s either way.
  absl::StatusOr<double> host = MeasureHostLink(c10::Device(c10::kCUDA, 0));
  INFO(host.status().ToString());
  REQUIRE(host.ok());
  WARN("host to GPU 0: " << *host / 1e9 << " GB/s");
  CHECK(*host > 1e9);
  if (gpus < 2 || !comm::BackendBuiltIn(comm::Backend::kNccl)) return;

  CommLinkProbeOptions nccl;
  nccl.backend = comm::Backend::kNccl;
  for (int g = 0; g < gpus; ++g) nccl.devices.emplace_back(c10::kCUDA, g);
  absl::StatusOr<planner::Links> links = MeasureCommLinks(nccl);
  INFO(links.status().ToString());
  REQUIRE(links.ok());
  WARN(gpus << " GPUs over NCCL: " << planner::DescribeLinks(*links));
  // NVLink or PCIe peer copies: faster than the host-staged path between the same GPUs.
  CHECK(links->p2p_bytes_per_s > staged->p2p_bytes_per_s);
  CHECK(links->allreduce_bytes_per_s.at(2) > staged->allreduce_bytes_per_s.at(2));
}

}  // namespace
}  // namespace rannc
