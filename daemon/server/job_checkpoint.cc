// Job's checkpoints (job.h): the snapshot a checkpoint writes, and a job resumed from one.
#include <chrono>
#include <cstring>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/server/job.h"

namespace rannc {

namespace {

int64_t UnixMs(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

CheckpointInfo InfoOf(const v1::CheckpointManifest& m, const std::string& job_dir) {
  CheckpointInfo info;
  info.step = m.step();
  info.path = checkpoint::StepDir(job_dir, m.step());
  info.committed = true;
  for (const v1::CheckpointFile& f : m.files()) info.bytes += f.bytes();
  info.created_unix_ms = m.created_unix_ms();
  return info;
}

at::Tensor RngState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetRngState(const std::string& bytes) {
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

std::string Job::checkpoint_job_dir() const {
  if (settings_.checkpoints.dir.empty()) return "";
  absl::StatusOr<std::string> dir = checkpoint::JobDir(settings_.checkpoints.dir, settings_.name);
  return dir.ok() ? *dir : "";
}

absl::StatusOr<CheckpointInfo> Job::Checkpoint(bool wait) {
  std::lock_guard<std::mutex> lock(mu_);
  return CheckpointLocked(wait);
}

absl::StatusOr<CheckpointInfo> Job::CheckpointLocked(bool wait) {
  if (settings_.checkpoints.dir.empty()) {
    return absl::FailedPreconditionError(
        "the job has no checkpoint directory: create it with the config key checkpoint_dir "
        "(RANNC_CHECKPOINT_DIR)");
  }
  absl::StatusOr<std::string> job_dir =
      checkpoint::JobDir(settings_.checkpoints.dir, settings_.name);
  if (!job_dir.ok()) return job_dir.status();
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  const auto start = std::chrono::steady_clock::now();
  const int64_t step = steps_;
  // The write in flight commits first (training is held for it too): its pruning lists the
  // directories it deletes before it answers, so the new checkpoint's is not taken for a
  // leftover. Their deletion goes on behind training.
  writer_.Wait().status().IgnoreError();
  absl::StatusOr<std::string> dir = checkpoint::BeginCheckpoint(*job_dir, step);
  if (!dir.ok()) return dir.status();

  // The copy to host memory, on every daemon at once: what training waits for.
  checkpoint::Snapshot snapshot;
  v1::CheckpointManifest& m = snapshot.manifest;
  std::function<void()> ready;
  auto local = [&]() -> absl::Status {
    absl::StatusOr<Share> mine = ShareLocked();
    if (!mine.ok()) return mine.status();
    snapshot.files.push_back(std::move(mine->pieces));
    ready = std::move(mine->ready);
    return absl::OkStatus();
  };
  absl::Status copied =
      coordinator_.leads()
          ? coordinator_.OnParts(
                [&](PartChannel& part, size_t i) {
                  return part.StartCheckpointShare(*dir, absl::StrCat("daemon-", i + 1), step);
                },
                local)
          : local();
  if (!copied.ok()) {
    if (ready) ready();  // this daemon's copies end before their memory goes
    // A part that started writing fails its write once the directory is gone.
    checkpoint::AbandonCheckpoint(*dir);
    return Annotate(copied, "checkpoint");
  }
  const ParamStore& store = local_->params();
  m.set_job_name(settings_.name);
  m.set_job_id(info_.id);
  m.set_step(steps_);
  m.set_forwards(forwards_);
  m.set_created_unix_ms(UnixMs(std::chrono::system_clock::now()));
  m.set_created_by(settings_.created_by);
  *m.mutable_spec() = settings_.spec;
  m.mutable_spec()->clear_example_inputs();
  m.mutable_spec()->clear_model_tensors();
  *m.mutable_deployment() = info_.plan;
  for (const std::string& key : store.state_keys()) {
    m.add_state_keys(key);
    m.add_state_entries(store.Find(key)->name);
  }
  if (settings_.optimizer.enabled) {
    m.set_optimizer(settings_.optimizer.Name());
    std::vector<std::vector<std::string>> groups = settings_.optimizer.group_params;
    if (groups.empty()) {
      groups.emplace_back();
      for (const ParamStore::Entry& e : store.entries()) {
        if (e.is_parameter) groups.back().push_back(e.name);
      }
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      v1::ParamGroup* group = m.add_param_groups();
      for (const std::string& name : groups[g]) group->add_params(name);
      if (g < last_hypers_.size()) *group->mutable_hyper() = ToProto(last_hypers_[g]);
    }
  }
  std::vector<int64_t> bytes, peak;
  LossScaler scaler(settings_.loss_scale);
  local_->Usage(&bytes, &peak, &scaler);
  m.set_loss_scale(scaler.scale());
  m.set_loss_scale_good_steps(scaler.good_steps());
  m.set_skipped_steps(scaler.skipped_steps());
  const at::Tensor rng = RngState();
  m.set_cpu_rng_state(std::string(static_cast<const char*>(rng.data_ptr()),
                                  static_cast<size_t>(rng.numel())));

  CheckpointInfo info;
  info.step = step;
  info.path = checkpoint::StepDir(*job_dir, step);
  info.created_unix_ms = m.created_unix_ms();
  checkpoint::CheckpointWriter::Others others;
  if (coordinator_.leads() || settings_.fence) {
    // The parts' shares; and, last before the commit, the fence: a daemon that may have lost
    // the job to another commits nothing (the new leader resumes from what was committed).
    others = [this, step]() -> absl::StatusOr<std::vector<v1::CheckpointShare>> {
      absl::StatusOr<std::vector<v1::CheckpointShare>> shares =
          coordinator_.leads() ? coordinator_.CheckpointShares(step)
                               : std::vector<v1::CheckpointShare>();
      if (shares.ok() && settings_.fence) {
        if (absl::Status fenced = settings_.fence(); !fenced.ok()) return fenced;
      }
      return shares;
    };
  }
  writer_.Start(*job_dir, std::move(snapshot), settings_.checkpoints.keep, *dir,
                std::move(others), std::move(ready));
  info.blocked_s = SecondsSince(start);
  metrics_.AddCheckpointBlocked(info.blocked_s);
  spdlog::info("job {}: checkpoint of step {} taken (training held {:.3f} s, waiting for the "
               "previous write included); copying to host memory and writing",
               info_.id, info.step, info.blocked_s);
  if (!wait) return info;
  absl::StatusOr<checkpoint::CheckpointWriter::Result> done = writer_.Wait();
  if (!done.ok()) return done.status();
  info.committed = true;
  info.bytes = done->bytes;
  info.write_s = done->write_s;
  return info;
}

absl::StatusOr<Job::Share> Job::ShareLocked() {
  Share share;
  // Host memory may run out: a failed checkpoint, not a failed daemon.
  absl::Status copied = TorchCall(absl::StatusCode::kResourceExhausted,
                                  "copying the checkpoint to host memory",
                                  [&] { return CopyShareLocked(&share); });
  if (!copied.ok()) {
    if (share.ready) share.ready();  // the copies queued end before their memory goes
    return copied;
  }
  return share;
}

absl::Status Job::CopyShareLocked(Share* out) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<checkpoint::Piece>& pieces = out->pieces;
  const ParamStore& store = local_->params();
  at::NoGradGuard no_grad;
  auto add_entry = [&](const ParamStore::Entry& e) {
    if (!local_->Saves(e.name)) return;
    checkpoint::Piece p;
    p.kind = e.is_parameter ? v1::CheckpointEntry::PARAM : v1::CheckpointEntry::BUFFER;
    p.name = e.name;
    // A copy straight from the devices (not through the host master: one copy, not two); a
    // tensor no device holds is the master's.
    absl::StatusOr<std::optional<at::Tensor>> held = local_->Read(e.name, /*grad=*/false);
    p.value = held.ok() && held->has_value() ? std::move(**held) : e.tensor.detach().clone();
    pieces.push_back(std::move(p));
  };
  // Buffers first, at once (a forward writes them); then parameters and optimizer state, whose
  // copies from CUDA devices run on during the next forwards and backwards.
  for (const ParamStore::Entry& e : store.entries()) {
    if (!e.is_parameter) add_entry(e);
  }
  local_->BeginAsyncReads();
  absl::Cleanup end_reads = [&] { out->ready = local_->EndAsyncReads(); };
  for (const ParamStore::Entry& e : store.entries()) {
    if (e.is_parameter) add_entry(e);
  }
  const double params_s = SecondsSince(start);
  // ZeRO's shards are written as they are, slices of their tensors (the reader assembles them).
  for (LocalJob::OptimizerPiece& piece : local_->OptimizerStatePieces()) {
    OptimizerEntry& entry = piece.entry;
    if (!local_->Saves(entry.param)) continue;
    checkpoint::Piece p;
    p.kind = v1::CheckpointEntry::OPTIMIZER_STATE;
    if (piece.slice) {
      const at::Tensor& whole = store.Find(entry.param)->tensor;
      if (entry.value.numel() == whole.numel()) {
        entry.value = entry.value.view(whole.sizes());  // one shard holds all of it
      } else {
        p.shape = whole.sizes().vec();
        p.offset = piece.offset;
      }
    }
    p.name = std::move(entry.param);
    p.state_key = std::move(entry.key);
    p.value = std::move(entry.value);
    pieces.push_back(std::move(p));
  }
  int64_t bytes = 0, pinned = 0;
  for (const checkpoint::Piece& p : pieces) {
    bytes += static_cast<int64_t>(p.value.nbytes());
    if (p.value.is_pinned()) pinned += static_cast<int64_t>(p.value.nbytes());
  }
  spdlog::info("job {}: {} tensors ({:.2f} GB, {:.2f} GB of it page-locked) read in {:.3f} s "
               "(buffers and parameters {:.3f} s, optimizer state {:.3f} s; from CUDA devices "
               "the copies go on meanwhile)",
               info_.id, pieces.size(), bytes / 1e9, pinned / 1e9, SecondsSince(start),
               params_s, SecondsSince(start) - params_s);
  return absl::OkStatus();
}

void Job::RestoreLossScaler(double scale, int good_steps, int skipped_steps) {
  std::lock_guard<std::mutex> lock(mu_);
  RestoreLossScalerLocked(scale, good_steps, skipped_steps);
}

void Job::RestoreLossScalerLocked(double scale, int good_steps, int skipped_steps) {
  LossScaler scaler(settings_.loss_scale);
  scaler.Restore(scale, good_steps, skipped_steps);
  local_->RestoreLossScaler(scaler);
}

absl::Status Job::StartCheckpointShare(const std::string& dir, const std::string& prefix,
                                       int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  writer_.Wait().status().IgnoreError();  // the previous share's write
  absl::StatusOr<Share> share = ShareLocked();
  if (!share.ok()) return share.status();
  writer_.StartShare(dir, prefix, step, std::move(share->pieces), std::move(share->ready));
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointShare> Job::CheckpointShare(int64_t step) {
  // Not under the job's lock: the leader's writer asks while the job trains on.
  absl::StatusOr<checkpoint::CheckpointWriter::Result> done = writer_.Wait();
  if (!done.ok()) return done.status();
  if (done->manifest.step() != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon wrote no share of checkpoint step ", step, " (its last was of step ",
        done->manifest.step(), ")"));
  }
  v1::CheckpointShare share;
  *share.mutable_files() = done->manifest.files();
  *share.mutable_entries() = done->manifest.entries();
  return share;
}

std::vector<CheckpointInfo> Job::Checkpoints() {
  const std::string job_dir = checkpoint_job_dir();
  if (job_dir.empty()) return {};
  // Read first: a write that commits while the directory is read may be missed by the listing,
  // and is then reported as still being written.
  const int64_t writing = writer_.busy_step();
  std::vector<CheckpointInfo> out = ListCheckpointsIn(job_dir);
  if (writing >= 0 && (out.empty() || out.back().step < writing)) {
    CheckpointInfo info;
    info.step = writing;
    info.path = checkpoint::StepDir(job_dir, writing);
    out.push_back(info);  // committed = false: being written
  }
  return out;
}

absl::StatusOr<std::string> CheckpointJobDir(const std::string& checkpoint_dir,
                                             const std::string& name) {
  if (checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("name the checkpoint directory (checkpoint_dir)");
  }
  return checkpoint::JobDir(checkpoint_dir, name);
}

std::vector<CheckpointInfo> ListCheckpointsIn(const std::string& job_dir) {
  std::vector<CheckpointInfo> out;
  for (const v1::CheckpointManifest& m : checkpoint::ListCheckpoints(job_dir)) {
    out.push_back(InfoOf(m, job_dir));
  }
  return out;
}

absl::StatusOr<std::vector<char>> ExportCheckpointIn(const std::string& job_dir, int64_t step,
                                                     int64_t* exported) {
  absl::StatusOr<v1::CheckpointManifest> m = checkpoint::FindCheckpoint(job_dir, step);
  if (!m.ok()) return m.status();
  absl::StatusOr<checkpoint::Contents> contents = checkpoint::ReadCheckpoint(job_dir, *m);
  if (!contents.ok()) return contents.status();
  *exported = m->step();
  return checkpoint::ExportCheckpoint(*m, *contents);
}

void Job::CheckpointAfterStep() {
  absl::StatusOr<CheckpointInfo> taken = CheckpointLocked(/*wait=*/false);
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    snapshot_error_ = taken.ok() ? "" : std::string(taken.status().message());
  }
  if (!taken.ok()) {
    spdlog::error("job {}: the checkpoint of step {} (checkpoint_every) failed; training goes "
                  "on: {}", info_.id, steps_, taken.status().ToString());
  }
}

std::string Job::checkpoint_error() const {
  const std::string written = writer_.last_error();
  if (!written.empty()) return written;
  std::lock_guard<std::mutex> lock(error_mu_);
  return snapshot_error_;
}

Job::ResumeRead Job::ReadResume(const JobSettings::Checkpoints& c, const std::string& job_name) {
  ResumeRead out;
  out.key = c.resume == 0 ? "resume=latest" : absl::StrCat("resume=", c.resume);
  absl::StatusOr<std::string> job_dir = checkpoint::JobDir(c.dir, job_name);
  if (!job_dir.ok()) {
    out.status = job_dir.status();
    return out;
  }
  absl::StatusOr<v1::CheckpointManifest> m = checkpoint::FindCheckpoint(*job_dir, c.resume);
  if (c.resume == 0 && m.status().code() == absl::StatusCode::kNotFound) {
    out.none_yet = true;
    return out;
  }
  if (!m.ok()) {
    out.status = Annotate(m.status(), out.key);
    return out;
  }
  out.manifest = std::move(*m);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<checkpoint::Contents> contents =
      checkpoint::ReadCheckpoint(*job_dir, out.manifest);
  if (!contents.ok()) {
    out.status = Annotate(contents.status(), out.key);
    return out;
  }
  out.contents = std::move(*contents);
  out.read_s = SecondsSince(start);
  return out;
}

absl::Status Job::Resume(ResumeRead read) {
  if (!read.status.ok()) return read.status;
  const std::string& key = read.key;
  if (read.none_yet) {
    spdlog::info("job {} '{}': resume=latest, and {} holds no checkpoint yet: starting afresh",
                 info_.id, settings_.name, checkpoint_job_dir());
    return absl::OkStatus();
  }
  const v1::CheckpointManifest& m = read.manifest;
  checkpoint::Contents& contents = read.contents;
  const std::string dir = checkpoint::StepDir(checkpoint_job_dir(), m.step());
  const auto start = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  for (const v1::CheckpointFile& f : m.files()) bytes += f.bytes();
  auto another = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        key, ": the checkpoint in ", dir, " is of another model: ", why));
  };

  // Parameters and buffers: every tensor of the model, and nothing else, with its shape.
  const ParamStore& store = local_->params();
  std::map<std::string, at::Tensor> state;
  for (const std::string& name : store.state_keys()) {
    const ParamStore::Entry* e = store.Find(name);
    auto it = contents.tensors.find(e->name);
    if (it == contents.tensors.end()) return another(absl::StrCat("it has no '", name, "'"));
    if (!it->second.sizes().equals(e->tensor.sizes())) {
      return another(absl::StrCat("'", name, "' has shape ", c10::str(it->second.sizes()),
                                  " there, ", c10::str(e->tensor.sizes()), " here"));
    }
    state[name] = it->second;
  }
  for (const auto& [name, tensor] : contents.tensors) {
    if (store.Find(name) == nullptr) {
      return another(absl::StrCat("it has '", name, "', which this model has not"));
    }
  }
  std::vector<std::string> missing, unexpected;
  absl::Status loaded = LoadStateLocked(state, /*strict=*/true, &missing, &unexpected);
  if (!loaded.ok()) return Annotate(loaded, key);

  if (settings_.optimizer.enabled && !contents.optimizer.empty()) {
    const std::string kind = settings_.optimizer.Name();
    if (m.optimizer() != kind) {
      return absl::InvalidArgumentError(absl::StrCat(
          key, ": the checkpoint in ", dir, " holds ", m.optimizer(), "'s state; this job's "
          "optimizer is ", kind));
    }
    std::vector<OptimizerEntry> entries;
    for (checkpoint::Contents::State& s : contents.optimizer) {
      entries.push_back({s.param, s.key, s.value});
    }
    absl::Status state_loaded = LoadOptimizerStateLocked(entries);
    if (!state_loaded.ok()) return Annotate(state_loaded, key);
  }
  steps_ = m.step();
  forwards_ = m.forwards();
  for (int g = 0; g < m.param_groups_size() && g < static_cast<int>(last_hypers_.size()); ++g) {
    last_hypers_[g] = FromProto(m.param_groups(g).hyper(), settings_.optimizer.kind);
  }
  if (settings_.loss_scale.enabled) {
    const int good_steps = static_cast<int>(m.loss_scale_good_steps());
    const int skipped = static_cast<int>(m.skipped_steps());
    RestoreLossScalerLocked(m.loss_scale(), good_steps, skipped);
    if (coordinator_.leads()) {
      // Every daemon's engine scales and unscales its own share of the gradients.
      absl::Status restored = coordinator_.OnParts(
          [&](PartChannel& part, size_t) {
            return part.RestoreLossScaler(m.loss_scale(), good_steps, skipped);
          },
          [] { return absl::OkStatus(); });
      if (!restored.ok()) return Annotate(restored, key);
    }
  }
  if (!m.cpu_rng_state().empty()) {
    absl::Status rng = TorchCall(absl::StatusCode::kDataLoss, "restoring the RNG state", [&] {
      SetRngState(m.cpu_rng_state());
      return absl::OkStatus();
    });
    if (!rng.ok()) return Annotate(rng, key);
  }
  resumed_step_ = m.step();
  spdlog::info("job {} '{}' resumed from {} (step {}, written by job {}; read {:.0f} MB in "
               "{:.2f} s while the job was made, applied in {:.2f} s)", info_.id,
               settings_.name, dir, m.step(), m.job_id(), bytes / 1e6, read.read_s,
               SecondsSince(start));
  return absl::OkStatus();
}

}  // namespace rannc
