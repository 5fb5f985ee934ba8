// Link speeds between the daemon's devices, for the planner's cost model (planner::Links in
// cost_table.h): measured once at daemon start, or fixed from a string for dry-run planning.
//
// CPU virtual devices are worker threads of one daemon sharing its address space, so a transfer
// between two of them is a memcpy and an all-reduce is a ring over their buffers. The probe runs
// exactly that: a big copy between two threads (p2p bandwidth), a 4 KiB ping-pong (p2p latency),
// and a real ring all-reduce of float32 buffers over k = 2..num_devices threads (bandwidth per k,
// plus a tiny one over all devices for the latency). When the data plane moves to UCX over
// shared memory, the probe should move with it so the planner keeps seeing what it will pay.
//
// Usage:
//   LinkProbeOptions opts;
//   opts.num_devices = 4;
//   absl::StatusOr<Links> links = MeasureCpuLinks(opts);
//   if (!links.ok()) return links.status();
//   SPDLOG_INFO("links: {}", DescribeLinks(*links));
//   // Dry run / tests: fix the links instead of measuring.
//   links = LinksFromString("p2p=10GB/s,p2p_latency=10us,allreduce=2:8GB/s;4:6GB/s");
//
// Thread-safety: all functions are free functions without shared state, safe from any thread.
// MeasureCpuLinks starts up to num_devices threads and joins them all before it returns; run it
// while the machine is otherwise idle (at daemon start), since anything else running on the
// same cores lowers the numbers it reports.
#ifndef RANNC_DAEMON_PLANNER_LINKS_H_
#define RANNC_DAEMON_PLANNER_LINKS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/planner/cost_table.h"

namespace rannc {
namespace planner {

struct LinkProbeOptions {
  // Devices of this daemon (>= 1). All-reduce is measured for k = 2..num_devices; with one
  // device there is nothing to all-reduce and allreduce_bytes_per_s stays empty (p2p is still
  // measured: it is the host's copy speed, which transfers to other daemons also pay).
  int num_devices = 1;
  // Bytes of the copy that measures p2p bandwidth. Large enough (32 MiB) to overflow the caches,
  // like the activations a stage boundary carries.
  uint64_t p2p_bytes = 32 << 20;
  // Bytes each device contributes to an all-reduce (a multiple of 4: float32 elements; the
  // remainder is ignored). Must be at least 4 * num_devices so every ring chunk is non-empty.
  uint64_t allreduce_bytes = 16 << 20;
  // Each measurement is repeated this often (>= 1) and the fastest run counts: slower runs
  // measure interference (another process, a page of the kernel's), not the link.
  int repeats = 3;
  // Seconds the whole probe should take at most, including faulting in its buffers (this VM
  // faults fresh memory at ~0.3 GB/s). The p2p numbers and the all-reduce at k = 2 and
  // k = num_devices are always measured; other k only while the estimate says they fit.
  double time_budget_s = 1.0;
};

// Measures the links between `options.num_devices` CPU virtual devices. Every all-reduce result
// is checked (the first run of every k); a wrong sum is an InternalError, since a planner fed by
// a broken reduction would be the least of the problems. Other errors: InvalidArgument for bad
// options, ResourceExhausted when the buffers cannot be allocated.
// allreduce_latency_s is the time of a 4 KiB all-reduce over all devices (left at the struct
// default with one device).
absl::StatusOr<Links> MeasureCpuLinks(const LinkProbeOptions& options);

// One line for logs and `rannc info`, 3 significant digits:
//   "p2p 5.2 GB/s (8.1 us), all-reduce 2:3.1 GB/s 4:2 GB/s (45 us), host 25 GB/s, host memory
//   60 GB/s, host step 40 GB/s" ("all-reduce none" when no k was measured; no host, host memory
//   or host step part where its bandwidth is 0).
std::string DescribeLinks(const Links& links);

// The inverse of LinksFromString: every field, in units a person reads ("p2p=5.2GB/s,..."), with
// the fewest digits that parse back to exactly the same doubles.
std::string LinksToString(const Links& links);

// Parses comma-separated `key=value` fields, any subset, in any order:
//   p2p=10GB/s,p2p_latency=10us,allreduce=2:8GB/s;4:6GB/s,allreduce_latency=20us,host=25GB/s,
//   host_memory=60GB/s,host_step=40GB/s
// Missing fields keep Links' defaults (no allreduce= means an empty all-reduce map). Bandwidths
// take B/s, KB/s, MB/s, GB/s, TB/s (powers of 1000) or KiB/s, MiB/s, GiB/s (powers of 1024) and
// must be positive; latencies take s, ms, us, ns and must be >= 0. All-reduce entries are
// `k:bandwidth` with k >= 2, separated by ';'. Blanks around tokens are ignored. An empty string
// gives the defaults. Errors (InvalidArgument) quote the offending token.
absl::StatusOr<Links> LinksFromString(const std::string& text);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_LINKS_H_
