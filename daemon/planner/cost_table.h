// The planner's view of a model: blocks in one topological order, what each costs at a given
// per-device micro-batch size, which parameters each reads, and what crosses each boundary
// between blocks. A contiguous range of blocks is convex, so any range can become a pipeline
// stage. The profiler fills a CostTable from real measurements; tests fill it by hand.
//
// Plain data with no LibTorch in it; safe to read from any thread once built.
//
//   CostTable t;
//   t.param_bytes = {4096, 64};  t.param_trainable = {true, true};
//   Block b;  b.params = {0, 1};  b.by_mb[8] = {/*fwd_ms=*/1.0, /*bwd_ms=*/2.0, 1 << 20, 1 << 18};
//   t.blocks.push_back(b);
//   t.cut_bytes_per_sample = {0};  // boundary before block 0 is unused
#ifndef RANNC_DAEMON_PLANNER_COST_TABLE_H_
#define RANNC_DAEMON_PLANNER_COST_TABLE_H_

#include <cstdint>
#include <map>
#include <vector>

namespace rannc {
namespace planner {

// One block run at one per-device micro-batch size.
struct BlockProfile {
  double fwd_ms = 0;            // forward time
  double bwd_ms = 0;            // backward time, activations kept (no recomputation)
  uint64_t act_bytes = 0;       // memory kept from forward until backward (per micro-batch)
  uint64_t peak_bytes = 0;      // transient working memory above act_bytes during fwd or bwd
};

struct Block {
  // Indices into CostTable::param_bytes of every parameter and buffer the block reads. A tensor
  // read by several blocks of one stage is held once by that stage (tied weights).
  std::vector<int> params;
  // Measured micro-batch sizes. Sizes in between are interpolated linearly; beyond the largest
  // measured size, extrapolated linearly from the two largest (or proportionally from one).
  std::map<int64_t, BlockProfile> by_mb;
  // Filled for offload only: each atomic node of the block that reads parameters or buffers,
  // in order, with what it reads (indices into CostTable::param_bytes) and the bytes per
  // sample live across the boundary just before it, where offload's runtime may start a
  // streamed block (graph/subgraph.h ParamBlockStarts). Empty: the block is taken as one such
  // node, reading `params` at its start.
  struct ParamRead {
    std::vector<int> params;
    double cut_bytes_per_sample = 0;
  };
  std::vector<ParamRead> param_reads;
};

struct CostTable {
  std::vector<Block> blocks;
  std::vector<uint64_t> param_bytes;   // per parameter or buffer tensor
  std::vector<bool> param_trainable;   // gradients and optimizer state exist only for these
  // Offload with offload_low_precision: per tensor, its bytes on the device where a streamed
  // block holds it, in the narrower dtype the forward reads it through (graph/ir.h
  // LowPrecisionRead); its gradient there is as wide, and the cast in the graph returns it
  // without a copy. Empty, or an entry equal to param_bytes': as wide as its master.
  std::vector<uint64_t> param_streamed_bytes;
  // cut_bytes_per_sample[b], b in 1..blocks.size()-1: bytes per sample of the batch values that
  // are live across the boundary between block b-1 and block b (what a stage boundary there
  // sends forward, and the size of the gradients sent back). Index 0 is unused.
  std::vector<double> cut_bytes_per_sample;
};

// Measured communication speeds of the devices (see planner/links.h).
struct Links {
  double p2p_bytes_per_s = 10e9;       // one device to another
  double p2p_latency_s = 10e-6;
  // All-reduce over k devices: time(bytes) = allreduce_latency_s + bytes / algbw, where algbw
  // is allreduce_bytes_per_s[k] (measured k; other k use the nearest measured k below, or
  // above when none is below).
  std::map<int, double> allreduce_bytes_per_s;
  double allreduce_latency_s = 20e-6;
  // Host memory to a device and back (page-locked, the slower direction): what offload's
  // uploads of parameters and downloads of gradients run at. 0: not measured, p2p's (CPU
  // devices, whose host copies are memcpys).
  double host_bytes_per_s = 0;
  // The host's memory as an in-place add of large fp32 tensors moves it (two read, one
  // written, counted): what offload's sums of streamed gradients over a step's micro-batches
  // run at, on the device's thread. 0: not measured, such sums not priced.
  double host_memory_bytes_per_s = 0;
  // The host's memory as the daemon's AdamW moves it stepping page-locked fp32 masters (the
  // parameters, gradients and both moments read, the parameters and moments written,
  // counted): what an offloaded job's optimizer step on the host runs at (link_probe.h,
  // MeasureHostStep). 0: not measured, the host's step not priced.
  double host_step_bytes_per_s = 0;
};

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_COST_TABLE_H_
