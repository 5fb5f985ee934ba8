// Measures what the planner's cost model needs, on the daemon's own device type: for a range of
// atomic nodes (a block) at a per-device micro-batch size, the forward and backward time and
// the memory it uses — parameters it reads, activations kept from forward to backward, and the
// peak working memory above those — by running the block's stage graph for real with autograd.
// Blocks run in sequence, each on the previous blocks' real outputs, so every block sees the
// shapes and values it will see in training. Results are cached by (graph hash, micro-batch,
// device type, options) in a ProfileCache, which persists them across daemon runs.
//
// Memory is read from the allocator: on CPU through c10's memory reporting hook (every
// allocation and free made on the profiling thread while a block runs).
//
// Activation recomputation is derived, not run separately: a recomputed stage keeps only its
// inputs and replays its forward inside backward, so its backward time is fwd + bwd and its
// kept memory is its input boundary (see planner/cost_eval.h).
//
//   Profiler profiler(ir, tensors, example_inputs, &cache, {});
//   absl::StatusOr<std::vector<double>> node_ms = profiler.AtomicForwardMs();
//   absl::StatusOr<std::vector<ProfileRecord>> blocks = profiler.ProfileBlocks({0, 7, 19}, 8);
//
// Not thread-safe; borrows `ir` and the cache, which must outlive it. Works on copies of the
// model's tensors, so the job's parameters, gradients and buffers are never touched.
#ifndef RANNC_DAEMON_PLANNER_PROFILER_H_
#define RANNC_DAEMON_PLANNER_PROFILER_H_

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "daemon/planner/profile_cache.h"

namespace rannc {
namespace planner {

struct ProfilerOptions {
  std::string device_type = "cpu";  // cache key part: profiles of one device type only
  int warmup = 1;                   // untimed runs of a block before measuring it
  int repeats = 3;                  // timed runs at most; the median is kept
  // Timed runs stop early once they add up to this (ms): a block that takes long is measured
  // precisely enough by one run, and profiling a large model stays affordable.
  double min_time_ms = 50;
};

class Profiler {
 public:
  // `tensors`: the lifted inputs' values (IrGraph::tensor_names order). `cache` may be null.
  Profiler(const IrGraph& ir, std::vector<at::Tensor> tensors,
           std::vector<at::Tensor> example_inputs, ProfileCache* cache, ProfilerOptions options);

  // The forward time of every atomic node, alone, at the example batch size (what coarsening
  // balances). Nothing runs when every node's time is cached.
  absl::StatusOr<std::vector<double>> AtomicForwardMs();

  // Forward and backward of each block [starts[i], starts[i+1]) (the last ends at the last
  // node) at `micro_batch` samples, in sequence. Nothing runs when every block is cached.
  absl::StatusOr<std::vector<ProfileRecord>> ProfileBlocks(const std::vector<int>& starts,
                                                           int64_t micro_batch);

  int cache_hits() const { return cache_hits_; }
  int measured() const { return measured_; }

 private:
  const IrGraph& ir_;
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> example_inputs_;
  ProfileCache* cache_;
  ProfilerOptions options_;
  int cache_hits_ = 0;
  int measured_ = 0;
};

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_PROFILER_H_
