#include "daemon/checkpoint/checkpoint_writer.h"

#include <chrono>

#include <spdlog/spdlog.h>

namespace rannc {
namespace checkpoint {

CheckpointWriter::~CheckpointWriter() { Join(); }

void CheckpointWriter::Join() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void CheckpointWriter::Start(std::string job_dir, Snapshot snapshot, int keep) {
  Join();
  std::lock_guard<std::mutex> lock(mu_);
  running_step_ = snapshot.manifest.step();
  result_.reset();
  thread_ = std::thread([this, job_dir = std::move(job_dir), snapshot = std::move(snapshot),
                         keep]() mutable {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<v1::CheckpointManifest> written = WriteCheckpoint(job_dir, snapshot);
    snapshot.files.clear();  // the host copies go now, not when the next write starts
    absl::StatusOr<Result> result = absl::UnknownError("not written");
    if (written.ok()) {
      Result r;
      r.manifest = std::move(*written);
      for (const v1::CheckpointFile& f : r.manifest.files()) r.bytes += f.bytes();
      absl::Status pruned = PruneCheckpoints(job_dir, keep);
      if (!pruned.ok()) {
        spdlog::warn("checkpoint of step {} committed, but pruning older ones failed: {}",
                     r.manifest.step(), pruned.ToString());
      }
      r.write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      spdlog::info("checkpoint of '{}' step {} committed: {} bytes in {:.2f} s ({:.0f} MB/s)",
                   r.manifest.job_name(), r.manifest.step(), r.bytes, r.write_s,
                   r.write_s > 0 ? static_cast<double>(r.bytes) / r.write_s / 1e6 : 0.0);
      result = std::move(r);
    } else {
      result = written.status();
      spdlog::error("checkpoint of step {} under {} failed (the previous ones are intact): {}",
                    snapshot.manifest.step(), job_dir, written.status().ToString());
    }
    std::lock_guard<std::mutex> lock(mu_);
    result_ = std::move(result);
    running_step_ = -1;
  });
}

absl::StatusOr<CheckpointWriter::Result> CheckpointWriter::Wait() {
  Join();
  std::lock_guard<std::mutex> lock(mu_);
  if (!result_) return absl::FailedPreconditionError("no checkpoint was started");
  return *result_;
}

std::string CheckpointWriter::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!result_ || result_->ok()) return "";
  return std::string(result_->status().message());
}

int64_t CheckpointWriter::busy_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_step_;
}

}  // namespace checkpoint
}  // namespace rannc
