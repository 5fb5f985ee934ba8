#include "daemon/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "daemon/checkpoint/checkpoint_writer.h"

namespace rannc {
namespace checkpoint {
namespace {

namespace fs = std::filesystem;

std::string TempDir() {
  std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp",
                                 "/ckpt-", ::getpid(), "-", rand());
  fs::create_directories(dir);
  return dir;
}

Piece Whole(v1::CheckpointEntry::Kind kind, std::string name, at::Tensor value,
            std::string key = "") {
  Piece p;
  p.kind = kind;
  p.name = std::move(name);
  p.state_key = std::move(key);
  p.value = std::move(value);
  return p;
}

// A model of two parameters (one tied under a second name) and a buffer, with Adam state; the
// exp_avg of "w" is written as two slices in two files, as ZeRO's replicas hold it.
Snapshot MakeSnapshot(int64_t step, const at::Tensor& w, const at::Tensor& b) {
  Snapshot s;
  s.manifest.set_job_name("tiny");
  s.manifest.set_step(step);
  s.manifest.set_optimizer("adam");
  for (const char* key : {"w", "tied.w", "b", "running"}) s.manifest.add_state_keys(key);
  for (const char* entry : {"w", "w", "b", "running"}) s.manifest.add_state_entries(entry);
  v1::ParamGroup* group = s.manifest.add_param_groups();
  group->add_params("w");
  group->add_params("b");
  group->mutable_hyper()->set_lr(0.01);
  group->mutable_hyper()->set_beta1(0.9);
  group->mutable_hyper()->set_beta2(0.999);
  group->mutable_hyper()->set_eps(1e-8);
  const at::Tensor exp_avg = at::arange(6, at::kFloat).view({2, 3}) / 10;
  s.files.resize(2);
  s.files[0].push_back(Whole(v1::CheckpointEntry::PARAM, "w", w));
  s.files[0].push_back(Whole(v1::CheckpointEntry::BUFFER, "running", at::ones({3})));
  s.files[0].push_back(Whole(v1::CheckpointEntry::OPTIMIZER_STATE, "w", at::tensor(3.0), "step"));
  Piece first = Whole(v1::CheckpointEntry::OPTIMIZER_STATE, "w",
                      exp_avg.view(-1).narrow(0, 0, 4).clone(), "exp_avg");
  first.shape = {2, 3};
  s.files[0].push_back(first);
  Piece second = Whole(v1::CheckpointEntry::OPTIMIZER_STATE, "w",
                       exp_avg.view(-1).narrow(0, 4, 2).clone(), "exp_avg");
  second.shape = {2, 3};
  second.offset = 4;
  s.files[1].push_back(second);
  s.files[1].push_back(Whole(v1::CheckpointEntry::PARAM, "b", b));
  return s;
}

void Corrupt(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(fs::file_size(path) / 2));
  f.put('\x5a');
}

TEST_CASE("a checkpoint reads back whole, slices assembled, and exports for torch.load") {
  const std::string dir = TempDir();
  absl::StatusOr<std::string> job = JobDir(dir, "tiny");
  REQUIRE(job.ok());
  const at::Tensor w = at::randn({2, 3});
  const at::Tensor b = at::randn({3});
  absl::StatusOr<v1::CheckpointManifest> written = WriteCheckpoint(*job, MakeSnapshot(5, w, b));
  REQUIRE(written.ok());
  CHECK(written->files_size() == 2);
  CHECK(fs::exists(StepDir(*job, 5) + "/manifest.json"));

  absl::StatusOr<v1::CheckpointManifest> found = FindCheckpoint(*job, 0);
  REQUIRE(found.ok());
  absl::StatusOr<Contents> read = ReadCheckpoint(*job, *found);
  REQUIRE(read.ok());
  CHECK(at::equal(read->tensors.at("w"), w));
  CHECK(at::equal(read->tensors.at("b"), b));
  REQUIRE(read->optimizer.size() == 2);
  CHECK(read->optimizer[1].key == "exp_avg");
  CHECK(at::equal(read->optimizer[1].value, at::arange(6, at::kFloat).view({2, 3}) / 10));

  // Each tensor file opens on its own (torch.load reads the same format).
  const std::string file = StepDir(*job, 5) + "/daemon-0.pt";
  std::ifstream in(file, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(torch::jit::pickle_load(bytes).toGenericDict().contains("param/w"));

  absl::StatusOr<std::vector<char>> exported = ExportCheckpoint(*found, *read);
  REQUIRE(exported.ok());
  c10::impl::GenericDict top = torch::jit::pickle_load(*exported).toGenericDict();
  c10::impl::GenericDict model = top.at("model").toGenericDict();
  CHECK(model.size() == 4);
  CHECK(at::equal(model.at("tied.w").toTensor(), w));
  c10::impl::GenericDict optimizer = top.at("optimizer").toGenericDict();
  c10::impl::GenericDict state = optimizer.at("state").toGenericDict();
  CHECK(state.size() == 1);  // "b" has no state yet
  CHECK(state.at(int64_t{0}).toGenericDict().contains("exp_avg"));
  CHECK(optimizer.at("param_groups").toList().size() == 1);
  fs::remove_all(dir);
}

TEST_CASE("listing, finding a step, and keeping the newest") {
  const std::string dir = TempDir();
  const std::string job = *JobDir(dir, "tiny");
  for (int64_t step : {5, 10, 15}) {
    REQUIRE(WriteCheckpoint(job, MakeSnapshot(step, at::randn({2, 3}), at::randn({3}))).ok());
  }
  // A write that never committed (a crash mid-write) is not a checkpoint.
  fs::create_directories(job + "/.step-0000000020.tmp-1-2");
  std::vector<v1::CheckpointManifest> all = ListCheckpoints(job);
  REQUIRE(all.size() == 3);
  CHECK(all.front().step() == 5);
  CHECK(FindCheckpoint(job, 10)->step() == 10);
  absl::StatusOr<v1::CheckpointManifest> missing = FindCheckpoint(job, 7);
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(missing.status().message()).find("5, 10, 15") != std::string::npos);

  REQUIRE(PruneCheckpoints(job, 2).ok());
  all = ListCheckpoints(job);
  REQUIRE(all.size() == 2);
  CHECK(all.front().step() == 10);
  CHECK(!fs::exists(job + "/.step-0000000020.tmp-1-2"));
  CHECK(FindCheckpoint(*JobDir(dir, "other"), 0).status().code() == absl::StatusCode::kNotFound);
  CHECK(JobDir(dir, "../x").status().code() == absl::StatusCode::kInvalidArgument);
  fs::remove_all(dir);
}

TEST_CASE("a corrupted or truncated tensor file is DATA_LOSS naming it") {
  const std::string dir = TempDir();
  const std::string job = *JobDir(dir, "tiny");
  REQUIRE(WriteCheckpoint(job, MakeSnapshot(5, at::randn({2, 3}), at::randn({3}))).ok());
  const v1::CheckpointManifest manifest = *FindCheckpoint(job, 5);
  const std::string file = StepDir(job, 5) + "/daemon-1.pt";

  Corrupt(file);
  absl::StatusOr<Contents> read = ReadCheckpoint(job, manifest);
  CHECK(read.status().code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(read.status().message()).find("daemon-1.pt") != std::string::npos);

  fs::resize_file(file, fs::file_size(file) - 7);
  read = ReadCheckpoint(job, manifest);
  CHECK(read.status().code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(read.status().message()).find("truncated") != std::string::npos);
  fs::remove_all(dir);
}

// Found by //fuzz:checkpoint_manifest: a manifest is read from storage others may write, and
// its shapes, slices and file names were trusted (a negative dimension threw out of the reader;
// a slice's offset could wrap; two overlapping slices that summed to the whole passed).
TEST_CASE("a manifest whose shapes, slices or file names are impossible is DATA_LOSS") {
  const std::string dir = TempDir();
  const std::string job = *JobDir(dir, "tiny");
  REQUIRE(WriteCheckpoint(job, MakeSnapshot(5, at::randn({2, 3}), at::randn({3}))).ok());
  const v1::CheckpointManifest good = *FindCheckpoint(job, 5);
  REQUIRE(ReadCheckpoint(job, good).ok());
  auto entry = [&](v1::CheckpointManifest* m, const std::string& key) {
    for (v1::CheckpointEntry& e : *m->mutable_entries()) {
      if (e.file_key() == key) return &e;
    }
    FAIL("no entry " << key);
    return static_cast<v1::CheckpointEntry*>(nullptr);
  };
  auto fails = [&](const v1::CheckpointManifest& m, const std::string& says) {
    absl::StatusOr<Contents> read = ReadCheckpoint(job, m);
    INFO(read.status().ToString());
    CHECK(read.status().code() == absl::StatusCode::kDataLoss);
    CHECK(std::string(read.status().message()).find(says) != std::string::npos);
  };

  v1::CheckpointManifest m = good;
  entry(&m, "param/w")->set_shape(0, -2);
  entry(&m, "param/w")->set_shape(1, -3);
  fails(m, "impossible shape [-2, -3]");

  m = good;
  entry(&m, "param/w")->set_shape(0, int64_t{1} << 62);
  fails(m, "impossible shape");

  m = good;  // offset + numel wraps around to 0
  entry(&m, "optim/w/exp_avg@4")->set_offset(~uint64_t{0} - 1);
  fails(m, "does not match its manifest entry");

  m = good;  // [0, 4) and [2, 4): 6 elements in all, as many as the whole, but not a tiling
  entry(&m, "optim/w/exp_avg@4")->set_offset(2);
  fails(m, "overlap at element 2");

  m = good;
  entry(&m, "optim/w/exp_avg@4")->set_shape(0, 3);  // [3, 3] here, [2, 3] in the other
  fails(m, "differ in shape or dtype");

  m = good;  // a file outside the checkpoint's directory
  const std::string outside = "../" + m.files(0).path();
  m.mutable_files(0)->set_path(outside);
  for (v1::CheckpointEntry& e : *m.mutable_entries()) {
    if (e.file() == good.files(0).path()) e.set_file(outside);
  }
  fails(m, "not a file name in that directory");

  // A FIFO in the file's place fails at once instead of waiting for a writer.
  const std::string file = StepDir(job, 5) + "/" + good.files(1).path();
  REQUIRE(::unlink(file.c_str()) == 0);
  REQUIRE(::mkfifo(file.c_str(), 0600) == 0);
  fails(good, "not a regular file");
  fs::remove_all(dir);
}

TEST_CASE("a write that fails leaves the committed checkpoints whole") {
  const std::string dir = TempDir();
  const std::string job = *JobDir(dir, "tiny");
  const at::Tensor w = at::randn({2, 3});
  REQUIRE(WriteCheckpoint(job, MakeSnapshot(5, w, at::randn({3}))).ok());
  // Rewriting a step replaces it as one commit.
  const at::Tensor w2 = at::randn({2, 3});
  REQUIRE(WriteCheckpoint(job, MakeSnapshot(5, w2, at::randn({3}))).ok());
  CHECK(at::equal(ReadCheckpoint(job, *FindCheckpoint(job, 5))->tensors.at("w"), w2));

  // A checkpoint directory that cannot be written (here: a file where it should be).
  const std::string blocked = dir + "/blocked";
  std::ofstream(blocked) << "not a directory";
  absl::StatusOr<v1::CheckpointManifest> failed =
      WriteCheckpoint(blocked + "/tiny", MakeSnapshot(10, w, at::randn({3})));
  CHECK(!failed.ok());
  CHECK(std::string(failed.status().message()).find(blocked) != std::string::npos);

  {
    CheckpointWriter writer;
    writer.Start(blocked + "/tiny", MakeSnapshot(10, w, at::randn({3})), 2);
    CHECK(!writer.Wait().ok());
    CHECK(!writer.last_error().empty());
    writer.Start(job, MakeSnapshot(10, w, at::randn({3})), 1);
    absl::StatusOr<CheckpointWriter::Result> done = writer.Wait();
    REQUIRE(done.ok());
    CHECK(done->bytes > 0);
    CHECK(writer.last_error().empty());
    CHECK(ListCheckpoints(job).size() == 1);  // keep = 1
  }  // the writer's deletion of step 5 ends
  fs::remove_all(dir);
}

TEST_CASE("the writer answers before deleting what it pruned; the next write is not taken for "
          "a leftover") {
  const std::string dir = TempDir();
  const std::string job = *JobDir(dir, "tiny");
  fs::create_directories(job + "/.step-0000000003.tmp-1-2");  // a crash's leftover
  {
    CheckpointWriter writer;
    for (int64_t step = 5; step <= 100; step += 5) {
      // As Job::CheckpointLocked does: the directory is begun as soon as the last write answered,
      // while that write may still be deleting the checkpoints it pruned.
      absl::StatusOr<std::string> begun = BeginCheckpoint(job, step);
      REQUIRE(begun.ok());
      writer.Start(job, MakeSnapshot(step, at::randn({64, 64}), at::randn({64})), 2, *begun);
      absl::StatusOr<CheckpointWriter::Result> done = writer.Wait();
      REQUIRE(done.ok());
      CHECK(done->manifest.step() == step);
      // The pruned ones are out of the listing by the answer.
      std::vector<v1::CheckpointManifest> all = ListCheckpoints(job);
      REQUIRE(all.size() == (step == 5 ? 1u : 2u));
      CHECK(all.back().step() == step);
    }
    writer.Start(job, MakeSnapshot(105, at::randn({64, 64}), at::randn({64})), 2);
    REQUIRE(writer.Wait().ok());
  }  // the writer's deletion of step 95 ends
  // Every deletion, overlapping the next write or not, ended with the writer: nothing hidden left.
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(job)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-0000000100", "step-0000000105"});

  // Retire and RemoveRetired, PruneCheckpoints's halves.
  absl::StatusOr<std::vector<std::string>> retired = RetireCheckpoints(job, 1);
  REQUIRE(retired.ok());
  REQUIRE(retired->size() == 1);  // step 100's (the leftover went with the first prune)
  CHECK(ListCheckpoints(job).size() == 1);
  CHECK(fs::exists((*retired)[0]));
  REQUIRE(RemoveRetired(*retired).ok());
  CHECK(!fs::exists((*retired)[0]));
  CHECK(!fs::exists(job + "/.step-0000000003.tmp-1-2"));
  fs::remove_all(dir);
}

TEST_CASE("HasRoomFor asks the filesystem of the nearest directory that exists") {
  const std::string dir = TempDir();
  CHECK(HasRoomFor(dir, 1));
  CHECK(HasRoomFor(dir + "/job/not/made/yet", 1));
  const fs::space_info space = fs::space(dir);
  CHECK_FALSE(HasRoomFor(dir, space.available));  // the margin is 10% and 1 GiB
  CHECK_FALSE(HasRoomFor(dir + "/job", uint64_t{1} << 62));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace checkpoint
}  // namespace rannc
