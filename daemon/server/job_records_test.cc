#include "daemon/server/job_records.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/records-", ::getpid(), "-", rand());
  std::filesystem::create_directories(dir);
  return dir;
}

TEST_CASE("a job's record is saved, listed, found by id or name, loaded and removed") {
  const std::string dir = TempDir();
  JobRecords records(dir);
  REQUIRE(records.enabled());
  v1::JobSpec spec;
  spec.set_name("gpt");
  (*spec.mutable_options()->mutable_config())["checkpoint_dir"] = "/ckpt";
  spec.add_example_inputs();  // not kept in the record: the tensors are
  v1::Deployment plan;
  plan.set_num_devices(2);
  const at::Tensor x = at::randn({4, 3});
  const at::Tensor w = at::randn({3, 3});
  REQUIRE(records.Save("job-1", spec, "archive bytes", {x}, {{"w", w}}, plan).ok());
  spec.set_name("other");
  REQUIRE(records.Save("job-2", spec, "more", {x}, {}, plan).ok());

  std::vector<v1::JobRecord> all = records.List();
  REQUIRE(all.size() == 2);
  CHECK(records.Find("gpt")->job_id() == "job-1");
  CHECK(records.Find("job-2")->name() == "other");
  CHECK(records.Find("nothing").status().code() == absl::StatusCode::kNotFound);

  absl::StatusOr<JobRecords::Loaded> loaded = records.Load("gpt");
  REQUIRE(loaded.ok());
  CHECK(loaded->model_bytes == "archive bytes");
  CHECK(loaded->record.spec().example_inputs_size() == 0);
  CHECK(loaded->record.deployment().num_devices() == 2);
  REQUIRE(loaded->example_inputs.size() == 1);
  CHECK(at::equal(loaded->example_inputs[0], x));
  CHECK(at::equal(loaded->sent.at("w"), w));

  REQUIRE(records.Remove("job-1").ok());
  CHECK(records.List().size() == 1);
  CHECK(records.Remove("job-1").ok());  // already gone
  std::filesystem::remove_all(dir);
}

TEST_CASE("without a state directory nothing is kept") {
  JobRecords records("");
  CHECK(!records.enabled());
  CHECK(records.Save("job-1", v1::JobSpec(), "x", {}, {}, v1::Deployment()).ok());
  CHECK(records.List().empty());
  CHECK(records.Find("job-1").status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace rannc
