// Link speeds between a daemon's devices (planner::Links), measured over the communicator its
// jobs will use: NCCL between GPUs, or a host backend (through host copies for CUDA buffers, as
// the engine does). planner/links.h measures CPU virtual devices with memcpys and a ring of
// threads, which says nothing about NVLink; a planner fed that would price an all-reduce between
// two H200s at a host copy's speed and never choose data parallelism.
//
//   CommLinkProbeOptions probe;
//   probe.backend = comm::Backend::kNccl;
//   probe.devices = {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 1)};
//   absl::StatusOr<planner::Links> links = MeasureCommLinks(probe);
//
// What it measures, each the fastest of `repeats` runs after a warm-up, with every rank's
// thread issuing the operation after a barrier and the time taken once its Work completes:
//   p2p: rank 0 sends p2p_bytes to rank 1 (bandwidth), and a 4 KiB ping-pong (half the round
//     trip is the latency);
//   all-reduce: float32 buffers of allreduce_bytes over the first k devices, for k = 2, 4, 8,
//     ... and the total (algbw = bytes / time, as planner::Links defines it; the first run's
//     sum is checked), and 4 KiB over all devices for the latency.
// Each measurement makes its own group (communicators are cheap next to the probe), so that
// the result does not depend on a group's history.
//
// Errors: INVALID_ARGUMENT for fewer than 2 devices or bad sizes; the backend's errors
// (UNIMPLEMENTED when not built in, a failed setup, DEADLINE_EXCEEDED when an operation takes
// longer than `timeout`); INTERNAL for a wrong all-reduce sum. Starts one thread per device per
// group and joins them before returning; run it while the devices are otherwise idle (at daemon
// start).
#ifndef RANNC_DAEMON_PLANNER_LINK_PROBE_H_
#define RANNC_DAEMON_PLANNER_LINK_PROBE_H_

#include <chrono>
#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "daemon/comm/factory.h"
#include "daemon/planner/cost_table.h"

namespace rannc {

struct CommLinkProbeOptions {
  comm::Backend backend = comm::Backend::kNccl;
  std::vector<c10::Device> devices;    // rank r's device; at least two
  uint64_t p2p_bytes = 64 << 20;        // both multiples of 4, at least 4 KiB
  uint64_t allreduce_bytes = 64 << 20;
  int repeats = 3;
  std::chrono::milliseconds timeout = std::chrono::seconds(30);  // per setup and operation
};

absl::StatusOr<planner::Links> MeasureCommLinks(const CommLinkProbeOptions& options);

// Bytes per second between page-locked host memory and `device` (an accelerator), the slower of
// the two directions, each the fastest of `repeats` copies of `bytes` after a warm-up:
// planner::Links::host_bytes_per_s, which offload's uploads and gradient copies run at.
// INVALID_ARGUMENT for a CPU device or a zero size; INTERNAL when LibTorch fails (no such
// device, no page-locked memory).
absl::StatusOr<double> MeasureHostLink(c10::Device device, uint64_t bytes = 128 << 20,
                                       int repeats = 3);

// Bytes per second of the host's memory as `a.add_(b)` over two fp32 tensors of `bytes` each
// moves it (2 x bytes read, bytes written), the fastest of `repeats` after a warm-up, with
// LibTorch's intra-op threads: planner::Links::host_memory_bytes_per_s, which offload's sums of
// gradients on the host run at. INVALID_ARGUMENT for a size under 4 bytes or repeats < 1.
absl::StatusOr<double> MeasureHostMemory(uint64_t bytes = 128 << 20, int repeats = 3);

// Bytes per second of the host's memory as the daemon's AdamW (optim/optimizer.h) steps one fp32
// parameter of `bytes` on the host: each step reads the parameter, its gradient and both moments
// and writes the parameter and the moments, 7 x bytes, over the seconds of the fastest of
// `repeats` steps after a first one (which makes the moments). With `pinned`, the parameter and
// its gradient are page-locked, as a CUDA device's offloaded masters and gradients are, so the
// step runs the kernel an offloaded job's runs (fused where LibTorch has one). This is
// planner::Links::host_step_bytes_per_s, which offload's optimizer steps on the host run at.
// INVALID_ARGUMENT for a size under 4 bytes or repeats < 1; INTERNAL when LibTorch or the
// optimizer fails (no page-locked memory without CUDA, say).
absl::StatusOr<double> MeasureHostStep(uint64_t bytes = 256 << 20, int repeats = 2,
                                       bool pinned = false);

}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_LINK_PROBE_H_
