// Fuzz target: a checkpoint's manifest, as a resumed job, `rannc checkpoints` and `rannc export`
// read it. A checkpoint directory is shared storage, and its manifest.json names the files, the
// tensors' shapes, slices and dtypes that the reader allocates and assembles by. The input is
// the manifest of a committed checkpoint whose tensor files are fixed: at start-up the target
// writes one (WriteCheckpoint) under /tmp/rannc-fuzz-checkpoint/<pid>, with parameters, a buffer,
// and AdamW state written as two ZeRO slices and a step count; each input replaces its
// manifest.json, and the checkpoint is then found (FindCheckpoint: the manifest parsed), read
// (ReadCheckpoint: each file's size and CRC-32, the entries against the files, the slices
// assembled) and exported (ExportCheckpoint: torch.optim's state_dict). Every path must end in a
// status: no crash, exception, hang or leak.
//
// The seeds (fuzz/corpus/checkpoint_manifest) are that checkpoint's own manifest and variants
// of it: RANNC_FUZZ_WRITE_SEED=FILE makes the target write the manifest it made to FILE.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/files.h"

namespace {

using rannc::checkpoint::Piece;
using rannc::v1::CheckpointEntry;

Piece Make(CheckpointEntry::Kind kind, std::string name, std::string key, at::Tensor value,
           std::vector<int64_t> shape = {}, int64_t offset = 0) {
  Piece p;
  p.kind = kind;
  p.name = std::move(name);
  p.state_key = std::move(key);
  p.value = std::move(value);
  p.shape = std::move(shape);
  p.offset = offset;
  return p;
}

// The job directory holding the fixed checkpoint (step 7), made once per process.
const std::string& JobDir() {
  static const std::string* job = [] {
    const std::string base = "/tmp/rannc-fuzz-checkpoint";
    const std::string dir = base + "/" + std::to_string(::getpid());
    if (!rannc::RemoveTree(dir).ok() || !rannc::MakeDirs(dir).ok()) std::abort();
    const at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4});
    rannc::checkpoint::Snapshot s;
    s.manifest.set_job_name("fuzz");
    s.manifest.set_step(7);
    s.manifest.set_optimizer("AdamW");
    rannc::v1::ParamGroup* group = s.manifest.add_param_groups();
    group->add_params("w");
    group->add_params("b");
    group->mutable_hyper()->set_lr(0.01);
    s.files.push_back({
        Make(CheckpointEntry::PARAM, "w", "", w),
        Make(CheckpointEntry::PARAM, "b", "", at::ones({4}, at::kDouble)),
        Make(CheckpointEntry::BUFFER, "bn.num_batches", "", at::full({}, 5, at::kLong)),
        Make(CheckpointEntry::OPTIMIZER_STATE, "w", "exp_avg", w.reshape(-1).narrow(0, 0, 6) * 2,
             {3, 4}, 0),
        Make(CheckpointEntry::OPTIMIZER_STATE, "w", "exp_avg", w.reshape(-1).narrow(0, 6, 6) * 2,
             {3, 4}, 6),
        Make(CheckpointEntry::OPTIMIZER_STATE, "w", "step", at::full({}, 7.0, at::kFloat)),
    });
    if (!rannc::checkpoint::WriteCheckpoint(dir, s).ok()) std::abort();
    return new std::string(dir);  // the fuzzer's lifetime
  }();
  return *job;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& job = JobDir();
  const std::string manifest = rannc::checkpoint::StepDir(job, 7) + "/manifest.json";
  if (const char* seed = std::getenv("RANNC_FUZZ_WRITE_SEED")) {
    std::ifstream in(manifest, std::ios::binary);
    std::ofstream(seed, std::ios::binary) << in.rdbuf();
    std::exit(0);
  }
  {
    std::ofstream out(manifest, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  absl::StatusOr<rannc::v1::CheckpointManifest> found =
      rannc::checkpoint::FindCheckpoint(job, 0);
  if (!found.ok()) return 0;
  absl::StatusOr<rannc::checkpoint::Contents> contents =
      rannc::checkpoint::ReadCheckpoint(job, *found);
  if (!contents.ok()) return 0;
  (void)rannc::checkpoint::ExportCheckpoint(*found, *contents);
  return 0;
}
