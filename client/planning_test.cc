// `rannc plan`'s helpers without a daemon: byte sizes, input specs, example inputs, and reading
// and printing deployment files.
#include "client/planning.h"

#include <catch2/catch.hpp>
#include <regex>

namespace rannc {
namespace {

TEST_CASE("ParseByteSize", "[planning]") {
  const std::vector<std::pair<std::string, uint64_t>> good = {
      {"0", 0},
      {"1024", 1024},
      {" 1024 ", 1024},
      {"10B", 10},
      {"1KB", 1000},
      {"1kib", 1024},
      {"512MiB", 512ull << 20},
      {"512 MiB", 512ull << 20},
      {"80GiB", 80ull << 30},
      {"1.5GB", 1500000000},
      {"1.5GiB", 1610612736},
      {"1e9", 1000000000},
      {"2.5e3", 2500},
      {"1e1KiB", 10240},
      {".5KiB", 512},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& [text, bytes] : good) {
    INFO(text);
    absl::StatusOr<uint64_t> parsed = ParseByteSize(text);
    INFO(parsed.status().ToString());
    REQUIRE(parsed.ok());
    CHECK(*parsed == bytes);
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"-1", "negative"},
      {"GiB", "no number"},
      {"2XB", "unknown unit 'XB'"},
      {"2 G", "unknown unit 'G'"},
      {"1.2.3", "not a number"},
      {"18446744073709551616", "larger than"},
      {"20000000TiB", "larger than"},
      {"1e30", "larger than"},
  };
  for (const auto& [text, why] : bad) {
    INFO(text);
    absl::StatusOr<uint64_t> parsed = ParseByteSize(text);
    REQUIRE(!parsed.ok());
    CHECK_THAT(std::string(parsed.status().message()),
               Catch::Contains(why) && Catch::Contains("'" + text + "'"));
  }
}

TEST_CASE("ParseInputSpec and MakeExampleInput", "[planning]") {
  absl::StatusOr<InputSpec> ids = ParseInputSpec("int64:64x1024");
  REQUIRE(ids.ok());
  CHECK(ids->dtype == v1::INT64);
  CHECK(ids->shape == std::vector<int64_t>{64, 1024});

  std::mt19937_64 rng(0);
  HostTensor t = MakeExampleInput(*ids, 8, rng);  // dim 0 replaced by the batch
  REQUIRE(t.Validate().ok());
  CHECK(t.shape == std::vector<int64_t>{8, 1024});
  CHECK(t.data == std::string(8 * 1024 * 8, '\0'));  // integers are zeros
  CHECK(MakeExampleInput(*ids, 0, rng).shape == std::vector<int64_t>{64, 1024});

  absl::StatusOr<InputSpec> x = ParseInputSpec("float32:1000x3");
  REQUIRE(x.ok());
  HostTensor f = MakeExampleInput(*x, 0, rng);
  absl::StatusOr<std::vector<float>> values = f.ToVector<float>();
  REQUIRE(values.ok());
  double sum = 0, sq = 0;
  for (float v : *values) {
    sum += v;
    sq += v * v;
  }
  const double n = static_cast<double>(values->size());
  CHECK(std::abs(sum / n) < 0.1);               // standard normal: mean near 0
  CHECK(std::abs(sq / n - 1.0) < 0.1);          // and variance near 1
  CHECK(MakeExampleInput(*ParseInputSpec("bfloat16:4"), 0, rng).Validate().ok());
  CHECK(ParseInputSpec("bool:2,3")->shape == std::vector<int64_t>{2, 3});

  for (const char* bad : {"int64", "complex64:3", "float32:", "float32:3x0", "float32:3xa"}) {
    INFO(bad);
    absl::StatusOr<InputSpec> parsed = ParseInputSpec(bad);
    REQUIRE(!parsed.ok());
    CHECK_THAT(std::string(parsed.status().message()), Catch::Contains(bad));
  }
}

v1::Deployment TwoStages() {
  v1::Deployment d;
  d.set_format_version(1);
  d.set_model_hash("abc123");
  d.set_num_nodes(10);
  d.set_batch_size(64);
  d.set_device_type("cuda");
  d.set_num_devices(5);
  d.set_device_memory_bytes(80ull << 30);
  d.set_mem_margin(0.1);
  d.set_micro_batches(4);
  d.set_estimated_step_ms(12.5);
  v1::DeploymentStage* s0 = d.add_stages();
  s0->set_index(0);
  s0->set_first_node(0);
  s0->set_end_node(6);
  s0->add_devices(0);
  s0->add_devices(1);
  s0->set_memory_bytes(1288490189);  // 1.2 GiB
  s0->add_ops("aten::linear");
  s0->add_ops("aten::tanh,aten::linear");
  s0->add_ops("aten::relu");
  s0->add_ops("aten::linear");
  v1::DeploymentStage* s1 = d.add_stages();
  s1->set_index(1);
  s1->set_first_node(6);
  s1->set_end_node(10);
  s1->add_devices(2);
  s1->add_devices(3);
  s1->set_recompute(true);
  s1->add_ops("aten::cross_entropy_loss");
  return d;
}

TEST_CASE("FormatDeployment shows micro-batch sizes per device", "[planning]") {
  const v1::Deployment d = TwoStages();
  for (const auto& [batch, micro] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 8}, {128, 16}, {8, 1}, {65, 9}, {9, 2}}) {
    INFO("batch " << batch);
    absl::StatusOr<std::string> text = FormatDeployment(d, batch);
    INFO(text.status().ToString());
    REQUIRE(text.ok());
    INFO(*text);
    const std::string m = std::to_string(micro);
    CHECK(text->find("  cuda:0 -> stage 0, micro-batch size " + m + "\n") != std::string::npos);
    CHECK(text->find("  cuda:3 -> stage 1, micro-batch size " + m + "\n") != std::string::npos);
    CHECK(text->find("  cuda:4 -> unused\n") != std::string::npos);
  }
  absl::StatusOr<std::string> text = FormatDeployment(d, 64);
  REQUIRE(text.ok());
  CHECK_THAT(*text, Catch::Contains("abc123") && Catch::Contains("5 x cuda, 80.0 GiB each") &&
                        Catch::Contains("1F1B, 4 micro-batches") &&
                        Catch::Contains("Stage 0: nodes [0, 6)") &&
                        Catch::Contains("aten::linear, aten::tanh, aten::linear, aten::relu, "
                                        "... (5 ops)") &&
                        Catch::Contains("cuda:0, cuda:1 (2 replicas)") &&
                        Catch::Contains("1.2 GiB per device") &&
                        Catch::Contains("recompute yes"));

  CHECK_THAT(*text, Catch::Contains("fwd 0.00 ms, bwd 0.00 ms per micro-batch"));
  // Nothing recorded: no provenance line, no memory split.
  CHECK_THAT(*text, !Catch::Contains("optimizer") && !Catch::Contains("created by") &&
                        !Catch::Contains("loaded from a file") && !Catch::Contains("memory:"));

  CHECK_THAT(*text, !Catch::Contains("batch kept whole"));
  v1::Deployment whole = d;
  whole.set_batch_whole("aten::batch_norm in bn (BatchNorm2d) normalizes over the batch");
  text = FormatDeployment(whole, 64);
  REQUIRE(text.ok());
  CHECK_THAT(*text, Catch::Contains("  batch kept whole: aten::batch_norm in bn (BatchNorm2d)"));

  absl::StatusOr<std::string> small = FormatDeployment(d, 7);
  REQUIRE(!small.ok());
  CHECK_THAT(std::string(small.status().message()),
             Catch::Contains("cannot run batch size 7") && Catch::Contains("at least 8"));
  CHECK(!FormatDeployment(d, 0).ok());
}

TEST_CASE("FormatDeployment shows the memory mode, the provenance and the memory split",
          "[planning]") {
  v1::Deployment d = TwoStages();
  d.set_optimizer("adam");
  d.set_zero(true);
  d.set_offload(true);
  d.set_created_by("ranncd 0.1.0 (LibTorch 1.13.1)");
  d.set_loaded(true);
  v1::DeploymentStage* s0 = d.mutable_stages(0);
  s0->set_fixed_bytes(400ull << 20);
  s0->set_param_bytes(100ull << 20);
  s0->set_activation_bytes(600ull << 20);
  s0->set_fwd_ms(1.5);
  s0->set_bwd_ms(3);
  absl::StatusOr<std::string> text = FormatDeployment(d, 64);
  REQUIRE(text.ok());
  INFO(*text);
  CHECK_THAT(*text, Catch::Contains("  estimated step time: 12.50 ms at the planned batch size "
                                    "64\n  optimizer adam + ZeRO + offload; created by ranncd "
                                    "0.1.0 (LibTorch 1.13.1); loaded from a file\n"));
  CHECK_THAT(*text, Catch::Contains("1.2 GiB per device; fwd 1.50 ms, bwd 3.00 ms per "
                                    "micro-batch\n  memory: fixed 400.0 MiB (params 100.0 MiB) "
                                    "+ activations 600.0 MiB per device\nStage 1:"));
  // Stage 1 records no split: no memory line of its own.
  CHECK(text->find("memory:") == text->rfind("memory:"));

  v1::Deployment plain = TwoStages();
  plain.set_optimizer("sgd");
  text = FormatDeployment(plain, 64);
  REQUIRE(text.ok());
  CHECK_THAT(*text, Catch::Contains("\n  optimizer sgd\nBatch size 64:\n"));
  plain.clear_optimizer();
  plain.set_zero(true);
  plain.set_created_by("rannc plan");
  text = FormatDeployment(plain, 64);
  REQUIRE(text.ok());
  CHECK_THAT(*text, Catch::Contains("\n  ZeRO; created by rannc plan\nBatch size 64:\n"));
}

TEST_CASE("ParseDeployment accepts deployments and refuses anything else", "[planning]") {
  const v1::Deployment d = TwoStages();
  absl::StatusOr<v1::Deployment> parsed = ParseDeployment(d.SerializeAsString(), "plan.pb");
  REQUIRE(parsed.ok());
  CHECK(parsed->SerializeAsString() == d.SerializeAsString());

  auto refused = [](const std::string& bytes, const std::string& why) {
    absl::StatusOr<v1::Deployment> p = ParseDeployment(bytes, "some/file.pb");
    REQUIRE(!p.ok());
    CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(p.status().message()),
               Catch::Contains("some/file.pb") && Catch::Contains(why));
  };
  refused("", "empty");
  refused("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "not a deployment file");
  v1::Deployment newer = d;
  newer.set_format_version(2);
  refused(newer.SerializeAsString(), "format_version 2");
  v1::Deployment no_version = d;
  no_version.clear_format_version();
  refused(no_version.SerializeAsString(), "no format_version");
  v1::Deployment empty = d;
  empty.clear_stages();
  refused(empty.SerializeAsString(), "no stages");
}

TEST_CASE("HumanBytes", "[planning]") {
  CHECK(HumanBytes(0) == "0 B");
  CHECK(HumanBytes(1536) == "1.5 KiB");
  CHECK(HumanBytes(80ull << 30) == "80.0 GiB");
}

}  // namespace
}  // namespace rannc
