#include "daemon/planner/planner.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/graph/ir_testing.h"
#include "daemon/graph/subgraph.h"
#include "daemon/planner/deployment.h"
#include "daemon/planner/links.h"

namespace rannc {
namespace planner {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

PlanTarget Target(int devices, uint64_t memory) {
  PlanTarget t;
  t.num_devices = devices;
  t.device_memory_bytes = memory;
  t.links = *LinksFromString("p2p=10GB/s,allreduce=2:5GB/s;3:4GB/s;4:3GB/s");
  return t;
}

PlannerConfig Config(std::map<std::string, std::string> keys) {
  absl::StatusOr<PlannerConfig> c = PlannerConfigFromKeys(keys);
  REQUIRE(c.ok());
  c->profiling.repeats = 1;
  return *c;
}

uint64_t ParamBytes(const FixtureIr& f) {
  uint64_t bytes = 0;
  for (const at::Tensor& t : f.tensors) bytes += t.numel() * t.element_size();
  return bytes;
}

// Adam's memory (two moments a parameter), the parameters and state offloaded or not.
MemoryModel Adam(bool offload) {
  MemoryModel m;
  m.optimizer = "adam";
  m.optimizer_state_factor = 2;
  m.offload = offload;
  return m;
}

void CheckCoversModel(const v1::Deployment& d, const IrGraph& ir, int devices) {
  uint32_t next = 0;
  std::set<uint32_t> used;
  for (const v1::DeploymentStage& s : d.stages()) {
    CHECK(s.first_node() == next);
    CHECK(s.end_node() > s.first_node());
    next = s.end_node();
    for (uint32_t dev : s.devices()) {
      CHECK(dev < static_cast<uint32_t>(devices));
      CHECK(used.insert(dev).second);  // a device holds one stage
    }
    CHECK(s.memory_bytes() <= d.device_memory_bytes() * (1 - d.mem_margin()));
  }
  CHECK(next == ir.nodes.size());
  CHECK(d.model_hash() == ir.hash);
  CHECK(d.estimated_step_ms() > 0);
}

TEST_CASE("PlanModel gives a model that fits one device a plan covering every node", "[planner]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                               Target(1, 1ull << 30), {}, Config({}), nullptr, "test");
  REQUIRE(d.ok());
  REQUIRE(d->stages_size() == 1);
  CheckCoversModel(*d, *f.ir, 1);
  CHECK(d->stages(0).micro_batch() * d->micro_batches() >= 5);
  CHECK(d->created_by() == "test");
  CHECK_THAT(DescribeDeployment(*d), Catch::Contains("stage 0: nodes [0, "));
}

TEST_CASE("PlanModel keeps a batch whole when samples interact, and says why", "[planner]") {
  FixtureIr f = BuildFixtureIr("bn_dropout_net");
  REQUIRE(f.ir.ok());
  absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                               Target(4, 1ull << 30), {}, Config({}), nullptr, "test");
  REQUIRE(d.ok());
  CHECK(d->micro_batches() == 1);
  for (const v1::DeploymentStage& s : d->stages()) CHECK(s.devices_size() == 1);
  CHECK_THAT(d->batch_whole(), Catch::Contains("features.1 (BatchNorm2d)"));
  CHECK_THAT(DescribeDeployment(*d), Catch::Contains("batch kept whole: aten::batch_norm in "
                                                     "features.1 (BatchNorm2d)"));
  absl::StatusOr<v1::Deployment> forced =
      PlanModel(*f.ir, f.tensors, f.fixture.inputs, Target(4, 1ull << 30), {},
                Config({{"replica_num", "2"}}), nullptr, "test");
  CHECK(forced.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(forced.status().message()),
             Catch::Contains("features.1 (BatchNorm2d)") &&
                 Catch::Contains("splitting it would change the results"));
  // A model whose samples are independent says nothing.
  FixtureIr mlp = BuildFixtureIr("mlp");
  REQUIRE(mlp.ir.ok());
  d = PlanModel(*mlp.ir, mlp.tensors, mlp.fixture.inputs, Target(2, 1ull << 30), {}, Config({}),
                nullptr, "test");
  REQUIRE(d.ok());
  CHECK(d->batch_whole().empty());
}

TEST_CASE("PlanModel honours forced stage, replica and micro-batch counts", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  absl::StatusOr<v1::Deployment> d = PlanModel(
      *f.ir, f.tensors, f.fixture.inputs, Target(4, 1ull << 30), {},
      Config({{"partition_num", "2"}, {"replica_num", "2"}, {"pipeline_num", "2"},
              {"verify_partitioning", "true"}}),
      nullptr, "test");
  REQUIRE(d.ok());
  CHECK(d->stages_size() == 2);
  CHECK(d->micro_batches() == 2);
  for (const v1::DeploymentStage& s : d->stages()) CHECK(s.devices_size() == 2);
  CheckCoversModel(*d, *f.ir, 4);

  // A forced stage count alone still uses every device by default; use_all_devices=false
  // lets the planner leave some idle (a tiny model's fastest plan: one device).
  for (const char* all : {"default", "false"}) {
    INFO("use_all_devices " << all);
    std::map<std::string, std::string> keys = {{"partition_num", "2"}};
    if (std::string(all) != "default") keys["use_all_devices"] = all;
    absl::StatusOr<v1::Deployment> two = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                   Target(4, 1ull << 30), {}, Config(keys),
                                                   nullptr, "test");
    REQUIRE(two.ok());
    CHECK(two->stages_size() == 2);
    int used = 0;
    for (const v1::DeploymentStage& s : two->stages()) used += s.devices_size();
    if (std::string(all) == "default") CHECK(used == 4);
    CheckCoversModel(*two, *f.ir, 4);
  }
  // Three replicas per stage cannot cover 4 devices: unset, use_all_devices gives way; set,
  // the plan is refused with the reason.
  absl::StatusOr<v1::Deployment> fewer =
      PlanModel(*f.ir, f.tensors, f.fixture.inputs, Target(4, 1ull << 30), {},
                Config({{"replica_num", "3"}}), nullptr, "test");
  REQUIRE(fewer.ok());
  CHECK(fewer->stages(0).devices_size() == 3);
  absl::StatusOr<v1::Deployment> refused =
      PlanModel(*f.ir, f.tensors, f.fixture.inputs, Target(4, 1ull << 30), {},
                Config({{"replica_num", "3"}, {"use_all_devices", "true"}}), nullptr, "test");
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("use_all_devices"));

  // A model returning logits runs GPipe's order whatever is asked, and is planned so.
  FixtureIr logits = BuildFixtureIr("tied_lm");
  REQUIRE(logits.ir.ok());
  absl::StatusOr<v1::Deployment> ordered =
      PlanModel(*logits.ir, logits.tensors, logits.fixture.inputs, Target(2, 1ull << 30), {},
                Config({{"schedule", "1f1b"}}), nullptr, "test");
  REQUIRE(ordered.ok());
  CHECK(ordered->schedule() == v1::SCHEDULE_GPIPE);

  absl::StatusOr<v1::Deployment> gpipe = PlanModel(
      *f.ir, f.tensors, f.fixture.inputs, Target(2, 1ull << 30), {},
      Config({{"partition_num", "2"}, {"schedule", "gpipe"}}), nullptr, "test");
  REQUIRE(gpipe.ok());
  CHECK(gpipe->schedule() == v1::SCHEDULE_GPIPE);
  CHECK(gpipe->stages_size() == 2);
}

TEST_CASE("PlanModel splits a model too large for one device, and refuses one too large for all",
          "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const uint64_t params = ParamBytes(f);
  MemoryModel adam;
  adam.optimizer = "adam";
  adam.optimizer_state_factor = 2;
  // Whole, the model needs 4x its parameters (param, grad, two Adam moments) plus
  // activations; each device gets exactly 4x usable (after the 10% margin), so one device
  // cannot hold it but a few, each with part of the parameters, can.
  const uint64_t memory = static_cast<uint64_t>(params * 4 / 0.9);
  absl::StatusOr<v1::Deployment> one = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                 Target(1, memory), adam, Config({}), nullptr, "t");
  CHECK(one.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(one.status().message()), Catch::Contains("per device"));
  absl::StatusOr<v1::Deployment> split = PlanModel(
      *f.ir, f.tensors, f.fixture.inputs, Target(4, memory), adam,
      Config({{"verify_partitioning", "true"}}), nullptr, "t");
  INFO(split.status().ToString());
  REQUIRE(split.ok());
  INFO(DescribeDeployment(*split));
  CHECK(split->stages_size() >= 2);
  CheckCoversModel(*split, *f.ir, 4);
}

TEST_CASE("Deployments round-trip and stay valid while they fit", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  PlanTarget target = Target(2, 256ull << 20);
  absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs, target, {},
                                               Config({{"partition_num", "2"}}), nullptr, "t");
  REQUIRE(d.ok());
  v1::Deployment loaded;
  REQUIRE(loaded.ParseFromString(d->SerializeAsString()));
  CHECK(loaded.SerializeAsString() == d->SerializeAsString());
  CHECK(CheckDeployment(loaded, *f.ir, target).ok());

  PlanTarget smaller = target;
  smaller.device_memory_bytes = 64ull << 20;  // still far more than this model needs
  CHECK(CheckDeployment(loaded, *f.ir, smaller).ok());

  PlanTarget tiny = target;
  tiny.device_memory_bytes = 4096;
  absl::Status no_fit = CheckDeployment(loaded, *f.ir, tiny);
  CHECK(no_fit.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(no_fit.message()), Catch::Contains("needs") && Catch::Contains("per device"));

  PlanTarget fewer = target;
  fewer.num_devices = 1;
  CHECK(CheckDeployment(loaded, *f.ir, fewer).code() == absl::StatusCode::kFailedPrecondition);

  PlanTarget gpu = target;
  gpu.device_type = "cuda";
  CHECK(CheckDeployment(loaded, *f.ir, gpu).code() == absl::StatusCode::kInvalidArgument);

  FixtureIr other = BuildFixtureIr("mlp");
  REQUIRE(other.ir.ok());
  absl::Status wrong_model = CheckDeployment(loaded, *other.ir, target);
  CHECK(wrong_model.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(wrong_model.message()), Catch::Contains("another model"));

  v1::Deployment future = loaded;
  future.set_format_version(2);
  CHECK(CheckDeployment(future, *f.ir, target).code() == absl::StatusCode::kInvalidArgument);
}

// Found by //fuzz:deployment: a client's deployment file could crash the daemon (the
// micro-batches times a stage's replicas wrapped around 32 bits to 0, a division by zero), and
// passed with a device twice or a NaN memory margin.
TEST_CASE("Deployments a client could craft are refused, not divided by", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  PlanTarget target = Target(4, 1ull << 30);
  absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs, target, {},
                                               Config({{"partition_num", "2"}}), nullptr, "t");
  REQUIRE(d.ok());
  REQUIRE(d->stages_size() == 2);
  REQUIRE(CheckDeployment(*d, *f.ir, target).ok());

  v1::Deployment wraps = *d;
  wraps.set_micro_batches(1u << 31);
  wraps.set_batch_size(int64_t{1} << 62);
  wraps.mutable_stages(0)->clear_devices();
  wraps.mutable_stages(0)->add_devices(0);
  wraps.mutable_stages(0)->add_devices(1);  // 2^31 x 2 replicas: 0 in 32 bits
  wraps.mutable_stages(1)->clear_devices();
  wraps.mutable_stages(1)->add_devices(2);
  absl::Status huge = CheckDeployment(wraps, *f.ir, target);
  CHECK(huge.code() == absl::StatusCode::kResourceExhausted);  // 2^30 samples a device: no fit

  v1::Deployment twice = *d;
  twice.mutable_stages(1)->clear_devices();
  twice.mutable_stages(1)->add_devices(d->stages(0).devices(0));
  absl::Status dup = CheckDeployment(twice, *f.ir, target);
  CHECK(dup.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(dup.message()), Catch::Contains("twice"));

  v1::Deployment nan = *d;
  nan.set_mem_margin(std::nan(""));
  CHECK(CheckDeployment(nan, *f.ir, target).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("A second plan of the same model reads its profiles from the cache", "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/plan_cache.tsv";
  ProfileCache cache(path);
  absl::StatusOr<v1::Deployment> first = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                   Target(2, 1ull << 30), {}, Config({}), &cache, "t");
  REQUIRE(first.ok());
  const size_t entries = cache.size();
  CHECK(entries > 0);
  absl::StatusOr<v1::Deployment> second = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                    Target(2, 1ull << 30), {}, Config({}), &cache, "t");
  REQUIRE(second.ok());
  CHECK(cache.size() == entries);
  CHECK(second->stages_size() == first->stages_size());
  CHECK(second->micro_batches() == first->micro_batches());
}

TEST_CASE("Offload plans no optimizer state on the devices, batch-independent bytes included",
          "[planner]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  // One cache, so both plans see the same blocks and profiles.
  ProfileCache cache(std::string(std::getenv("TEST_TMPDIR")) + "/offload_cache.tsv");
  const MemoryModel adam = Adam(false);
  const MemoryModel offload = Adam(true);
  const PlannerConfig config =
      Config({{"partition_num", "2"}, {"replica_num", "1"}, {"pipeline_num", "2"}});
  absl::StatusOr<v1::Deployment> kept = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                  Target(2, 1ull << 30), adam, config, &cache, "t");
  absl::StatusOr<v1::Deployment> host = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                  Target(2, 1ull << 30), offload, config, &cache, "t");
  REQUIRE(kept.ok());
  REQUIRE(host.ok());
  CHECK(host->offload());
  REQUIRE(kept->stages_size() == 2);
  REQUIRE(host->stages_size() == 2);
  std::map<std::string, int> index;
  for (size_t i = 0; i < f.ir->tensor_names.size(); ++i) index[f.ir->tensor_names[i]] = i;
  for (int s = 0; s < 2; ++s) {
    const v1::DeploymentStage& a = kept->stages(s);
    const v1::DeploymentStage& b = host->stages(s);
    REQUIRE(a.first_node() == b.first_node());
    // The stage's trainable bytes, each tensor once (a tied weight is one tensor).
    std::set<const void*> seen;
    uint64_t trainable = 0;
    for (const std::string& name : a.params()) {
      const at::Tensor& t = f.tensors[index.at(name)];
      if (t.requires_grad() && seen.insert(t.unsafeGetTensorImpl()).second) {
        trainable += t.numel() * t.element_size();
      }
    }
    INFO("stage " << s << ": trainable " << trainable << ", memory " << a.memory_bytes()
                  << " / " << b.memory_bytes() << ", fixed " << a.fixed_bytes() << " / "
                  << b.fixed_bytes());
    REQUIRE(trainable > 0);
    // Adam's two moments stay in host memory; nothing else changes.
    CHECK(a.memory_bytes() - b.memory_bytes() == 2 * trainable);
    CHECK(a.fixed_bytes() - b.fixed_bytes() == 2 * trainable);
    // Parameters and optimizer state do not scale with the batch; activations do.
    CHECK(a.fixed_bytes() >= a.param_bytes() + 2 * trainable);
    CHECK(b.fixed_bytes() >= b.param_bytes());
    CHECK(a.fixed_bytes() < a.memory_bytes());
    CHECK(a.activation_bytes() == a.memory_bytes() - a.fixed_bytes());
  }
}

TEST_CASE("The streamed estimate's blocks are those the runtime streams in", "[planner]") {
  // The estimate replays ParamBlockStarts on the cost table (StreamedBlocksOf): its count of
  // blocks, the deployment's offload_blocks, must be what the runtime cuts the stage's own
  // atomic nodes into, for any block size.
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  ProfileCache cache(std::string(std::getenv("TEST_TMPDIR")) + "/streamed_cache.tsv");
  const MemoryModel offload = Adam(true);
  const uint64_t total = ParamBytes(f);
  int streamed = 0;
  for (const char* stages : {"1", "2"}) {
    for (uint64_t bytes : {uint64_t{1}, total / 23, total / 9, total / 4, total / 2, total}) {
      const PlannerConfig config = Config({{"partition_num", stages}, {"replica_num", "1"},
                                           {"pipeline_num", "1"},
                                           {"offload_block_bytes", std::to_string(bytes)}});
      absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                   Target(2, 1ull << 30), offload, config,
                                                   &cache, "t");
      REQUIRE(d.ok());
      for (const v1::DeploymentStage& s : d->stages()) {
        const std::vector<int> starts = ParamBlockStarts(
            *f.ir, s.first_node(), s.end_node(), static_cast<int64_t>(bytes));
        INFO(stages << " stages, blocks of " << bytes << " bytes, stage [" << s.first_node()
                    << ", " << s.end_node() << ")");
        CHECK(s.offload_blocks() == starts.size());
        if (starts.size() > 1) ++streamed;
      }
    }
  }
  CHECK(streamed >= 8);  // most of them streamed, one of them in a block a node
}

TEST_CASE("A streamed stage's host-link passes move the bytes its blocks hold", "[planner]") {
  // With offload_low_precision a parameter read only through a narrower cast streams in that
  // dtype (tied_lm's shared weight too: O2 casts it once for both its readers), one lifted
  // twice as wide as its master, as the runtime does (EngineOptions::offload_low_precision):
  // each pass of the stage's uploads costs those bytes, counted once per tensor, at the
  // link's speed.
  for (const char* name : {"tiny_gpt", "tied_lm"}) {
    INFO(name);
    testing::FixtureIr f = testing::BuildO2FixtureIr(name);
    REQUIRE(f.ir.ok());
    std::map<const void*, int> lifts;
    for (const at::Tensor& t : f.tensors) ++lifts[t.unsafeGetTensorImpl()];
    double master = 0, wire = 0;
    std::set<const void*> seen;
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      const at::Tensor& t = f.tensors[i];
      if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      const std::optional<at::ScalarType> low = LowPrecisionRead(*f.ir, static_cast<int>(i));
      const bool once = lifts[t.unsafeGetTensorImpl()] == 1;
      master += static_cast<double>(t.nbytes());
      const at::ScalarType streamed = low && once ? *low : t.scalar_type();
      wire += static_cast<double>(t.numel() * at::elementSize(streamed));
    }
    CHECK(wire < master);
    ProfileCache cache("");  // both plans time the same profiles
    double fwd[2], bwd[2];
    for (int low : {0, 1}) {
      const PlannerConfig config = Config(
          {{"partition_num", "1"}, {"replica_num", "1"}, {"pipeline_num", "1"},
           {"offload_block_bytes", "1"}, {"offload_keep_on_device", "false"},
           {"offload_low_precision", low ? "true" : "false"}});
      absl::StatusOr<v1::Deployment> d = PlanModel(*f.ir, f.tensors, f.fixture.inputs,
                                                   Target(1, 1ull << 30), Adam(true), config,
                                                   &cache, "t");
      REQUIRE(d.ok());
      REQUIRE(d->stages_size() == 1);
      REQUIRE(d->stages(0).offload_blocks() > 1);
      fwd[low] = d->stages(0).fwd_ms();
      bwd[low] = d->stages(0).bwd_ms();
    }
    // A CPU device's uploads are on its own thread, once before each block's forward and once
    // before its backward, at Target's 10 GB/s (no host link given: p2p's).
    const double saved_ms = (master - wire) / 10e9 * 1000.0;
    CHECK(fwd[0] - fwd[1] == Approx(saved_ms).epsilon(1e-6));
    CHECK(bwd[0] - bwd[1] == Approx(saved_ms).epsilon(1e-6));
  }
}

TEST_CASE("A deep model is planned from one layer's profiles", "[planner]") {
  FixtureIr f = BuildFixtureIr("deep_gpt");
  REQUIRE(f.ir.ok());
  ProfileCache cache("");
  MemoryModel adam;
  adam.optimizer = "adam";
  adam.optimizer_state_factor = 2;
  // Memory for about half the model per device: a pipeline of stages cut between blocks.
  const uint64_t memory = static_cast<uint64_t>(ParamBytes(f) * 4 / 0.9 * 0.6);
  absl::StatusOr<v1::Deployment> d =
      PlanModel(*f.ir, f.tensors, f.fixture.inputs, Target(4, memory), adam,
                Config({{"verify_partitioning", "true"}}), &cache, "t");
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  INFO(DescribeDeployment(*d));
  CHECK(d->stages_size() >= 2);
  CheckCoversModel(*d, *f.ir, 4);
  // 157 atomic nodes, six of them layers alike: the cache holds one layer's node times and
  // pieces, not every node's.
  const size_t nodes = f.ir->nodes.size();
  CHECK(nodes > 150);
  CHECK(cache.size() < nodes / 2);
  // The same plan with every micro-batch size profiled (those records come from the cache or
  // are new sizes): a plan of the same shape.
  absl::StatusOr<v1::Deployment> all =
      PlanModel(*f.ir, f.tensors, f.fixture.inputs, Target(4, memory), adam,
                Config({{"profile_all_sizes", "true"}}), &cache, "t");
  REQUIRE(all.ok());
  CheckCoversModel(*all, *f.ir, 4);
}

TEST_CASE("PlannerConfigFromKeys reads the planner keys and names a bad one", "[planner]") {
  absl::StatusOr<PlannerConfig> c = PlannerConfigFromKeys(
      {{"partition_num", "2"}, {"mem_margin", "0.25"}, {"schedule", "GPipe"},
       {"max_pipeline", "8"}, {"unrelated", "x"}, {"profile_all_sizes", "true"}});
  REQUIRE(c.ok());
  CHECK(c->profile_all_sizes);
  CHECK_FALSE(PlannerConfigFromKeys({})->profile_all_sizes);
  CHECK(c->partition_num == 2);
  CHECK(c->mem_margin == 0.25);
  CHECK(c->schedule == Schedule::kGPipe);
  CHECK(c->max_pipeline == 8);
  for (auto [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"partition_num", "two"}, {"replica_num", "-1"}, {"mem_margin", "1.5"},
           {"schedule", "zigzag"}, {"verify_partitioning", "maybe"}, {"max_pipeline", "0"},
           {"use_all_devices", "some"}, {"profile_all_sizes", "2"}}) {
    absl::StatusOr<PlannerConfig> bad = PlannerConfigFromKeys({{key, value}});
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(bad.status().message()), Catch::Contains(key));
  }
}

}  // namespace
}  // namespace planner
}  // namespace rannc
