// Checks the partition search against exhaustive enumeration on small random models, and its
// behaviour on hand-built cases: data parallelism, splitting large models, forced values,
// recompute, non-power-of-two replicas, error statuses and speed.
#include "daemon/planner/search.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/planner/cost_eval.h"
#include "daemon/planner/cost_table.h"
#include "daemon/planner/schedule_sim.h"

namespace rannc {
namespace planner {
namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinRel;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr uint64_t kGiB = 1ull << 30;

// Checks that hold for every plan: contiguous stages covering all blocks, fresh evaluations
// equal to the stored ones and feasible within the memory limit, objective = Objective().
void CheckPlanConsistent(const CostTable& t, const Links& l, const SearchOptions& o,
                         const Plan& p) {
  const int S = static_cast<int>(p.stages.size());
  REQUIRE(S >= 1);
  CHECK(p.stages.front().begin == 0);
  CHECK(p.stages.back().end == static_cast<int>(t.blocks.size()));
  int devices = 0;
  std::vector<StageEval> evals;
  const double limit = static_cast<double>(o.device_memory_bytes) * (1 - o.mem_margin);
  for (int s = 0; s < S; ++s) {
    const StagePlan& sp = p.stages[s];
    if (s > 0) CHECK(sp.begin == p.stages[s - 1].end);
    CHECK(sp.begin < sp.end);
    CHECK(sp.replicas >= 1);
    devices += sp.replicas;
    StageEval fresh = EvaluateStage(t, l, o, sp.begin, sp.end, sp.replicas, S - 1 - s,
                                    p.micro_batches);
    CHECK(fresh.feasible);
    CHECK(sp.eval.feasible);
    CHECK(fresh.time_ms == sp.eval.time_ms);
    CHECK(fresh.memory_bytes == sp.eval.memory_bytes);
    CHECK(static_cast<double>(sp.eval.memory_bytes) <= limit);  // (b)
    if (sp.eval.recompute) {
      // (f) recompute only where the stage would not fit without it.
      SearchOptions no = o;
      no.allow_recompute = false;
      CHECK(!EvaluateStage(t, l, no, sp.begin, sp.end, sp.replicas, S - 1 - s, p.micro_batches)
                 .feasible);
    }
    evals.push_back(fresh);
  }
  CHECK(devices == p.devices_used);
  CHECK(devices <= o.num_devices);
  CHECK_THAT(p.objective_ms, WithinRel(Objective(evals, p.micro_batches), 1e-12));
  CHECK_THAT(p.simulated_ms, WithinRel(SimulateStep(evals, p.micro_batches, o.schedule), 1e-12));
  CHECK(p.schedule == o.schedule);
}

struct BruteResult {
  double objective = kInf;
  int stages = 0, micro_batches = 0, devices = 0;
};

// Every micro-batch count, every split into contiguous stages, every replica assignment.
BruteResult BruteForce(const CostTable& t, const Links& l, const SearchOptions& o) {
  const int n = static_cast<int>(t.blocks.size());
  BruteResult best;
  std::vector<int> ms;
  if (o.pipeline_num > 0) {
    ms = {o.pipeline_num};
  } else {
    for (int m = 1; m <= std::min<int64_t>(o.max_pipeline, o.batch_size); ++m) ms.push_back(m);
  }
  for (int m : ms) {
    for (int mask = 0; mask < (1 << (n - 1)); ++mask) {
      std::vector<int> starts = {0};
      for (int b = 1; b < n; ++b) {
        if (mask & (1 << (b - 1))) starts.push_back(b);
      }
      const int S = static_cast<int>(starts.size());
      if (o.partition_num > 0 && S != o.partition_num) continue;
      starts.push_back(n);
      std::vector<int> reps(S, 0);
      std::function<void(int, int)> assign = [&](int s, int used) {
        if (s == S) {
          if (o.use_all_devices && used != o.num_devices) return;
          std::vector<StageEval> evals;
          for (int i = 0; i < S; ++i) {
            evals.push_back(EvaluateStage(t, l, o, starts[i], starts[i + 1], reps[i], S - 1 - i, m));
            if (!evals.back().feasible) return;
          }
          const double obj = Objective(evals, m);
          bool better = obj < best.objective * (1 - 1e-12);
          if (!better && obj <= best.objective * (1 + 1e-12)) {
            if (S != best.stages) {
              better = S < best.stages;
            } else if (m != best.micro_batches) {
              better = m < best.micro_batches;
            } else {
              better = used > best.devices;
            }
          }
          if (better) best = {obj, S, m, used};
          return;
        }
        const int lo = o.replica_num > 0 ? o.replica_num : 1;
        const int hi = o.replica_num > 0 ? o.replica_num : o.num_devices;
        for (int r = lo; r <= hi && used + r <= o.num_devices; ++r) {
          reps[s] = r;
          assign(s + 1, used + r);
        }
      };
      assign(0, 0);
    }
  }
  return best;
}

struct RandomCase {
  CostTable table;
  Links links;
  SearchOptions options;
};

struct CaseSize {
  int max_blocks, max_devices, max_batch, max_pipeline;
};

RandomCase MakeRandomCase(std::mt19937& rng, const CaseSize& size) {
  auto uni = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RandomCase c;
  CostTable& t = c.table;
  const int n = pick(1, size.max_blocks);
  const int num_params = n + 2;
  for (int p = 0; p < num_params; ++p) {
    t.param_bytes.push_back(static_cast<uint64_t>(pick(100, 10000)));
    t.param_trainable.push_back(pick(0, 4) != 0);
  }
  const std::vector<int64_t> sizes = {1, 2, 3, 4, 8};
  for (int b = 0; b < n; ++b) {
    Block blk;
    blk.params.push_back(b);
    // Tied params: params n and n+1 are shared by random blocks.
    if (pick(0, 2) == 0) blk.params.push_back(n);
    if (pick(0, 2) == 0) blk.params.push_back(n + 1);
    if (pick(0, 3) == 0) blk.params.push_back(b);  // the same tensor twice in one block
    const int points = pick(1, 3);
    for (int i = 0; i < points; ++i) {
      const int64_t mb = sizes[pick(0, static_cast<int>(sizes.size()) - 1)];
      BlockProfile p;
      p.fwd_ms = uni(0.05, 2.0) * static_cast<double>(mb) + uni(0, 0.5);
      p.bwd_ms = uni(0.05, 4.0) * static_cast<double>(mb) + uni(0, 0.5);
      p.act_bytes = static_cast<uint64_t>(uni(100, 5000) * static_cast<double>(mb));
      p.peak_bytes = static_cast<uint64_t>(uni(0, 3000) * static_cast<double>(mb));
      blk.by_mb[mb] = p;
    }
    t.blocks.push_back(blk);
  }
  t.cut_bytes_per_sample.push_back(0);
  for (int b = 1; b < n; ++b) t.cut_bytes_per_sample.push_back(uni(0, 2000));

  Links& l = c.links;
  l.p2p_bytes_per_s = uni(1e5, 1e7);
  l.p2p_latency_s = uni(0, 1e-4);
  l.allreduce_latency_s = uni(0, 1e-4);
  if (pick(0, 1) == 0) {
    for (int k = 2; k <= 4; ++k) {
      if (pick(0, 1) == 0) l.allreduce_bytes_per_s[k] = uni(1e5, 1e7);
    }
  }

  SearchOptions& o = c.options;
  o.batch_size = pick(1, size.max_batch);
  o.num_devices = pick(1, size.max_devices);
  o.max_pipeline = pick(1, size.max_pipeline);
  o.mem_margin = uni(0, 0.3);
  o.schedule = pick(0, 1) == 0 ? Schedule::k1F1B : Schedule::kGPipe;
  o.optimizer_state_factor = pick(0, 3);
  o.zero = pick(0, 3) == 0;
  o.offload = pick(0, 3) == 0;
  if (pick(0, 3) == 0) o.amp_cast_factor = 0.5;
  o.allow_recompute = pick(0, 3) != 0;
  o.use_all_devices = pick(0, 5) == 0;
  if (pick(0, 5) == 0) o.partition_num = pick(1, std::min(n, o.num_devices));
  if (pick(0, 5) == 0) {
    o.replica_num = pick(1, o.num_devices / std::max(1, o.partition_num));
    if (o.use_all_devices && (o.num_devices % o.replica_num != 0 ||
                              (o.partition_num > 0 &&
                               o.partition_num * o.replica_num != o.num_devices) ||
                              o.num_devices / o.replica_num > n)) {
      o.use_all_devices = false;
    }
  }
  if (pick(0, 5) == 0) {
    const int most = static_cast<int>(o.batch_size / std::max(1, o.replica_num));
    if (most >= 1) o.pipeline_num = pick(1, most);
  }
  // A memory limit around what the whole model needs on one device, so that some candidates
  // fit and others do not (and sometimes none does).
  SearchOptions probe = o;
  probe.device_memory_bytes = ~0ull;
  probe.allow_recompute = false;
  const StageEval whole = EvaluateStage(t, l, probe, 0, n, 1, 0, 1);
  o.device_memory_bytes =
      static_cast<uint64_t>(static_cast<double>(whole.memory_bytes) * uni(0.15, 1.6)) + 1;
  return c;
}

// Runs `trials` random cases of at most `size` through SearchPlan and the brute force.
void CompareWithBruteForce(uint32_t seed, int trials, const CaseSize& size, bool check_coverage) {
  std::mt19937 rng(seed);
  int feasible = 0, infeasible = 0, multi_stage = 0, recomputed = 0;
  for (int trial = 0; trial < trials; ++trial) {
    RandomCase c = MakeRandomCase(rng, size);
    INFO("trial " << trial << " blocks " << c.table.blocks.size() << " devices "
                  << c.options.num_devices << " batch " << c.options.batch_size);
    const BruteResult brute = BruteForce(c.table, c.links, c.options);
    absl::StatusOr<Plan> plan = SearchPlan(c.table, c.links, c.options);
    if (brute.objective == kInf) {
      ++infeasible;
      REQUIRE(!plan.ok());
      CHECK(plan.status().code() == absl::StatusCode::kResourceExhausted);
      continue;
    }
    ++feasible;
    REQUIRE(plan.ok());
    CHECK_THAT(plan->objective_ms, WithinRel(brute.objective, 1e-9));
    // The tie-breaking (fewer stages, fewer micro-batches, more devices) matches too.
    CHECK(static_cast<int>(plan->stages.size()) == brute.stages);
    CHECK(plan->micro_batches == brute.micro_batches);
    CHECK(plan->devices_used == brute.devices);
    CheckPlanConsistent(c.table, c.links, c.options, *plan);
    if (c.options.partition_num > 0) CHECK(static_cast<int>(plan->stages.size()) == c.options.partition_num);
    if (c.options.pipeline_num > 0) CHECK(plan->micro_batches == c.options.pipeline_num);
    if (c.options.use_all_devices) CHECK(plan->devices_used == c.options.num_devices);
    for (const StagePlan& s : plan->stages) {
      if (c.options.replica_num > 0) CHECK(s.replicas == c.options.replica_num);
      if (s.eval.recompute) ++recomputed;
    }
    if (plan->stages.size() > 1) ++multi_stage;
  }
  WARN("random cases: " << feasible << " feasible, " << infeasible << " infeasible, "
                         << multi_stage << " multi-stage plans, " << recomputed
                         << " recomputed stages");
  if (!check_coverage) return;
  // The generator must exercise all the interesting regimes.
  CHECK(feasible > 300);
  CHECK(infeasible > 50);
  CHECK(multi_stage > 50);
  CHECK(recomputed > 10);
}

TEST_CASE("SearchPlan equals exhaustive enumeration on random small models", "[search]") {
  // Up to 6 blocks, 4 devices, batch 16, 8 micro-batches.
  CompareWithBruteForce(20240611, 5000, {6, 4, 16, 8}, /*check_coverage=*/true);
}

TEST_CASE("SearchPlan equals exhaustive enumeration on random medium models", "[search]") {
  // Larger cases, where the pruning bounds cut much more of the search.
  CompareWithBruteForce(777, 400, {8, 6, 32, 12}, /*check_coverage=*/false);
}

// n identical blocks; each block has its own trainable param of `param_bytes`.
CostTable UniformModel(int n, uint64_t param_bytes, double ms_per_sample, uint64_t act_per_sample,
                       double cut_per_sample) {
  CostTable t;
  for (int b = 0; b < n; ++b) {
    t.param_bytes.push_back(param_bytes);
    t.param_trainable.push_back(true);
    Block blk;
    blk.params = {b};
    blk.by_mb[1] = {ms_per_sample, 2 * ms_per_sample, act_per_sample, act_per_sample / 4};
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(b == 0 ? 0 : cut_per_sample);
  }
  return t;
}

Links FastLinks() {
  Links l;
  l.p2p_bytes_per_s = 100e9;
  l.p2p_latency_s = 1e-6;
  l.allreduce_latency_s = 1e-6;
  l.allreduce_bytes_per_s = {{2, 100e9}};
  return l;
}

TEST_CASE("Pure data parallelism wins when the model fits and all-reduce is cheap", "[search]") {
  CostTable t = UniformModel(8, 1 << 20, 1.0, 1 << 20, 1 << 20);
  SearchOptions o;
  o.batch_size = 32;
  o.num_devices = 4;
  o.device_memory_bytes = 64 * kGiB;
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  REQUIRE(plan->stages.size() == 1);
  CHECK(plan->stages[0].replicas == 4);
  CHECK(plan->micro_batches == 1);  // more micro-batches gain nothing with one stage
  CHECK(plan->devices_used == 4);
  CHECK(!plan->stages[0].eval.recompute);  // (f) nothing to save memory for
  CheckPlanConsistent(t, FastLinks(), o, *plan);
}

TEST_CASE("A model too large for one device is split into stages", "[search]") {
  // 8 blocks of 1 GiB params each: with Adam, 4 GiB per block, 32 GiB for the model.
  CostTable t = UniformModel(8, kGiB, 1.0, 1 << 20, 1 << 20);
  SearchOptions o;
  o.batch_size = 16;
  o.num_devices = 4;
  o.device_memory_bytes = 20 * kGiB;
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  CHECK(plan->stages.size() >= 2);
  CheckPlanConsistent(t, FastLinks(), o, *plan);
}

TEST_CASE("Forced partition_num, replica_num and pipeline_num are honoured", "[search]") {
  CostTable t = UniformModel(6, 1 << 20, 1.0, 1 << 20, 1 << 10);
  SearchOptions o;
  o.batch_size = 48;
  o.num_devices = 6;
  o.device_memory_bytes = 64 * kGiB;
  const Links l = FastLinks();

  SECTION("partition_num") {
    o.partition_num = 3;
    absl::StatusOr<Plan> plan = SearchPlan(t, l, o);
    REQUIRE(plan.ok());
    CHECK(plan->stages.size() == 3);
    CheckPlanConsistent(t, l, o, *plan);
  }
  SECTION("replica_num") {
    o.replica_num = 2;
    absl::StatusOr<Plan> plan = SearchPlan(t, l, o);
    REQUIRE(plan.ok());
    for (const StagePlan& s : plan->stages) CHECK(s.replicas == 2);
    CheckPlanConsistent(t, l, o, *plan);
  }
  SECTION("all three") {
    o.partition_num = 2;
    o.replica_num = 3;
    o.pipeline_num = 4;
    absl::StatusOr<Plan> plan = SearchPlan(t, l, o);
    REQUIRE(plan.ok());
    CHECK(plan->stages.size() == 2);
    CHECK(plan->micro_batches == 4);
    CHECK(plan->devices_used == 6);
    for (const StagePlan& s : plan->stages) CHECK(s.replicas == 3);
    CheckPlanConsistent(t, l, o, *plan);
  }
  SECTION("use_all_devices") {
    o.use_all_devices = true;
    o.num_devices = 5;
    o.batch_size = 7;  // 5 replicas of one stage would idle 3 of them half the time
    absl::StatusOr<Plan> plan = SearchPlan(t, l, o);
    REQUIRE(plan.ok());
    CHECK(plan->devices_used == 5);
    CheckPlanConsistent(t, l, o, *plan);
  }
}

void CheckInvalid(const CostTable& t, const SearchOptions& o, const std::string& key) {
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(!plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(plan.status().message()), Contains(key));
}

TEST_CASE("Impossible forced values and malformed input are INVALID_ARGUMENT", "[search]") {
  CostTable t = UniformModel(4, 1 << 20, 1.0, 1 << 20, 1 << 10);
  SearchOptions o;
  o.batch_size = 8;
  o.num_devices = 4;
  o.device_memory_bytes = 64 * kGiB;
  SearchOptions bad = o;
  bad.partition_num = 5;  // > 4 blocks
  CheckInvalid(t, bad, "partition_num");
  bad = o;
  bad.num_devices = 2;
  bad.partition_num = 3;  // > devices
  CheckInvalid(t, bad, "partition_num");
  bad = o;
  bad.partition_num = 2;
  bad.replica_num = 3;  // 6 devices > 4
  CheckInvalid(t, bad, "replica_num");
  bad = o;
  bad.replica_num = 5;
  CheckInvalid(t, bad, "replica_num");
  bad = o;
  bad.pipeline_num = 9;  // > batch 8
  CheckInvalid(t, bad, "pipeline_num");
  bad = o;
  bad.pipeline_num = 4;
  bad.replica_num = 3;  // 12 samples needed per step
  CheckInvalid(t, bad, "pipeline_num");
  bad = o;
  bad.use_all_devices = true;
  bad.replica_num = 3;  // 4 devices are not a multiple of 3
  CheckInvalid(t, bad, "use_all_devices");
  bad = o;
  bad.batch_size = 0;
  CheckInvalid(t, bad, "batch_size");
  bad = o;
  bad.mem_margin = 1.0;
  CheckInvalid(t, bad, "mem_margin");
  CostTable broken = t;
  broken.cut_bytes_per_sample.pop_back();
  CheckInvalid(broken, o, "cut_bytes_per_sample");
  broken = t;
  broken.blocks[1].params.push_back(99);
  CheckInvalid(broken, o, "param 99");
  CheckInvalid(CostTable{}, o, "no blocks");
}

TEST_CASE("Nothing fitting is RESOURCE_EXHAUSTED with the memory the best plan needs",
          "[search]") {
  // One block holding a 1 GiB trainable param: params + grads + Adam state = 4 GiB, plus
  // negligible activations. Two devices cannot split one block, and zero is off.
  CostTable t;
  t.param_bytes = {kGiB};
  t.param_trainable = {true};
  Block b;
  b.params = {0};
  b.by_mb[1] = {1.0, 2.0, 0, 0};
  t.blocks.push_back(b);
  t.cut_bytes_per_sample = {0};
  SearchOptions o;
  o.batch_size = 4;
  o.num_devices = 2;
  o.device_memory_bytes = 2 * kGiB;
  o.mem_margin = 0;
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(!plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kResourceExhausted);
  const std::string msg(plan.status().message());
  CHECK_THAT(msg, Contains("4.000 GiB"));
  CHECK_THAT(msg, Contains("2.000 GiB"));
  CHECK_THAT(msg, Contains("device_memory_bytes"));
  CHECK_THAT(msg, Contains("zero"));

  // With zero over 2 replicas: params 1 + state 2/2 + the whole flat gradient 1 and the
  // reduce-scatter's shard 1/2 = 3.5 GiB, still too much, and reported as such.
  o.zero = true;
  plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(!plan.ok());
  CHECK_THAT(std::string(plan.status().message()), Contains("3.500 GiB"));
  o.device_memory_bytes = 3 * kGiB + kGiB / 2;
  plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  CHECK(plan->stages[0].replicas == 2);
}

TEST_CASE("Recompute is chosen only when a stage does not fit otherwise", "[search]") {
  // One block, one device: 1 MiB params, 1 GiB of activations per sample.
  CostTable t = UniformModel(1, 1 << 20, 1.0, kGiB, 0);
  SearchOptions o;
  o.batch_size = 4;
  o.num_devices = 1;
  o.mem_margin = 0;
  o.pipeline_num = 1;
  o.device_memory_bytes = 8 * kGiB;  // 4 GiB of activations + 1 GiB peak fit
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  CHECK(!plan->stages[0].eval.recompute);

  // Two stages of this block pair under GPipe with 4 micro-batches: 4 activations in flight
  // do not fit in 3 GiB but one (plus the inputs) does.
  CostTable two = UniformModel(2, 1 << 20, 1.0, kGiB, 1024);
  o.num_devices = 2;
  o.schedule = Schedule::kGPipe;
  o.pipeline_num = 4;
  o.partition_num = 2;
  o.device_memory_bytes = 3 * kGiB;
  plan = SearchPlan(two, FastLinks(), o);
  REQUIRE(plan.ok());
  for (const StagePlan& s : plan->stages) CHECK(s.eval.recompute);
  CheckPlanConsistent(two, FastLinks(), o, *plan);

  o.allow_recompute = false;
  plan = SearchPlan(two, FastLinks(), o);
  REQUIRE(!plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(plan.status().message()), Contains("allow recompute"));
}

TEST_CASE("Replica counts need not be powers of two", "[search]") {
  CostTable t = UniformModel(4, 1 << 20, 1.0, 1 << 20, 1 << 20);
  SearchOptions o;
  o.batch_size = 12;
  o.num_devices = 3;
  o.device_memory_bytes = 64 * kGiB;
  o.partition_num = 1;
  absl::StatusOr<Plan> plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  REQUIRE(plan->stages.size() == 1);
  CHECK(plan->stages[0].replicas == 3);
  // Unforced, one stage on all three devices still wins here.
  o.partition_num = 0;
  plan = SearchPlan(t, FastLinks(), o);
  REQUIRE(plan.ok());
  CHECK(plan->stages.size() == 1);
  CHECK(plan->stages[0].replicas == 3);
}

// A 48-layer transformer-like model: 100 MiB of params per block, activations that make the
// full batch not fit on one device, and a tied embedding shared by the first and last block.
CostTable LargeModel(int n) {
  CostTable t;
  t.param_bytes.push_back(200ull << 20);  // tied embedding
  t.param_trainable.push_back(true);
  for (int b = 0; b < n; ++b) {
    t.param_bytes.push_back(100ull << 20);
    t.param_trainable.push_back(true);
    Block blk;
    blk.params = {b + 1};
    if (b == 0 || b == n - 1) blk.params.push_back(0);
    const double jitter = 1.0 + 0.1 * ((b * 7) % 5);
    for (int64_t mb : {1, 2, 4, 8}) {
      blk.by_mb[mb] = {0.2 * jitter + 0.5 * static_cast<double>(mb),
                       0.4 * jitter + 1.0 * static_cast<double>(mb),
                       static_cast<uint64_t>(mb) * (60ull << 20), static_cast<uint64_t>(mb) << 20};
    }
    t.blocks.push_back(blk);
    t.cut_bytes_per_sample.push_back(b == 0 ? 0 : 4 << 20);
  }
  return t;
}

TEST_CASE("Nothing fitting a large model and machine still answers fast", "[search]") {
  // 64 blocks on 64 devices: the exact least-memory search would be too slow, so the message
  // reports the lower bound from single blocks. The largest is block 0: the 200 MiB tied
  // embedding and its own 100 MiB, least with one sample per device and micro-batch (on 64
  // replicas, say): params 300 + Adam state 600 + the reducer's buckets 300 + its backward's
  // gradients 300, activations 60 and working memory 1 = 1561 MiB = 1.524 GiB. (One replica,
  // without buckets, needs 32 micro-batches of 8 samples: 300 + 600 + 300 + 480 + 8 = 1688 MiB.)
  CostTable t = LargeModel(64);
  SearchOptions o;
  o.batch_size = 256;
  o.num_devices = 64;
  o.device_memory_bytes = 256ull << 20;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Plan> plan = SearchPlan(t, Links{}, o);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(!plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(plan.status().message()), Contains("needs at least 1.524 GiB"));
  CHECK(seconds < 2.0);
}

TEST_CASE("A 48-block, 16-device search finishes in well under two seconds", "[search]") {
  CostTable t = LargeModel(48);
  Links l;
  l.p2p_bytes_per_s = 20e9;
  l.allreduce_bytes_per_s = {{2, 40e9}, {4, 30e9}, {8, 20e9}, {16, 15e9}};
  SearchOptions o;
  o.batch_size = 64;
  o.num_devices = 16;
  o.device_memory_bytes = 16 * kGiB;
  for (Schedule sched : {Schedule::k1F1B, Schedule::kGPipe}) {
    o.schedule = sched;
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<Plan> plan = SearchPlan(t, l, o);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO("search took " << seconds << " s");
    REQUIRE(plan.ok());
    CHECK(seconds < 2.0);
    WARN("48 blocks / 16 devices: " << seconds << " s, " << plan->stages.size() << " stages, "
                                    << plan->micro_batches << " micro-batches, "
                                    << plan->devices_used << " devices, objective "
                                    << plan->objective_ms << " ms, simulated "
                                    << plan->simulated_ms << " ms");
    CheckPlanConsistent(t, l, o, *plan);
  }
}

}  // namespace
}  // namespace planner
}  // namespace rannc
