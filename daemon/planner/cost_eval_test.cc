// Checks ProfileAt's interpolation rules and EvaluateStage's time, communication and memory
// formulas against values computed by hand.
#include "daemon/planner/cost_eval.h"

#include <catch2/catch.hpp>
#include <vector>

#include "daemon/planner/cost_eval_internal.h"
#include "daemon/planner/cost_table.h"
#include "daemon/planner/schedule_sim.h"

namespace rannc {
namespace planner {
namespace {

using Catch::Matchers::WithinRel;

Block TwoPointBlock() {
  Block b;
  b.by_mb[2] = {/*fwd*/ 2.0, /*bwd*/ 4.0, /*act*/ 200, /*peak*/ 20};
  b.by_mb[4] = {/*fwd*/ 3.0, /*bwd*/ 8.0, /*act*/ 400, /*peak*/ 40};
  return b;
}

TEST_CASE("ProfileAt returns measured sizes exactly", "[cost_eval]") {
  BlockProfile p = ProfileAt(TwoPointBlock(), 4);
  CHECK(p.fwd_ms == 3.0);
  CHECK(p.bwd_ms == 8.0);
  CHECK(p.act_bytes == 400);
  CHECK(p.peak_bytes == 40);
}

TEST_CASE("ProfileAt interpolates between measured sizes", "[cost_eval]") {
  BlockProfile p = ProfileAt(TwoPointBlock(), 3);
  CHECK_THAT(p.fwd_ms, WithinRel(2.5, 1e-12));
  CHECK_THAT(p.bwd_ms, WithinRel(6.0, 1e-12));
  CHECK(p.act_bytes == 300);
  CHECK(p.peak_bytes == 30);
}

TEST_CASE("ProfileAt extrapolates linearly from the two largest", "[cost_eval]") {
  Block b = TwoPointBlock();
  b.by_mb[1] = {100.0, 100.0, 100000, 100000};  // ignored above the largest: not one of the two
  BlockProfile p = ProfileAt(b, 8);
  CHECK_THAT(p.fwd_ms, WithinRel(5.0, 1e-12));   // 3 + (8-4) * 0.5
  CHECK_THAT(p.bwd_ms, WithinRel(16.0, 1e-12));  // 8 + (8-4) * 2
  CHECK(p.act_bytes == 800);
  CHECK(p.peak_bytes == 80);
}

TEST_CASE("ProfileAt scales proportionally below the smallest size", "[cost_eval]") {
  BlockProfile p = ProfileAt(TwoPointBlock(), 1);
  CHECK_THAT(p.fwd_ms, WithinRel(1.0, 1e-12));
  CHECK_THAT(p.bwd_ms, WithinRel(2.0, 1e-12));
  CHECK(p.act_bytes == 100);
  CHECK(p.peak_bytes == 10);
}

TEST_CASE("ProfileAt with one measured size is proportional on both sides", "[cost_eval]") {
  Block b;
  b.by_mb[4] = {4.0, 8.0, 400, 40};
  BlockProfile up = ProfileAt(b, 10);
  CHECK_THAT(up.fwd_ms, WithinRel(10.0, 1e-12));
  CHECK(up.act_bytes == 1000);
  BlockProfile down = ProfileAt(b, 2);
  CHECK_THAT(down.bwd_ms, WithinRel(4.0, 1e-12));
  CHECK(down.peak_bytes == 20);
}

TEST_CASE("ProfileAt clamps a decreasing extrapolation at zero and handles empty blocks",
          "[cost_eval]") {
  Block b;
  b.by_mb[1] = {2.0, 2.0, 200, 200};
  b.by_mb[2] = {1.0, 1.0, 100, 100};
  BlockProfile p = ProfileAt(b, 10);
  CHECK(p.fwd_ms == 0.0);
  CHECK(p.act_bytes == 0);
  BlockProfile e = ProfileAt(Block{}, 3);
  CHECK(e.fwd_ms == 0.0);
  CHECK(e.peak_bytes == 0);
}

TEST_CASE("AllreduceBandwidth uses the nearest measured k below, else above, else a ring",
          "[cost_eval]") {
  Links l;
  l.p2p_bytes_per_s = 100.0;
  CHECK_THAT(AllreduceBandwidth(l, 2), WithinRel(100.0, 1e-12));      // 100 * 2 / 2
  CHECK_THAT(AllreduceBandwidth(l, 4), WithinRel(400.0 / 6, 1e-12));  // 100 * 4 / 6
  l.allreduce_bytes_per_s = {{2, 10.0}, {4, 20.0}};
  CHECK(AllreduceBandwidth(l, 2) == 10.0);
  CHECK(AllreduceBandwidth(l, 3) == 10.0);
  CHECK(AllreduceBandwidth(l, 7) == 20.0);
  l.allreduce_bytes_per_s = {{4, 20.0}};
  CHECK(AllreduceBandwidth(l, 2) == 20.0);
}

// Three blocks; blocks 0 and 2 share param 1 (tied), param 2 is a frozen buffer.
CostTable ThreeBlocks() {
  CostTable t;
  t.param_bytes = {1000, 500, 300};
  t.param_trainable = {true, true, false};
  for (int i = 0; i < 3; ++i) {
    Block b;
    b.by_mb[4] = {/*fwd*/ 1.0 + i, /*bwd*/ 2.0 + i, /*act*/ 100u * (i + 1), /*peak*/ 50u * (i + 1)};
    t.blocks.push_back(b);
  }
  t.blocks[0].params = {0, 1};
  t.blocks[1].params = {2};
  t.blocks[2].params = {1};
  t.cut_bytes_per_sample = {0, 10, 20};
  return t;
}

Links SimpleLinks() {
  Links l;
  l.p2p_bytes_per_s = 1000.0;
  l.p2p_latency_s = 0.001;
  l.allreduce_latency_s = 0.002;
  l.allreduce_bytes_per_s = {{2, 500.0}};
  return l;
}

SearchOptions BigMemory() {
  SearchOptions o;
  o.batch_size = 16;
  o.num_devices = 4;
  o.device_memory_bytes = 1000000;
  return o;
}

TEST_CASE("EvaluateStage sums times, takes the max peak and holds tied params once",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  // batch 16, 2 micro-batches, 2 replicas: 4 samples per device.
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 3, 2, 0, 2);
  REQUIRE(e.feasible);
  CHECK(!e.recompute);
  CHECK(e.micro_batch == 4);
  CHECK_THAT(e.fwd_ms, WithinRel(6.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(9.0, 1e-12));
  CHECK(e.comm_ms == 0.0);  // the whole model: no boundaries
  CHECK_THAT(e.time_ms, WithinRel(15.0, 1e-12));
  CHECK(e.param_bytes == 1800);
  CHECK(e.trainable_bytes == 1500);
  CHECK(e.act_bytes == 600);
  CHECK(e.peak_bytes == 150);
  // 1F1B, last stage: one micro-batch in flight.
  CHECK(e.inflight == 1);
  // params 1800 + Adam state 3000 + the gradient reducer's buckets 1500 (2 replicas) + the
  // gradients of the first backward 1500, kept while the second micro-batch's activations 600
  // are built + peak 150.
  CHECK(e.memory_bytes == 1800 + 3000 + 1500 + 1500 + 600 + 150);
  // Only the activations and the peak grow with the micro-batch.
  CHECK(e.fixed_bytes == e.memory_bytes - 600 - 150);
  // 2 ms latency + 1500 B / 500 B/s.
  CHECK_THAT(e.allreduce_ms, WithinRel((0.002 + 3.0) * 1000, 1e-12));
}

TEST_CASE("With overlap_allreduce the backward hides the all-reduce but its last bucket",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.overlap_allreduce = true;
  o.allreduce_bucket_bytes = 500;
  Links fast = SimpleLinks();
  fast.allreduce_bytes_per_s = {{2, 1e6}};
  // 1500 B at 1e6 B/s + 2 ms = 3.5 ms, all under the 9 ms backward: the last bucket's 500 B
  // (2.5 ms) is what the step pays.
  StageEval hidden = EvaluateStage(t, fast, o, 0, 3, 2, 0, 2);
  REQUIRE(hidden.feasible);
  CHECK_THAT(hidden.allreduce_ms, WithinRel(2.0 + 0.5, 1e-12));
  // 3002 ms against a 9 ms backward: all but 9 ms shows.
  StageEval slow = EvaluateStage(t, SimpleLinks(), o, 0, 3, 2, 0, 2);
  CHECK_THAT(slow.allreduce_ms, WithinRel((0.002 + 3.0) * 1000 - 9.0, 1e-12));
  // Without it (CPU devices) the whole all-reduce counts.
  o.overlap_allreduce = false;
  CHECK_THAT(EvaluateStage(t, fast, o, 0, 3, 2, 0, 2).allreduce_ms, WithinRel(3.5, 1e-12));
}

TEST_CASE("EvaluateStage charges both boundaries of a middle stage", "[cost_eval]") {
  CostTable t = ThreeBlocks();
  StageEval e = EvaluateStage(t, SimpleLinks(), BigMemory(), 1, 2, 1, 1, 4);
  REQUIRE(e.feasible);
  CHECK(e.micro_batch == 4);
  // In: 10 B/sample * 4 / 1000 B/s + 1 ms, twice; out: 20 * 4 / 1000 + 1 ms, twice.
  const double expected = 2 * (0.04 + 0.001) * 1000 + 2 * (0.08 + 0.001) * 1000;
  CHECK_THAT(e.comm_ms, WithinRel(expected, 1e-12));
  CHECK_THAT(e.time_ms, WithinRel(2.0 + 3.0 + expected, 1e-12));
  CHECK(e.allreduce_ms == 0.0);
  CHECK(e.inflight == 2);  // min(4 micro-batches, 1 stage after + 1)
  // Frozen buffer only: 300 bytes, no grads or state; act 200 * 2 + peak 100 + input 40 * 2.
  CHECK(e.memory_bytes == 300 + 400 + 100 + 80);
}

TEST_CASE("EvaluateStage holds all micro-batches under GPipe", "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.schedule = Schedule::kGPipe;
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 1, 2, 1, 1, 4);
  CHECK(e.inflight == 4);
  CHECK(e.memory_bytes == 300 + 200 * 4 + 100 + 40 * 4);
}

TEST_CASE("EvaluateStage rounds the micro-batch up and rejects too small batches",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.batch_size = 10;
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 1, 3, 0, 1);
  CHECK(e.micro_batch == 4);  // ceil(10 / 3)
  CHECK(e.feasible);
  StageEval too_many = EvaluateStage(t, SimpleLinks(), o, 0, 1, 3, 0, 4);  // 12 > 10
  CHECK(!too_many.feasible);
  CHECK(too_many.micro_batch == 0);
  StageEval bad_range = EvaluateStage(t, SimpleLinks(), o, 2, 2, 1, 0, 1);
  CHECK(!bad_range.feasible);
}

TEST_CASE("EvaluateStage shards optimizer state with zero, not a step's gradients",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.zero = true;
  o.optimizer_state_factor = 1.0;
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 1, 4, 0, 1);  // 16 / 4 = 4 per device
  // params 1500 + state 1500 / 4 + the whole flat gradient 1500 and, once the backward has
  // freed the activations, the reduce-scatter's shard 1500 / 4. No reducer buckets.
  CHECK(e.memory_bytes == 1500 + 375 + 1500 + 375);
}

// Four blocks in a row, each reading its own trainable param of `grad_bytes` (block 0 also a
// frozen 100-byte buffer), profiled at 4 samples per device: `act` bytes of activations and 50
// of working memory each. Params 100 + 4 grad_bytes, activations 4 act per micro-batch.
CostTable Stack(uint64_t grad_bytes, uint64_t act) {
  CostTable t;
  for (int b = 0; b < 4; ++b) {
    t.param_bytes.push_back(grad_bytes);
    t.param_trainable.push_back(true);
    Block blk;
    blk.params = {b};
    blk.by_mb[4] = {1.0, 2.0, act, 50};
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(0);
  }
  t.param_bytes.push_back(100);
  t.param_trainable.push_back(false);
  t.blocks[0].params.push_back(4);
  return t;
}

// BigMemory with a batch of 4 samples per device per micro-batch at `micro_batches` x `replicas`.
SearchOptions Batch(int micro_batches, int replicas) {
  SearchOptions o = BigMemory();
  o.batch_size = 4 * micro_batches * replicas;
  return o;
}

TEST_CASE("A step's gradients replace its activations rather than add to them", "[cost_eval]") {
  // One replica, one micro-batch, Adam (state 2 x 1000). The backward runs block 3 first: it
  // allocates block i's gradients as it frees block i's activations, so the device holds at
  // most, at block i, the gradients of blocks i..3, the activations of blocks 0..i and block
  // i's working memory; afterwards all the gradients.
  SECTION("gradients exceed the activations") {
    // At block 0: gradients 1000 + activations 100 + working memory 50.
    StageEval e = EvaluateStage(Stack(250, 100), SimpleLinks(), Batch(1, 1), 0, 4, 1, 0, 1);
    CHECK(e.memory_bytes == 1100 + 2000 + 1000 + 100 + 50);
    // What grows with the batch: the activations up to a block and its working memory, at
    // most 400 + 50 (block 3).
    CHECK(e.fixed_bytes == e.memory_bytes - 450);
  }
  SECTION("activations exceed the gradients") {
    // At block 3: its gradients 250 + activations 3000 + working memory 50.
    StageEval e = EvaluateStage(Stack(250, 750), SimpleLinks(), Batch(1, 1), 0, 4, 1, 0, 1);
    CHECK(e.memory_bytes == 1100 + 2000 + 250 + 3000 + 50);
    CHECK(e.fixed_bytes == 1100 + 2000 + 250);
  }
}

TEST_CASE("Gradients of a device's first backward stay while its later forwards run",
          "[cost_eval]") {
  const CostTable t = Stack(250, 100);
  const SearchOptions o = Batch(4, 1);
  // 1F1B, last stage: F B F B ...: the gradients (1000) while a micro-batch runs (its
  // activations 400 and working memory 50).
  StageEval last = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 4);
  CHECK(last.inflight == 1);
  CHECK(last.memory_bytes == 1100 + 2000 + 1000 + 400 + 50);
  // Two in flight, forwards after the first backward: the gradients and two micro-batches.
  StageEval second = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 1, 4);
  CHECK(second.inflight == 2);
  CHECK(second.memory_bytes == 1100 + 2000 + 1000 + 400 + 400 + 50);
  // Every micro-batch in flight, no forward after the first backward (the first stage of four,
  // and GPipe): three micro-batches' activations and the fourth's first backward.
  StageEval first = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 3, 4);
  CHECK(first.inflight == 4);
  CHECK(first.memory_bytes == 1100 + 2000 + 3 * 400 + (1000 + 100 + 50));
  SearchOptions gpipe = o;
  gpipe.schedule = Schedule::kGPipe;
  CHECK(EvaluateStage(t, SimpleLinks(), gpipe, 0, 4, 1, 0, 4).memory_bytes == first.memory_bytes);
  // With activations larger than the gradients: at the fourth's block 3.
  StageEval big = EvaluateStage(Stack(250, 750), SimpleLinks(), gpipe, 0, 4, 1, 0, 4);
  CHECK(big.memory_bytes == 1100 + 2000 + 3 * 3000 + (250 + 3000 + 50));
}

TEST_CASE("Replicas add the gradient reducer's buckets unless zero shards the stage",
          "[cost_eval]") {
  const CostTable t = Stack(250, 100);
  SearchOptions o = Batch(1, 2);
  // Plain: params, Adam state, buckets (a flat copy of the gradients), the backward's peak.
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes ==
        1100 + 2000 + 1000 + (1000 + 100 + 50));
  o.zero = true;
  // ZeRO over 2: half the state, no buckets, but the whole flat gradient is allocated before
  // the backward starts, and the reduce-scatter's shard (500) while it is held.
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes ==
        1100 + 1000 + 1000 + 500);
  // Gradients and activations do peak together here.
  CHECK(EvaluateStage(Stack(250, 750), SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes ==
        1100 + 1000 + 1000 + 3000 + 50);
  // One replica: the runtime does not shard it, so zero changes nothing.
  SearchOptions single = Batch(1, 1);
  single.zero = true;
  CHECK(EvaluateStage(t, SimpleLinks(), single, 0, 4, 1, 0, 1).memory_bytes ==
        1100 + 2000 + (1000 + 100 + 50));
}

TEST_CASE("Offload keeps no optimizer state on the device", "[cost_eval]") {
  const CostTable t = Stack(250, 100);
  SearchOptions o = Batch(1, 1);
  o.offload = true;
  // Params uploaded for the step and the backward's peak.
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 1);
  CHECK(e.memory_bytes == 1100 + (1000 + 100 + 50));
  CHECK(e.fixed_bytes == 1100 + 700);
  o = Batch(1, 2);
  o.offload = true;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes ==
        1100 + 1000 + (1000 + 100 + 50));
  // zero + offload: the full parameters and the whole local gradient, then its shard.
  o.zero = true;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes == 1100 + 1000 + 500);
  // Offloaded, the reducer's buckets exist for the device's last backward only. Two
  // micro-batches, both in flight (first stage of two): the first backward runs without them
  // (400 + 1000 + 100 + 50), the last with them, the gradients and one micro-batch (400 + 50).
  o = Batch(2, 2);
  o.offload = true;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 1, 2).memory_bytes ==
        1100 + 1000 + 1000 + 400 + 50);
  // Where the first backward (another micro-batch's 8000 and this one's block 3) is the peak,
  // offload saves the state and the buckets.
  const CostTable big = Stack(250, 2000);
  CHECK(EvaluateStage(big, SimpleLinks(), o, 0, 4, 2, 1, 2).memory_bytes ==
        1100 + 8000 + (8000 + 250 + 50));
  o.offload = false;
  CHECK(EvaluateStage(big, SimpleLinks(), o, 0, 4, 2, 1, 2).memory_bytes ==
        1100 + 2000 + 1000 + 8000 + (8000 + 250 + 50));
}

TEST_CASE("Streamed offload holds a few blocks' parameters and one block's gradients",
          "[cost_eval]") {
  const CostTable t = Stack(250, 100);
  SearchOptions o = Batch(1, 1);
  o.offload = true;
  o.offload_block_bytes = 250;
  // The runtime's blocks are the planning blocks here (the first with the buffer: 350 bytes,
  // over the limit, as one node's reads may be). The buffer, two blocks' parameters (one
  // computing, the next prefetched), then three blocks' gradients (one block's backward, two
  // earlier ones' on their way to the host) beside the micro-batch's activations and working
  // memory: 750 + 400 + 50.
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 1);
  CHECK(e.memory_bytes == 100 + 500 + (750 + 400 + 50));
  // A limit under one block's parameters: a node's reads are never split.
  o.offload_block_bytes = 1;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 1).memory_bytes == e.memory_bytes);
  // Blocks of 500: the runtime's hold 250 (and the buffer), 500 and 250 trainable bytes; two
  // consecutive ones 750, all three 1000.
  o.offload_block_bytes = 500;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 1).memory_bytes ==
        100 + 750 + (1000 + 400 + 50));
  // A limit over the stage's parameters: uploaded at once, as without streaming.
  o.offload_block_bytes = 4000;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 1).memory_bytes ==
        1100 + (1000 + 100 + 50));
  // Replicas: not streamed.
  o = Batch(1, 2);
  o.offload = true;
  o.offload_block_bytes = 250;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 2, 0, 1).memory_bytes ==
        1100 + 1000 + (1000 + 100 + 50));
}

// One micro-batch of 4 samples on one device, offloaded and streamed in blocks of 250 bytes
// (Stack(250, ...)'s blocks), the copies beside the compute as on a GPU.
SearchOptions StreamedOnGpu() {
  SearchOptions o = Batch(1, 1);
  o.offload = true;
  o.offload_block_bytes = 250;
  o.overlap_host_copies = true;
  return o;
}

TEST_CASE("Streamed offload pays the host link per micro-batch, beside the compute on GPUs",
          "[cost_eval]") {
  // Four blocks of 250 trainable bytes, fwd 1 and bwd 2 ms each at 4 samples.
  const CostTable t = Stack(250, 100);
  SearchOptions o = StreamedOnGpu();
  Links links = SimpleLinks();
  // 1000 bytes each way at 1 MB/s: 1 ms a pass, under the compute (4 and 8 ms).
  links.host_bytes_per_s = 1e6;
  StageEval e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.fwd_ms, WithinRel(4.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(8.0, 1e-12));
  // At 100 kB/s the link paces both passes: 10 ms each.
  links.host_bytes_per_s = 1e5;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.fwd_ms, WithinRel(10.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(10.0, 1e-12));
  CHECK_THAT(e.time_ms, WithinRel(20.0, 1e-12));
  // Parameters read in bf16 stream half the bytes: 5 ms, the backward's compute paces it.
  o.offload_wire_factor = 0.5;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.fwd_ms, WithinRel(5.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(8.0, 1e-12));
  o.offload_wire_factor = 1.0;
  // On CPU devices the copies add to the compute (memcpys on the device's thread).
  o.overlap_host_copies = false;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.fwd_ms, WithinRel(4.0 + 10.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(8.0 + 10.0, 1e-12));
  o.overlap_host_copies = true;
  // Each micro-batch pays it: two micro-batches of 2 samples (fwd 2, bwd 4 ms) take twice the
  // link time one micro-batch of 4 does.
  o = Batch(2, 1);
  o.batch_size = 4;
  o.offload = true;
  o.offload_block_bytes = 250;
  o.overlap_host_copies = true;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 2);
  CHECK_THAT(e.time_ms, WithinRel(20.0, 1e-12));
  CHECK_THAT(Objective({e}, 2), WithinRel(40.0, 1e-12));
  // With the host's memory measured, the second micro-batch's gradients are added on the host
  // to the first's, on the device's thread: 3 x 1000 bytes at 100 kB/s, half of it charged to
  // each micro-batch's backward. One micro-batch has nothing to add.
  links.host_memory_bytes_per_s = 1e5;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 2);
  CHECK_THAT(e.bwd_ms, WithinRel(10.0 + 15.0, 1e-12));
  CHECK_THAT(Objective({e}, 2), WithinRel(40.0 + 30.0, 1e-12));
  CHECK_THAT(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).bwd_ms, WithinRel(10.0, 1e-12));
  links.host_memory_bytes_per_s = 0;
  // Without a measured host link, p2p's speed (1000 B/s: 1 s a pass).
  links.host_bytes_per_s = 0;
  CHECK_THAT(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).fwd_ms, WithinRel(1000.0, 1e-12));
  // Not streamed (a block over the stage): no per-micro-batch copies.
  links.host_bytes_per_s = 1e5;
  o.offload_block_bytes = 4000;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.fwd_ms, WithinRel(4.0, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(8.0, 1e-12));
}

TEST_CASE("Offload prices the optimizer's step on the host, less what the first forward hides",
          "[cost_eval]") {
  // Four blocks of 250 trainable bytes (G = 1000), fwd 1 and bwd 2 ms each at 4 samples; Adam
  // (state factor 2): a step touches 7 x 1000 bytes, 7 ms at 1 MB/s.
  const CostTable t = Stack(250, 100);
  SearchOptions o = StreamedOnGpu();
  Links links = SimpleLinks();
  links.host_bytes_per_s = 1e6;  // 1 ms a pass: the compute paces fwd (4) and bwd (8)
  // Not measured: not priced.
  StageEval e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK(e.host_step_ms == 0);
  links.host_step_bytes_per_s = 1e6;
  // Streamed: beside the forward, which hides 4 of the 7 ms.
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK_THAT(e.host_step_ms, WithinRel(3.0, 1e-12));
  CHECK_THAT(e.time_ms, WithinRel(12.0, 1e-12));  // the passes themselves unchanged
  CHECK_THAT(Objective({e}, 1), WithinRel(15.0, 1e-12));
  CHECK_THAT(SimulateStep({e}, 1, o.schedule), WithinRel(15.0, 1e-12));
  // Once a step, whatever the micro-batches: the first of two of 2 samples (fwd 2, bwd 4 ms)
  // hides 2 ms.
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 2);
  CHECK_THAT(e.host_step_ms, WithinRel(5.0, 1e-12));
  CHECK_THAT(Objective({e}, 2), WithinRel(2 * 6.0 + 5.0, 1e-12));
  // A forward longer than the step hides all of it.
  links.host_step_bytes_per_s = 7e6;  // 1 ms
  CHECK(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).host_step_ms == 0);
  links.host_step_bytes_per_s = 1e6;
  // SGD without momentum (no state) touches 3 x 1000 bytes: 3 ms, under the forward.
  o.optimizer_state_factor = 0;
  CHECK(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).host_step_ms == 0);
  o.optimizer_state_factor = 2;
  // Not streamed (one block over the stage): the step runs before the forward, all paid.
  o.offload_block_bytes = 4000;
  CHECK_THAT(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).host_step_ms, WithinRel(7.0, 1e-12));
  // With zero over two replicas each steps its half of the masters (4 samples each).
  o = Batch(1, 2);
  o.offload = true;
  o.zero = true;
  CHECK_THAT(EvaluateStage(t, links, o, 0, 4, 2, 0, 1).host_step_ms, WithinRel(3.5, 1e-12));
  // Without offload the step is the device's: not priced here.
  o.offload = false;
  CHECK(EvaluateStage(t, links, o, 0, 4, 2, 0, 1).host_step_ms == 0);
}

TEST_CASE("A streamed stage keeps on the device what its memory leaves room for",
          "[cost_eval]") {
  // Four blocks of 250 trainable bytes (G = 1000), fwd 1 and bwd 2 ms each, activations 100
  // and working memory 50 each at 4 samples; streamed, the device holds 1800 bytes (the first
  // case above), 450 of them the last block's backward's activations (X_<=3 + W_3). Adam: a
  // kept byte's master and moments cost 3 on the device for good, its gradient one more from
  // its block's backward to the step. 1000 bytes cross the link in 10 ms a pass; a host step
  // touches 7 bytes a streamed byte at 500 kB/s.
  const CostTable t = Stack(250, 100);
  SearchOptions o = StreamedOnGpu();
  o.mem_margin = 0;
  o.device_memory_bytes = 1800 + 1200;
  Links links = SimpleLinks();
  links.host_bytes_per_s = 1e5;
  links.host_step_bytes_per_s = 5e5;
  // Not asked: everything streams, the link paces both passes and the step outlasts the
  // forward by 4 ms (14 - 10).
  StageEval e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK(e.kept_bytes == 0);
  CHECK(e.memory_bytes == 1800);
  CHECK_THAT(e.fwd_ms, WithinRel(10.0, 1e-12));
  CHECK_THAT(e.host_step_ms, WithinRel(4.0, 1e-12));
  // Asked, with 1200 bytes free: the kept parameters are the first blocks', whose gradients
  // appear last in the backward, when only the first blocks' activations are left. Block 0's
  // backward (150 of activations, 300 fewer than the last's) holds every kept gradient:
  // 1500 + 4 k <= 3000 keeps k = 375 (counting every gradient throughout, 300). 625 bytes
  // stream (6.25 ms a pass, under the backward's 8) and the host steps 4375 bytes (8.75 ms,
  // 2.5 past the forward).
  o.offload_keep_on_device = true;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK(e.feasible);
  CHECK(e.kept_bytes == 375);
  CHECK(e.memory_bytes == 1800 + 1200);
  CHECK(e.fixed_bytes - EvaluateStage(t, links, StreamedOnGpu(), 0, 4, 1, 0, 1).fixed_bytes ==
        1200);
  CHECK_THAT(e.fwd_ms, WithinRel(6.25, 1e-12));
  CHECK_THAT(e.bwd_ms, WithinRel(8.0, 1e-12));
  CHECK_THAT(e.host_step_ms, WithinRel(2.5, 1e-12));
  // Two micro-batches (one in flight, the same 1800 without keeping): the first one's
  // gradients are there all through the second, so each kept byte counts 4 throughout: 300.
  o.batch_size = 8;
  CHECK(EvaluateStage(t, links, o, 0, 4, 1, 0, 2).kept_bytes == 300);
  o.batch_size = 4;
  // SGD without momentum: a master a byte for good, and its gradient from its backward on.
  // Streaming, block 0's backward would keep 750 (1500 + 2 k <= 3000; counted throughout,
  // 600), but with all 1000 kept nothing streams: no blocks' parameters nor three blocks'
  // gradients (750 less, two blocks' gradients' copies still counted), and every block's
  // backward has room (block 0's the most, 1500 - 750 + 2000).
  o.optimizer_state_factor = 0;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK(e.kept_bytes == 1000);
  CHECK(e.memory_bytes == 1500 - 750 + 2000);
  o.optimizer_state_factor = 2;
  // Room for more than the stage: all of it kept, nothing crosses the link or steps on the
  // host, and the compute paces the passes. The peak is block 0's backward: 1500 less the 750
  // of streaming + 3000 of masters and moments + the 1000 of gradients.
  o.device_memory_bytes = 1000000;
  e = EvaluateStage(t, links, o, 0, 4, 1, 0, 1);
  CHECK(e.kept_bytes == 1000);
  CHECK(e.memory_bytes == 1500 - 750 + 3000 + 1000);
  CHECK_THAT(e.fwd_ms, WithinRel(4.0, 1e-12));
  CHECK(e.host_step_ms == 0);
  // A parameter another stage reads too is never kept (the runtime steps it on the host):
  // with block 3 reading block 0's, the stage of blocks 0-2 keeps blocks 1 and 2's only.
  CostTable shared = t;
  shared.blocks[3].params.push_back(0);
  CHECK(EvaluateStage(shared, links, o, 0, 3, 1, 1, 1).kept_bytes == 500);
  CHECK(EvaluateStage(shared, links, o, 0, 4, 1, 0, 1).kept_bytes == 1000);
  // No room, or not streamed (one block over the stage, or replicas): nothing kept.
  o.device_memory_bytes = 1800;
  CHECK(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).kept_bytes == 0);
  o.device_memory_bytes = 1000000;
  o.offload_block_bytes = 4000;
  CHECK(EvaluateStage(t, links, o, 0, 4, 1, 0, 1).kept_bytes == 0);
  o.offload_block_bytes = 250;
  o.batch_size = 8;
  CHECK(EvaluateStage(t, links, o, 0, 4, 2, 0, 1).kept_bytes == 0);
}

TEST_CASE("Kept gradients count from their last reader's backward", "[cost_eval]") {
  using internal::BlockBackward;
  using internal::KeepOnDevice;
  // Three blocks of 100 trainable bytes, each read by its block only; the device holds
  // 1000 + act_i while the backward runs block i (act 100, 200 and 500), and may hold 2000.
  // Adam (state factor 2): a kept byte's master and moments cost 3 for good.
  std::vector<BlockBackward> blocks = {{100, 0, 0}, {200, 100, 100}, {500, 200, 200}};
  // Block 0's backward holds every kept gradient (1100 + 4k <= 2000: 225), block 1's those
  // above the first 100 (1200 + 3k + k - 100: 225), block 2's none up to 200 (1500 + 3k: 166).
  internal::KeptTerms kept = KeepOnDevice(blocks, 500, 1500, 300, 2000, 2);
  CHECK(kept.bytes == 166);
  CHECK(kept.memory == 1500 + 3 * 166);  // block 2's backward
  // Block 0's parameter read last by block 2 (as a one-stage GPT's embedding and output layer
  // share one): its gradient is there from block 2's backward on, 1500 + 3k + min(k, 100):
  // 133.
  blocks = {{100, 0, 0}, {200, 100, 0}, {500, 200, 100}};
  kept = KeepOnDevice(blocks, 500, 1500, 300, 2000, 2);
  CHECK(kept.bytes == 133);
  CHECK(kept.memory == 1500 + 3 * 133 + 100);
  // No blocks: every gradient throughout, (2000 - 1500) / 4.
  kept = KeepOnDevice({}, 500, 1500, 300, 2000, 2);
  CHECK(kept.bytes == 125);
  CHECK(kept.memory == 1500 + 4 * 125);
  // No room: nothing.
  kept = KeepOnDevice(blocks, 500, 2000, 300, 2000, 2);
  CHECK(kept.bytes == 0);
  CHECK(kept.memory == 2000);
  // At most the trainable bytes.
  kept = KeepOnDevice(blocks, 500, 1500, 50, 100000, 2);
  CHECK(kept.bytes == 50);
}

TEST_CASE("A kept block's backward holds nothing of streaming", "[cost_eval]") {
  using internal::BlockBackward;
  using internal::KeepOnDevice;
  // Four blocks of 100 trainable bytes, each read by its block only (runtime blocks of at
  // most 100); the device holds 1200 + act_i while the backward runs block i (act 100, 150,
  // 200 and 300), and may hold 2500. Adam: 3 a kept byte for good, and its gradient from its
  // block's backward on, so block i's backward holds 1200 + act_i + 3k + max(0, k - 100 i).
  std::vector<BlockBackward> blocks = {
      {100, 0, 0, 100}, {150, 100, 100, 200}, {200, 200, 200, 300}, {300, 300, 300, 400}};
  // Streaming counted everywhere, block 0's backward binds: 1300 + 4k <= 2500, 300.
  internal::KeptTerms kept = KeepOnDevice(blocks, 300, 1500, 400, 2500, 2);
  CHECK(kept.bytes == 300);
  CHECK(kept.memory == 2500);
  // 300 of it not held where a block's runtime block is kept, which k reaches from the bytes
  // read first through the block plus one runtime block's (200, 300, 400 and 400, all of
  // it): blocks 0 and 1 then have room for up to 375 and 387, but block 2's backward, still
  // streaming, binds at 325 (1400 + 3k + k - 200 <= 2500), as does block 3's.
  kept = KeepOnDevice(blocks, 300, 1500, 400, 2500, 2, 300, 100);
  CHECK(kept.bytes == 325);
  CHECK(kept.memory == 2500);
  // Nothing streams with all of it kept: 2600 keeps 400 (block 0's backward 1000 + 1600),
  // where streaming counted throughout keeps 325.
  CHECK(KeepOnDevice(blocks, 300, 1500, 400, 2600, 2).bytes == 325);
  kept = KeepOnDevice(blocks, 300, 1500, 400, 2600, 2, 300, 100);
  CHECK(kept.bytes == 400);
  CHECK(kept.memory == 2600);
  // One byte less: all of it no longer fits, and below it block 2's backward streams, which
  // has room for 349 (1400 + 4k - 200 <= 2599).
  kept = KeepOnDevice(blocks, 300, 1500, 400, 2599, 2, 300, 100);
  CHECK(kept.bytes == 349);
  // Where no block's runtime block turns kept (runtime blocks as large as the stage), the
  // streaming term changes nothing but the forward's bound.
  CHECK(KeepOnDevice(blocks, 300, 1500, 400, 2500, 2, 300, 1000).bytes == 300);
}

// Eight blocks of 250 trainable bytes, activations 1000 and working memory 50 each at 4
// samples, a cut of 5 bytes a sample between any two.
CostTable EightBlocks() {
  CostTable t;
  for (int b = 0; b < 8; ++b) {
    t.param_bytes.push_back(250);
    t.param_trainable.push_back(true);
    Block blk;
    blk.params = {b};
    blk.by_mb[4] = {1.0, 2.0, 1000, 50};
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(b == 0 ? 0 : 5);
  }
  return t;
}

TEST_CASE("A streamed stage recomputes block by block, keeping each block's input",
          "[cost_eval]") {
  CostTable t = EightBlocks();
  SearchOptions o = StreamedOnGpu();
  o.mem_margin = 0;
  Links links = SimpleLinks();
  links.host_bytes_per_s = 1e12;  // the copies hide behind the compute
  // Kept whole: two blocks' parameters, the eight blocks' activations with the last one's
  // working memory, and three blocks' gradients.
  const uint64_t keep_all = 500 + (8000 + 50 + 750);
  // Recomputed by blocks: the inputs of the runtime's blocks after the first (7 x 20 bytes;
  // they are the planning blocks here), one block's activations rerun at a time (a window of
  // 250 parameter bytes), and three blocks' gradients.
  const uint64_t blocked = 500 + 7 * 20 + (1000 + 50) + 750;
  o.device_memory_bytes = keep_all;
  StageEval e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.feasible);
  CHECK(!e.recompute);
  CHECK(e.memory_bytes == keep_all);
  o.device_memory_bytes = blocked;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.feasible);
  CHECK(e.recompute);
  CHECK(e.memory_bytes == blocked);
  CHECK_THAT(e.bwd_ms, WithinRel(16.0 + 8.0, 1e-12));  // each block's forward again
  // GPipe's two micro-batches in flight keep their blocks' inputs both.
  o.schedule = Schedule::kGPipe;
  o.batch_size = 8;
  o.device_memory_bytes = 1000000;
  // (kept whole, the first micro-batch's activations stay while the second runs)
  CHECK(EvaluateStage(t, links, o, 0, 8, 1, 0, 2).memory_bytes == keep_all + 8000);
  o.device_memory_bytes = blocked + 7 * 20;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 2);
  CHECK(e.recompute);
  CHECK(e.memory_bytes == blocked + 7 * 20);
  // Blocks of 500 bytes: four runtime blocks of two planning blocks each, rerun one at a time;
  // three inputs kept.
  o = Batch(1, 1);
  o.offload = true;
  o.offload_block_bytes = 500;
  o.mem_margin = 0;
  o.device_memory_bytes = 6000;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.recompute);
  CHECK(e.memory_bytes == 1000 + 3 * 20 + (2000 + 50) + 1500);
  // Kept parameters, recomputed by blocks of 250: with the first three blocks' activations
  // 100, blocks 0-2 rerun 150 and the later ones 1050 (the 2440 of the device's peak). 1200
  // bytes free keep 400, not 300: the kept parameters are the first blocks', whose gradients
  // appear from block 1's backward on (block 3's: 2440 + 3k for k <= 750), when the later
  // windows are done.
  for (int b = 0; b < 3; ++b) t.blocks[b].by_mb[4].act_bytes = 100;
  o.offload_block_bytes = 250;
  o.overlap_host_copies = true;
  o.offload_keep_on_device = true;
  o.device_memory_bytes = 2440 + 1200;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.recompute);
  CHECK(e.kept_bytes == 400);
  CHECK(e.memory_bytes == 2440 + 1200);
  // Just short of fitting without recomputation (6600): block 3's backward, streaming, has
  // room for 1227 (2440 + 3k + k - 750 <= 6599), but from 1250 on its runtime block is kept
  // and holds three blocks' gradients (750) less, room up to 1414; block 4's, streaming up to
  // 1500, binds at 1289 (2440 + 3k + k - 1000 <= 6599).
  o.device_memory_bytes = 6599;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.recompute);
  CHECK(e.kept_bytes == 1289);
  CHECK(e.memory_bytes == 2440 + 3 * 1289 + 289);
}

TEST_CASE("Streamed blocks are the runtime's: whole nodes' reads, cut before a node",
          "[cost_eval]") {
  using internal::StreamedBlocksOf;
  using internal::StreamedRecompute;
  // Two planning blocks, each two nodes reading 300 and 200 trainable bytes; the cut before
  // a block's first node is 5 bytes a sample, before its second 9.
  CostTable t;
  for (int b = 0; b < 2; ++b) {
    Block blk;
    for (int r = 0; r < 2; ++r) {
      const int p = static_cast<int>(t.param_bytes.size());
      t.param_bytes.push_back(r == 0 ? 300 : 200);
      t.param_trainable.push_back(true);
      blk.params.push_back(p);
      blk.param_reads.push_back({{p}, r == 0 ? 5.0 : 9.0});
    }
    blk.by_mb[4] = {1.0, 2.0, 1000, 50};
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(b == 0 ? 0 : 5);
  }
  // Blocks of 500: one per planning block, the second's input cut before its first node.
  internal::StreamedBlocks blocks = StreamedBlocksOf(t, 0, 2, 500);
  CHECK(blocks.count == 2);
  CHECK(blocks.largest == 500);
  CHECK(blocks.largest_pair == 1000);
  CHECK(blocks.inputs_per_sample == 5);
  // Blocks of 400: each node alone, 300 | 200 | 300 | 200 (two consecutive 500, three 800),
  // their inputs cut before the second node, the third and the fourth: 9 + 5 + 9.
  blocks = StreamedBlocksOf(t, 0, 2, 400);
  CHECK(blocks.count == 4);
  CHECK(blocks.largest == 300);
  CHECK(blocks.largest_pair == 500);
  CHECK(blocks.largest_triple == 800);
  CHECK(blocks.inputs_per_sample == 23);
  // Without the nodes' reads, a planning block is one read at its start.
  CostTable coarse = t;
  for (Block& blk : coarse.blocks) blk.param_reads.clear();
  blocks = StreamedBlocksOf(coarse, 0, 2, 400);
  CHECK(blocks.count == 2);
  CHECK(blocks.inputs_per_sample == 5);
  // A window of 300 parameter bytes reruns 300 / 500 of a planning block's activations, with
  // its working memory; of 750, one block whole and half the other.
  internal::StreamedRecomputeTerms terms = StreamedRecompute(t, 0, 0, 2, 4, 300, 23);
  CHECK(terms.act_peak == 600 + 50);
  CHECK(terms.kept == 23 * 4);
  terms = StreamedRecompute(t, 0, 0, 2, 4, 750, 0);
  CHECK(terms.act_peak == 1500 + 50);
  // A planning block without parameters (an attention's core, a loss) counts whole where the
  // window reaches it.
  t.blocks.insert(t.blocks.begin() + 1, Block{});
  t.blocks[1].by_mb[4] = {1.0, 2.0, 700, 60};
  t.cut_bytes_per_sample.push_back(5);
  terms = StreamedRecompute(t, 0, 0, 3, 4, 500, 0);
  CHECK(terms.act_peak == 1000 + 700 + 60);
}

TEST_CASE("A streamed stage holds a tensor that several blocks read the whole step",
          "[cost_eval]") {
  // A tied embedding: tensor 6 (200 bytes) read by the first block and the last; blocks 1-6
  // read 250 bytes each, tensors 0-5. The runtime streams the six (one runtime block each) and
  // uploads the tied tensor whole (SetUpStreaming).
  CostTable t;
  t.param_bytes = {250, 250, 250, 250, 250, 250, 200};
  t.param_trainable.assign(7, true);
  for (int b = 0; b < 8; ++b) {
    Block blk;
    blk.params = {b == 0 || b == 7 ? 6 : b - 1};
    blk.by_mb[4] = {1.0, 2.0, 1000, 50};
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(b == 0 ? 0 : 5);
  }
  internal::StreamedBlocks blocks = internal::StreamedBlocksOf(t, 0, 8, 250);
  CHECK(blocks.count == 8);
  CHECK(blocks.largest == 250);
  CHECK(blocks.largest_pair == 500);  // the tied tensor in none of them
  CHECK(blocks.largest_triple == 750);
  CHECK(blocks.resident == 200);
  CHECK(blocks.not_streamed == std::vector<bool>{false, false, false, false, false, false, true});
  // A stage without the first block: the tied tensor is another stage's too.
  blocks = internal::StreamedBlocksOf(t, 1, 8, 250);
  CHECK(blocks.count == 7);
  CHECK(blocks.resident == 200);
  CHECK(blocks.largest_triple == 750);
  // Whole: two blocks' parameters and three blocks' gradients streamed, the tied tensor and
  // its gradient throughout, with the activations and the last block's working memory.
  SearchOptions o = StreamedOnGpu();
  o.mem_margin = 0;
  Links links = SimpleLinks();
  links.host_bytes_per_s = 1e12;
  const uint64_t whole = (200 + 500) + (8000 + 50) + (200 + 750);
  o.device_memory_bytes = whole;
  StageEval e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(!e.recompute);
  CHECK(e.memory_bytes == whole);
  o.device_memory_bytes = whole - 1;
  CHECK(EvaluateStage(t, links, o, 0, 8, 1, 0, 1).recompute);
  // Read in a narrower dtype, a streamed tensor's copy is not made; the tied tensor's is
  // (uploaded whole in its masters' dtype, read through a cast). A window of 250 bytes from
  // the first block: its 1000 bytes, a fifth of the next block's 875 without its copy, and
  // the working memory.
  t.param_streamed_bytes = {125, 125, 125, 125, 125, 125, 100};
  blocks = internal::StreamedBlocksOf(t, 0, 8, 250);
  CHECK(internal::StreamedRecompute(t, 0, 0, 8, 4, 250, 0, blocks.not_streamed).act_peak ==
        1000 + 175 + 50);
  CHECK(internal::StreamedRecompute(t, 0, 0, 8, 4, 250, 0).act_peak == 900 + 175 + 50);
}

TEST_CASE("Streamed parameters held in their read dtype count at its width, without copies",
          "[cost_eval]") {
  // offload_low_precision: EightBlocks' parameters read through a cast to half their width
  // (125 bytes on the device, parameter and gradient), whose copy, 125 bytes, is among each
  // block's 1000 bytes of profiled activations.
  CostTable t = EightBlocks();
  t.param_streamed_bytes.assign(8, 125);
  // The runtime cuts its blocks by the masters' bytes; the device holds half of them.
  const internal::StreamedBlocks blocks = internal::StreamedBlocksOf(t, 0, 8, 250);
  CHECK(blocks.count == 8);
  CHECK(blocks.largest == 250);
  CHECK(blocks.largest_pair == 250);
  CHECK(blocks.largest_triple == 375);
  // A window of 250 parameter bytes reruns one block, its parameter's copy not made.
  CHECK(internal::StreamedRecompute(t, 0, 0, 8, 4, 250, 35).act_peak == 875 + 50);
  SearchOptions o = StreamedOnGpu();
  o.mem_margin = 0;
  Links links = SimpleLinks();
  links.host_bytes_per_s = 1e12;
  // Kept whole: two blocks' parameters, the activations with the last block's working memory
  // (the peak of one micro-batch, the copies still in it), three blocks' gradients.
  const uint64_t keep_all = 250 + (8000 + 50 + 375);
  o.device_memory_bytes = keep_all;
  StageEval e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(!e.recompute);
  CHECK(e.memory_bytes == keep_all);
  // Recomputed by blocks: the seven later blocks' inputs, one block rerun without its copy.
  const uint64_t blocked = 250 + 7 * 20 + (875 + 50) + 375;
  o.device_memory_bytes = blocked;
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 1);
  CHECK(e.recompute);
  CHECK(e.memory_bytes == blocked);
  // GPipe's first micro-batch keeps its activations, without the copies, while the second
  // runs.
  o.schedule = Schedule::kGPipe;
  o.batch_size = 8;
  o.device_memory_bytes = 1000000;
  CHECK(EvaluateStage(t, links, o, 0, 8, 1, 0, 2).memory_bytes == keep_all + 7000);
  // Unstreamed (one block): the runtime uploads the masters whole, copies made.
  o.offload_block_bytes = 4000;
  CostTable wide = t;
  wide.param_streamed_bytes.clear();
  e = EvaluateStage(t, links, o, 0, 8, 1, 0, 2);
  CHECK(e.memory_bytes == EvaluateStage(wide, links, o, 0, 8, 1, 0, 2).memory_bytes);
  CHECK(e.memory_bytes > 2000 + 16000);
}

TEST_CASE("AMP's weight copies count once per micro-batch in flight", "[cost_eval]") {
  const CostTable t = Stack(250, 100);
  SearchOptions o = Batch(4, 1);
  o.schedule = Schedule::kGPipe;
  o.amp_cast_factor = 0.5;
  // Each micro-batch keeps its activations 400 and bf16 copies 500 of the weights; the fourth's
  // first backward peaks at block 0 (gradients 1000, activations 100, copy 125, working 50).
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 4);
  CHECK(e.memory_bytes == 1100 + 2000 + 3 * (400 + 500) + (1000 + 100 + 125 + 50));
  // The copies do not grow with the batch.
  CHECK(e.fixed_bytes == e.memory_bytes - 3 * 400 - (400 + 50));
  o.amp_cast_factor = 0;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 4, 1, 0, 4).memory_bytes ==
        1100 + 2000 + 3 * 400 + (1000 + 100 + 50));
}

TEST_CASE("EvaluateStage recomputes only when the stage does not fit otherwise",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.schedule = Schedule::kGPipe;
  o.optimizer_state_factor = 0;
  // Blocks 1..2, 4 micro-batches in flight, 1 replica: params 800, grads 500 (all read by
  // block 2, the last), act (200 + 300) per micro-batch, working memory 150 in block 2, input
  // 40 per micro-batch. Kept: three micro-batches whole and the fourth's input; its first
  // backward starts at block 2, allocating the gradients with every activation alive.
  const uint64_t keep_all = 800 + 3 * (500 + 40) + 40 + (500 + 500 + 150);
  // Recomputed: the four inputs, and the fourth micro-batch's activations rebuilt.
  const uint64_t recomputed = 800 + 4 * 40 + (500 + 500 + 150);
  o.mem_margin = 0;

  o.device_memory_bytes = keep_all;
  StageEval fits = EvaluateStage(t, SimpleLinks(), o, 1, 3, 1, 0, 4);
  CHECK(fits.feasible);
  CHECK(!fits.recompute);
  CHECK(fits.memory_bytes == keep_all);

  o.device_memory_bytes = keep_all - 1;
  StageEval rec = EvaluateStage(t, SimpleLinks(), o, 1, 3, 1, 0, 4);
  CHECK(rec.feasible);
  CHECK(rec.recompute);
  CHECK(rec.memory_bytes == recomputed);
  CHECK_THAT(rec.bwd_ms, WithinRel(7.0 + 5.0, 1e-12));  // bwd 3+4 plus the fwd 2+3 again
  CHECK_THAT(rec.time_ms, WithinRel(rec.fwd_ms + rec.bwd_ms + rec.comm_ms, 1e-12));

  o.allow_recompute = false;
  StageEval no = EvaluateStage(t, SimpleLinks(), o, 1, 3, 1, 0, 4);
  CHECK(!no.feasible);
  CHECK(!no.recompute);

  o.allow_recompute = true;
  o.device_memory_bytes = recomputed - 1;
  StageEval none = EvaluateStage(t, SimpleLinks(), o, 1, 3, 1, 0, 4);
  CHECK(!none.feasible);
  CHECK(none.memory_bytes == recomputed);  // the smallest it could need
}

TEST_CASE("fixed_bytes plus the rest scaled bounds the memory at a larger micro-batch",
          "[cost_eval]") {
  // Profiles linear in the micro-batch (act 100 or 800 per sample, peak 10 per sample), a
  // 40-byte-per-sample input: the deployment check scales memory - fixed by the micro-batch
  // ratio, which must never fall short of the estimate at the larger batch.
  for (uint64_t act_per_sample : {100u, 800u}) {
    CostTable t;
    t.param_bytes = {3000, 500};
    t.param_trainable = {true, true};
    for (int b = 0; b < 2; ++b) {
      Block blk;
      blk.params = {b};
      for (uint64_t mb : {4u, 8u}) {
        blk.by_mb[static_cast<int64_t>(mb)] = {1.0, 2.0, act_per_sample * mb, 10 * mb};
      }
      t.blocks.push_back(blk);
    }
    t.cut_bytes_per_sample = {0, 40};
    for (int begin : {0, 1}) {
      for (int replicas : {1, 2}) {
        for (int m : {1, 2, 4}) {
          for (int after : {0, 1, 3}) {
            for (bool zero : {false, true}) {
              for (bool recompute : {false, true}) {
                for (double amp : {0.0, 0.5}) {
                  SearchOptions o = Batch(m, replicas);
                  o.zero = zero;
                  o.amp_cast_factor = amp;
                  // Recompute is forced by memory too small for anything.
                  o.device_memory_bytes = recompute ? 1 : 1ull << 40;
                  SearchOptions twice = o;
                  twice.batch_size *= 2;
                  const StageEval e = EvaluateStage(t, SimpleLinks(), o, begin, 2, replicas, after, m);
                  const StageEval e2 =
                      EvaluateStage(t, SimpleLinks(), twice, begin, 2, replicas, after, m);
                  INFO("act " << act_per_sample << " begin " << begin << " replicas " << replicas
                              << " m " << m << " after " << after << " zero " << zero
                              << " recompute " << recompute << " amp " << amp);
                  REQUIRE(e.micro_batch == 4);
                  REQUIRE(e2.micro_batch == 8);
                  CHECK(e.recompute == recompute);
                  CHECK(e.fixed_bytes <= e.memory_bytes);
                  CHECK(e.fixed_bytes >= e.param_bytes);
                  CHECK(e.fixed_bytes + 2 * (e.memory_bytes - e.fixed_bytes) + 1 >= e2.memory_bytes);
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("EvaluateStage keeps mem_margin free", "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.allow_recompute = false;
  StageEval e = EvaluateStage(t, SimpleLinks(), o, 0, 3, 1, 0, 1);
  o.mem_margin = 0.5;
  o.device_memory_bytes = e.memory_bytes * 2;
  CHECK(EvaluateStage(t, SimpleLinks(), o, 0, 3, 1, 0, 1).feasible);
  o.device_memory_bytes = e.memory_bytes * 2 - 2;
  CHECK(!EvaluateStage(t, SimpleLinks(), o, 0, 3, 1, 0, 1).feasible);
}

TEST_CASE("Objective is fill-and-drain plus the slowest stage's steady state plus all-reduce",
          "[cost_eval]") {
  StageEval a, b;
  a.time_ms = 3;
  a.allreduce_ms = 1;
  b.time_ms = 5;
  b.allreduce_ms = 2;
  CHECK_THAT(Objective({a, b}, 4), WithinRel(3 * 5 + 8 + 2.0, 1e-12));
  CHECK_THAT(Objective({a}, 1), WithinRel(4.0, 1e-12));
}

}  // namespace
}  // namespace planner
}  // namespace rannc
