#include "daemon/server/detached_data.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

void Save(const c10::IValue& value, const std::string& path) {
  const std::vector<char> bytes = torch::jit::pickle_save(value);
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

v1::DetachedJobSpec DatasetSpec(const std::string& path, int64_t batch) {
  v1::DetachedJobSpec spec;
  spec.set_dataset_path(path);
  spec.set_batch(batch);
  spec.set_seed(3);
  return spec;
}

TEST_CASE("A dataset's epochs are permutations of its rows, and Skip lands where Next would") {
  const std::string path = TempPath("rows.pt");
  // Row i holds i: a batch says which rows it took.
  const at::Tensor rows = at::arange(10, at::kLong);
  Save(c10::ivalue::Tuple::create({rows, rows.to(at::kFloat).view({10, 1}) * 2}), path);
  absl::StatusOr<std::unique_ptr<BatchSource>> data = OpenTrainingData(DatasetSpec(path, 3));
  INFO(data.status().ToString());
  REQUIRE(data.ok());
  CHECK((*data)->InputNames() == std::vector<std::string>{"input_0", "input_1"});
  std::vector<std::vector<int64_t>> epochs;
  std::vector<std::vector<at::Tensor>> batches;
  for (int b = 0; b < 9; ++b) {  // 3 batches an epoch (a row dropped), 3 epochs
    std::vector<at::Tensor> batch = (*data)->Next();
    REQUIRE(batch.size() == 2);
    CHECK(at::equal(batch[1].view(-1), batch[0].to(at::kFloat) * 2));  // rows stay together
    if (b % 3 == 0) epochs.emplace_back();
    for (int64_t i = 0; i < 3; ++i) epochs.back().push_back(batch[0][i].item<int64_t>());
    batches.push_back(batch);
  }
  // The order of epoch e is the e-th torch.randperm(10) of one generator seeded 3.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (const std::vector<int64_t>& epoch : epochs) {
    const at::Tensor perm = at::randperm(10, gen);
    for (size_t i = 0; i < epoch.size(); ++i) CHECK(epoch[i] == perm[i].item<int64_t>());
    CHECK(std::set<int64_t>(epoch.begin(), epoch.end()).size() == epoch.size());
  }
  CHECK(epochs[0] != epochs[1]);
  for (int skip : {0, 2, 3, 4, 7}) {
    INFO("skip " << skip);
    absl::StatusOr<std::unique_ptr<BatchSource>> again = OpenTrainingData(DatasetSpec(path, 3));
    REQUIRE(again.ok());
    (*again)->Skip(skip);
    CHECK(at::equal((*again)->Next()[0], batches[skip][0]));
  }
  (*data)->Reset();
  CHECK(at::equal((*data)->Next()[0], batches[0][0]));
}

TEST_CASE("A held-out dataset goes in order and must match the training set's samples") {
  const std::string train = TempPath("train.pt"), held = TempPath("held.pt"),
                    other = TempPath("other.pt");
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("x", at::arange(12, at::kFloat).view({6, 2}));
  dict.insert("y", at::arange(6, at::kLong));
  Save(dict, train);
  Save(dict, held);
  Save(c10::ivalue::Tuple::create({at::zeros({6, 3}), at::zeros({6}, at::kLong)}), other);
  v1::DetachedJobSpec spec = DatasetSpec(train, 2);
  spec.set_eval_dataset_path(held);
  spec.set_eval_batches(5);
  absl::StatusOr<std::unique_ptr<BatchSource>> data = OpenTrainingData(spec);
  REQUIRE(data.ok());
  CHECK((*data)->InputNames() == std::vector<std::string>{"x", "y"});
  absl::StatusOr<std::unique_ptr<BatchSource>> eval = OpenEvalData(spec, **data);
  INFO(eval.status().ToString());
  REQUIRE(eval.ok());
  CHECK(EvalBatches(spec, **eval) == 3);  // 6 samples: 3 whole batches of 2, not 5
  for (int64_t b = 0; b < 3; ++b) {
    CHECK(at::equal((*eval)->Next()[1], at::arange(2 * b, 2 * b + 2, at::kLong)));
  }
  spec.set_eval_dataset_path(other);
  eval = OpenEvalData(spec, **data);
  CHECK(eval.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(eval.status().message()),
             Catch::Contains("eval_dataset") && Catch::Contains("are not the dataset's"));
}

TEST_CASE("Data that is not what the spec says is refused naming the field") {
  const std::string path = TempPath("bad.pt");
  SECTION("neither or both kinds") {
    v1::DetachedJobSpec spec;
    spec.set_batch(2);
    CHECK(OpenTrainingData(spec).status().code() == absl::StatusCode::kInvalidArgument);
    spec.set_tokens_path("a.bin");
    spec.set_dataset_path("b.pt");
    CHECK(OpenTrainingData(spec).status().code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("a missing file") {
    absl::StatusOr<std::unique_ptr<BatchSource>> data =
        OpenTrainingData(DatasetSpec(TempPath("missing.pt"), 2));
    CHECK(data.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(std::string(data.status().message()), Catch::Contains("dataset"));
  }
  SECTION("a file of something else") {
    Save(c10::IValue(int64_t{7}), path);
    CHECK_THAT(std::string(OpenTrainingData(DatasetSpec(path, 2)).status().message()),
               Catch::Contains("dataset: ") && Catch::Contains("holds a Int"));
  }
  SECTION("rows that differ in number") {
    Save(c10::ivalue::Tuple::create({at::zeros({4, 2}), at::zeros({3})}), path);
    CHECK_THAT(std::string(OpenTrainingData(DatasetSpec(path, 2)).status().message()),
               Catch::Contains("not one row per sample of 4"));
  }
  SECTION("fewer samples than a batch") {
    Save(c10::ivalue::Tuple::create({at::zeros({4, 2})}), path);
    CHECK_THAT(std::string(OpenTrainingData(DatasetSpec(path, 8)).status().message()),
               Catch::Contains("fewer than a batch (8)"));
  }
}

TEST_CASE("Every value a dataset gives an indexing input is checked, not one batch's") {
  const std::string path = TempPath("labels.pt");
  at::Tensor labels = at::zeros({40}, at::kLong);
  labels[33] = 5;   // past 3 classes
  labels[7] = -100;  // the loss's ignore_index
  Save(c10::ivalue::Tuple::create({at::zeros({40, 2}), labels}), path);
  absl::StatusOr<std::unique_ptr<BatchSource>> data = OpenTrainingData(DatasetSpec(path, 4));
  REQUIRE(data.ok());
  CHECK((*data)->CheckRange(0, 3, std::nullopt, "classes").ok());  // floating: indexes nothing
  absl::Status bad = (*data)->CheckRange(1, 3, int64_t{-100}, "the 3 classes of the loss");
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(bad.message()),
             Catch::Contains("dataset: ") && Catch::Contains("'input_1' holds 5 in sample 33") &&
                 Catch::Contains("outside the 3 classes of the loss"));
  labels[33] = 2;
  Save(c10::ivalue::Tuple::create({at::zeros({40, 2}), labels}), path);
  data = OpenTrainingData(DatasetSpec(path, 4));
  REQUIRE(data.ok());
  CHECK((*data)->CheckRange(1, 3, int64_t{-100}, "classes").ok());
  CHECK_THAT(std::string((*data)->CheckRange(1, 3, std::nullopt, "classes").message()),
             Catch::Contains("holds -100 in sample 7"));
}

TEST_CASE("The prefetcher hands the source's batches over in its order") {
  const std::string path = TempPath("prefetch.pt");
  Save(c10::ivalue::Tuple::create({at::arange(20, at::kLong)}), path);
  absl::StatusOr<std::unique_ptr<BatchSource>> a = OpenTrainingData(DatasetSpec(path, 4));
  absl::StatusOr<std::unique_ptr<BatchSource>> b = OpenTrainingData(DatasetSpec(path, 4));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  BatchPrefetcher ahead(std::move(*a), 3);
  for (int i = 0; i < 12; ++i) CHECK(at::equal(ahead.Next()[0], (*b)->Next()[0]));
}

}  // namespace
}  // namespace rannc
