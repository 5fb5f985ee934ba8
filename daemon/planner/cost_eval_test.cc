// Checks ProfileAt's interpolation rules and EvaluateStage's time, communication and memory
// formulas against values computed by hand.
#include "daemon/planner/cost_eval.h"

#include <catch2/catch.hpp>
#include <vector>

#include "daemon/planner/cost_table.h"

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
  // params 1800 + grads 1500 + Adam state 3000 + act 600 + peak 150.
  CHECK(e.memory_bytes == 1800 + 1500 + 3000 + 600 + 150);
  // 2 ms latency + 1500 B / 500 B/s.
  CHECK_THAT(e.allreduce_ms, WithinRel((0.002 + 3.0) * 1000, 1e-12));
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
  // params 1500 + grads 1500 (whole while the step computes them) + state 1500 / 4 + act 100
  // + peak 50.
  CHECK(e.memory_bytes == 1500 + 1500 + 375 + 100 + 50);
}

TEST_CASE("EvaluateStage recomputes only when the stage does not fit otherwise",
          "[cost_eval]") {
  CostTable t = ThreeBlocks();
  SearchOptions o = BigMemory();
  o.schedule = Schedule::kGPipe;
  o.optimizer_state_factor = 0;
  // Blocks 1..2, 4 micro-batches in flight, 1 replica: params 800, grads 500,
  // act (200 + 300) per micro-batch, peak 150, input 40 per micro-batch.
  const uint64_t keep_all = 800 + 500 + 500 * 4 + 150 + 40 * 4;
  const uint64_t recomputed = 800 + 500 + 40 * 4 + 500 + 150;
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
