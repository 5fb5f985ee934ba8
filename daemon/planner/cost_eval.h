// The planner's cost model: what one pipeline stage (a contiguous range of blocks run on a
// group of data-parallel replicas) costs in time and memory, and the step time of a pipeline
// made of such stages. The search (planner/search.h) minimises Objective(); the simulator
// (planner/schedule_sim.h) checks it.
//
// Pure functions of their arguments; safe to call from any thread.
//
//   SearchOptions opt;
//   opt.batch_size = 64;  opt.num_devices = 8;  opt.device_memory_bytes = 80ull << 30;
//   StageEval s0 = EvaluateStage(table, links, opt, /*begin=*/0, /*end=*/3, /*replicas=*/4,
//                                /*stages_after=*/1, /*micro_batches=*/8);
//   StageEval s1 = EvaluateStage(table, links, opt, 3, 6, 4, 0, 8);
//   if (s0.feasible && s1.feasible) double ms = Objective({s0, s1}, 8);
#ifndef RANNC_DAEMON_PLANNER_COST_EVAL_H_
#define RANNC_DAEMON_PLANNER_COST_EVAL_H_

#include <cstdint>
#include <vector>

#include "daemon/planner/cost_table.h"

namespace rannc {
namespace planner {

// The order in which a stage runs the forwards (F) and backwards (B) of a step's micro-batches.
enum class Schedule {
  // PipeDream-flush: a few warm-up forwards, then alternate F and B. A stage holds at most
  // (stages after it + 1) micro-batches' activations.
  k1F1B,
  // All forwards, then all backwards: every stage holds all micro-batches' activations.
  kGPipe,
};

struct SearchOptions {
  int64_t batch_size = 0;              // samples per training step (global batch); required
  int num_devices = 0;                 // devices the plan may use; required
  uint64_t device_memory_bytes = 0;    // memory of one device in bytes; required
  double mem_margin = 0.1;             // fraction of device memory kept free for what the
                                       // estimate misses (allocator fragmentation, workspace)
  Schedule schedule = Schedule::k1F1B;
  // Optimizer state bytes per trainable parameter byte: SGD 0, SGD+momentum 1, Adam 2,
  // Adam with amsgrad 3. Default 2 (Adam).
  double optimizer_state_factor = 2.0;
  // ZeRO: optimizer state (and gradients between steps) sharded over the stage's replicas;
  // during a step the runtime still holds the whole local gradient, allocated before the
  // device's first backward (runtime/pipeline_engine_zero.cc). Applies to stages with more than
  // one replica (the runtime leaves a single replica unsharded).
  bool zero = false;
  // Offload (offload_params): parameters (fp32 masters), accumulated gradients and optimizer
  // state live in host memory between steps; during a step the device holds the stage's
  // parameters (all-gathered whole with zero), the step's gradients and activations, and no
  // optimizer state.
  bool offload = false;
  // Offload's streaming (runtime EngineOptions::offload_block_bytes): a stage of one replica
  // holds its trainable parameters, and their gradients, a block of at most about this many
  // bytes at a time. 0: the whole stage's during a step.
  double offload_block_bytes = 0;
  // Bytes a streamed stage moves over the host link per trainable byte, each way: 1 for fp32
  // masters uploaded as they are (Links::host_bytes_per_s prices them).
  double offload_wire_factor = 1.0;
  // Streaming with memory to spare: the stage keeps trainable parameters on the device (their
  // masters, gradients and optimizer state there) in what its estimate leaves free of the
  // limit, so that less crosses the host link and the host steps less
  // (StageEval::kept_bytes; runtime DeploymentStage::kept_on_device_bytes).
  bool offload_keep_on_device = false;
  // Streamed copies run beside the compute (GPUs: uploads and gradient copies on side
  // streams); otherwise (CPU devices) they add to it.
  bool overlap_host_copies = false;
  // Mixed precision: bytes of the low-precision weight copies autocast makes in a forward, per
  // trainable parameter byte (0 without AMP; 0.5 for bf16/fp16 copies of fp32 weights). Each
  // micro-batch's forward is its own autocast region, so every micro-batch in flight keeps its
  // own copies (saved for its backward). The profiler does not see them: it runs a block's
  // timed forwards in one autocast region, whose cache reuses the warm-up's copies.
  double amp_cast_factor = 0;
  int partition_num = 0;    // forced number of stages; 0 = search
  int pipeline_num = 0;     // forced number of micro-batches per step; 0 = search
  int replica_num = 0;      // forced replicas per stage (every stage); 0 = search
  int max_pipeline = 32;    // largest micro-batch count searched (ignored if pipeline_num set)
  bool allow_recompute = true;   // a stage that does not fit may recompute its forward
  bool use_all_devices = false;  // plans must use exactly num_devices devices
  // The gradient all-reduce runs beside the device's last backward (GPUs: NCCL on its own
  // stream, started bucket by bucket as autograd finishes them, runtime/grad_reducer.h), so a
  // step pays only what outlasts that backward, and at least the last bucket's reduction. CPU
  // devices' rings run on the cores that compute, so there they add up (false).
  bool overlap_allreduce = false;
  // The reducer's bucket size (GradReducer::Options::bucket_bytes), for the last bucket.
  double allreduce_bucket_bytes = 25 << 20;
};

struct StageEval {
  bool feasible = false;    // fits in device_memory_bytes * (1 - mem_margin) with valid sizes
  bool recompute = false;   // activations are recomputed in backward (only if needed to fit)
  int64_t micro_batch = 0;  // samples per micro-batch on one device (0 if the batch is too small)
  double fwd_ms = 0;        // per micro-batch on one device
  double bwd_ms = 0;        // per micro-batch on one device; includes the recomputed forward
  // Per micro-batch: receiving inputs and sending outputs forward, and the gradients of both
  // backward.
  double comm_ms = 0;
  double time_ms = 0;       // fwd_ms + bwd_ms + comm_ms: the stage's time per micro-batch
  // The gradient all-reduce over the replicas once per step (its part that the backward does
  // not hide, with overlap_allreduce); 0 with 1 replica.
  double allreduce_ms = 0;
  // Offload: the optimizer's step over the stage's masters on the host, once per step, less
  // what the first forward hides (Links::host_step_bytes_per_s; 0 when not measured).
  double host_step_ms = 0;
  // Streamed with offload_keep_on_device: the trainable bytes kept on the device.
  uint64_t kept_bytes = 0;
  // Offload: the blocks the estimate takes the runtime to stream the stage in (StreamedBlocksOf;
  // 1: uploaded whole, 0: not offloaded). The deployment's offload_blocks.
  int offload_blocks = 0;
  // What a step pays once on this stage's devices beside the pipeline's passes.
  double per_step_ms() const { return allreduce_ms + host_step_ms; }
  uint64_t memory_bytes = 0;     // estimated peak per device
  // The part of memory_bytes that does not grow with the micro-batch size (parameters, optimizer
  // state, gradient buffers, weight copies); the rest grows at most linearly with it, so
  // fixed + (memory - fixed) * s bounds the memory at s times this micro-batch from above for
  // s >= 1 (deployment checks at a larger batch).
  uint64_t fixed_bytes = 0;
  uint64_t param_bytes = 0;      // parameters and buffers the stage holds (tied ones once)
  uint64_t trainable_bytes = 0;  // the trainable part of param_bytes
  uint64_t act_bytes = 0;        // activations kept per micro-batch (all blocks, without recompute)
  uint64_t peak_bytes = 0;       // largest transient working memory of one block
  int inflight = 0;              // micro-batches whose activations the stage holds at once
};

// The profile of `block` at per-device micro-batch size `mb` (> 0):
//  - between two measured sizes: linear interpolation;
//  - above the largest: linear extrapolation from the two largest measured sizes (or
//    proportional to mb from the largest when only one size is measured);
//  - below the smallest: proportional scaling from the smallest (times and bytes times
//    mb/smallest), since a fixed per-call overhead cannot be told apart from one point.
// Values are clamped at 0 (extrapolating a decreasing curve). An empty profile is all zero.
BlockProfile ProfileAt(const Block& block, int64_t mb);

// Blocks [begin, end) of `table` as one stage on `replicas` devices, with `stages_after` stages
// after it in the pipeline and `micro_batches` micro-batches per step. Requires
// 0 <= begin < end <= blocks.size(), replicas >= 1, micro_batches >= 1, stages_after >= 0.
//
// Per-device micro-batch: ceil(batch_size / (micro_batches * replicas)); infeasible when
// batch_size < micro_batches * replicas.
//
// Memory per device, from what the runtime holds (runtime/pipeline_engine_step.cc RunDevice).
// Per micro-batch on one device: A the stage's profiled activations (the sum of its blocks'),
// C = G * amp_cast_factor the AMP weight copies, X = A + C, I the stage's input boundary, W_i
// block i's working memory; G the stage's trainable bytes (a step's gradients), P its params
// and buffers; k micro-batches in flight (1F1B: min(m, stages after + 1); GPipe: m) of m.
//   P + state + buckets + dynamic
// Streamed (offload, one replica, offload_block_bytes > 0): with B the larger of
// offload_block_bytes and the stage's largest block's trainable bytes (a node reading more is a
// runtime block alone) and less than G (else the stage is one block), the device holds at most
// 3B of the trainable parameters (the block computing, the next one prefetched, and the last
// one, kept from its forward to its backward) and B of gradients (a block's, until its backward
// ends): P and G below become P - G + min(G, 3B) and min(G, B), and the first backward's T
// becomes max_i X_<=i + W_i + min(G, B).
//   state    G * optimizer_state_factor, divided by the replicas with zero; 0 with offload
//   buckets  G with more than one replica and no zero: the gradient reducer's flat buffers
//            (runtime/grad_reducer.h), allocated once and kept; offloaded, allocated for the
//            device's last backward only (with m > 1: dynamic >= G + buckets + I + U below)
//   dynamic  what a step allocates and frees. Each micro-batch in flight keeps K = X + I
//            (recomputing: K = I; its backward first rebuilds X). The device's first backward
//            allocates the gradients block by block as it frees the blocks' activations, last
//            block first, so they do not peak together: while it runs block i the device holds
//            at most T_i = G_>=i + X_<=i + W_i (the gradients of parameters that block i or a
//            later one reads, the activations and copies of blocks up to i, block i's working
//            memory); after it, G.
//            One micro-batch alone peaks at U = max_i X_<=i + W_i.
//              first backward   (k - 1) K + I + max(G, max_i T_i)
//              later ones       G + (j - 1) K + I + U   (m > 1; recomputing G + j I + U),
//                               with j = k in flight if forwards follow the first backward
//                               (m > k), else k - 1
//              dynamic = the larger of the two.
//            With zero (replicas > 1) the whole flat gradient is allocated before the first
//            backward: dynamic = max(G + (k - 1) K + I + U, G + G / replicas), the latter
//            when the reduce-scatter's shard is allocated next to it.
// Recompute is used only when allowed and the stage does not fit otherwise; then
// bwd_ms += fwd_ms. Streamed, each micro-batch also moves the stage's trainable bytes (times
// offload_wire_factor) over the host link, at Links::host_bytes_per_s (p2p's when 0): up before
// its forward and again before its backward, and its gradients down. With
// overlap_host_copies, beside the compute (fwd_ms = max(fwd, up), bwd_ms = max(bwd, up, down));
// otherwise after it (fwd_ms += up, bwd_ms += up; a CPU device's gradients stay). So more
// micro-batches cost link time, and on a GPU recomputation is free while the link is the
// slower. Unstreamed offload's copies, once a step whatever the plan, are not counted.
// With offload_keep_on_device, a streamed stage that fits keeps kept_bytes of its trainable
// bytes on the device, at most all of them: each a master's and the state's there for good
// (1 + optimizer_state_factor), and a gradient's from the backward of its block to the step,
// the stage's first-read bytes (internal::KeepOnDevice: counted per block with one
// micro-batch, throughout with several): memory_bytes (and fixed_bytes) grow by that, to about
// the limit, and only the rest, G - kept_bytes, crosses the link and is stepped on the host
// below. The device's own step of the kept
// parameters (at its memory's speed) is not priced.
// Offloaded, the optimizer steps the masters on the host once a step, touching
// (3 + 2 x optimizer_state_factor) x G bytes (the masters and gradients read, the state read
// and written, the masters written; G / replicas with zero; G - kept_bytes kept) at
// Links::host_step_bytes_per_s:
// host_step_ms. Streamed, the step runs beside the next forward, each block's unit ahead of the
// block's fetch, so the first micro-batch's forward hides fwd_ms of it; otherwise it runs before
// the forward, all of it paid. An infeasible result reports the smallest memory of its options
// (recompute if allowed).
// fixed_bytes is memory_bytes less its growth per unit of micro-batch:
// (k - 1) K + I + max_i A_<=i + W_i with the activations, inputs and working memory that grow.
StageEval EvaluateStage(const CostTable& table, const Links& links,
                        const SearchOptions& options, int begin, int end, int replicas,
                        int stages_after, int micro_batches);

// All-reduce bandwidth (bytes/s) over k devices per Links: the nearest measured k below, else
// above; with nothing measured, a ring estimate p2p_bytes_per_s * k / (2 * (k - 1)).
double AllreduceBandwidth(const Links& links, int k);

// The step time in ms of a pipeline of `stages` (in order) with m = `micro_batches`:
//   (m - 1) * max_s time_ms + sum_s time_ms + max_s per_step_ms.
// The slowest stage paces the steady state; filling and draining the pipeline costs one pass
// through all stages; the all-reduces of different stages overlap each other (they use
// different devices) but not the pipeline, as they start once the stage's last backward ends;
// so do the host's optimizer steps of offloaded stages, before their first forwards.
double Objective(const std::vector<StageEval>& stages, int micro_batches);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COST_EVAL_H_
