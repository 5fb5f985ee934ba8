// Measures what the planner's cost model needs, on the daemon's own device type: for a range of
// atomic nodes (a block) at a per-device micro-batch size, the forward and backward time and
// the memory it uses — parameters it reads, activations kept from forward to backward, and the
// peak working memory above those — by running the block's stage graph for real with autograd.
// Blocks run in sequence, each on the previous blocks' real outputs, so every block sees the
// shapes and values it will see in training. Results are cached by (structure, micro-batch,
// device type, options) in a ProfileCache, which persists them across daemon runs.
//
// The structure of a block is what it computes: its ops, their attributes and constants, how
// they connect (graph/structure.h), and the role, dtype and per-sample shape of each input;
// the options add the autocast (AMP) state. Value and parameter names are not part of it, so
// the layers of a deep model, which differ only in their parameters, are one structure: the
// first is measured and every other takes its record (and, to feed the blocks after it, its
// outputs, which have the same shapes). Two models built of the same layers share them too.
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

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/subgraph.h"
#include "daemon/planner/profile_cache.h"

namespace rannc {
namespace planner {

struct ProfilerOptions {
  std::string device_type = "cpu";  // cache key part: profiles of one device type only
  // Where blocks run: the model's tensors and example inputs are copied there (their graphs'
  // host constants placed there too, as a stage's), and times end when the device is done.
  c10::Device device{c10::kCPU};
  int warmup = 1;                   // untimed runs of a block before measuring it
  int repeats = 3;                  // timed runs at most; the median is kept
  // Timed runs stop early once they add up to this (ms): a block that takes long is measured
  // precisely enough by one run, and profiling a large model stays affordable.
  double min_time_ms = 50;
  // A warm-up run of a block that takes at least this long (forward and backward, ms) counts
  // as a timed run: its first-run costs are small beside it.
  double long_run_ms = 1000;
};

class Profiler {
 public:
  // `tensors`: the lifted inputs' values (IrGraph::tensor_names order). `cache` may be null.
  Profiler(const IrGraph& ir, std::vector<at::Tensor> tensors,
           std::vector<at::Tensor> example_inputs, ProfileCache* cache, ProfilerOptions options);

  // The forward time of every atomic node, alone, at the example batch size (what coarsening
  // balances). Nothing runs when every node's time is cached. Sets node_classes().
  absl::StatusOr<std::vector<double>> AtomicForwardMs();

  // After AtomicForwardMs: per atomic node, an id shared by exactly the nodes of the same
  // structure (numbered by first appearance). Repeated layers show up as repeated id runs.
  const std::vector<int>& node_classes() const { return node_classes_; }

  // Forward and backward of each block [starts[i], starts[i+1]) (the last ends at the last
  // node) at `micro_batch` samples, in sequence. Nothing runs when every block is cached.
  absl::StatusOr<std::vector<ProfileRecord>> ProfileBlocks(const std::vector<int>& starts,
                                                           int64_t micro_batch);

  // Blocks (or nodes) found in the cache, measured, and given the record of an earlier block of
  // the same structure in the same call.
  int cache_hits() const { return cache_hits_; }
  int measured() const { return measured_; }
  int shared() const { return shared_; }

 private:
  // The blocks [starts[b], starts[b+1]) (the last ends at the last node) as the profiler runs
  // them: their subgraphs on the profiling device, their structures, their cache keys at `batch`
  // samples under `options`, and the cache's records of them (none where not cached).
  struct Blocks {
    std::vector<Subgraph> subs;
    std::vector<std::string> structures;
    std::vector<ProfileKey> keys;
    std::vector<std::optional<ProfileRecord>> cached;
  };
  absl::StatusOr<Blocks> BuildBlocks(const std::vector<int>& starts, int64_t batch,
                                     const std::string& options) const;
  // The user inputs of a batch of `samples` (the example's, repeated), step inputs included,
  // on the profiled device.
  absl::StatusOr<std::vector<at::Tensor>> Batch(int64_t samples) const;

  const IrGraph& ir_;
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> example_inputs_;
  ProfileCache* cache_;
  ProfilerOptions options_;
  std::vector<int> node_classes_;
  int cache_hits_ = 0;
  int measured_ = 0;
  int shared_ = 0;
};

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_PROFILER_H_
