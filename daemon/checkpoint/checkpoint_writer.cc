#include "daemon/checkpoint/checkpoint_writer.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/elapsed.h"

namespace rannc {
namespace checkpoint {

namespace {

uint64_t FileBytes(const google::protobuf::RepeatedPtrField<v1::CheckpointFile>& files) {
  uint64_t bytes = 0;
  for (const v1::CheckpointFile& f : files) bytes += f.bytes();
  return bytes;
}

// The writer's first act: waiting for the copies from the devices.
void AwaitCopies(const std::function<void()>& ready, int64_t step) {
  if (!ready) return;
  const auto start = std::chrono::steady_clock::now();
  ready();
  spdlog::info("checkpoint of step {}: the copies from the devices ended {:.3f} s after the "
               "writer started", step, SecondsSince(start));
}

}  // namespace

CheckpointWriter::~CheckpointWriter() { Join(); }

void CheckpointWriter::Join() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

CheckpointWriter::Totals CheckpointWriter::totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

void CheckpointWriter::Run(int64_t step, Write write) {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return running_step_ < 0; });  // one write at a time
  running_step_ = step;
  result_.reset();
  std::thread previous = std::move(thread_);
  thread_ = std::thread([this, previous = std::move(previous), write = std::move(write)]() mutable {
    // The previous write's thread may still be deleting what it pruned.
    const std::function<void()> await_previous = [&previous] {
      if (previous.joinable()) previous.join();
    };
    write(await_previous, [this](absl::StatusOr<Result> result) {
      std::lock_guard<std::mutex> lock(mu_);
      if (result.ok()) {
        ++totals_.written;
        totals_.bytes += result->bytes;
        last_bytes_ = result->bytes;
      } else {
        ++totals_.failed;
      }
      result_ = std::move(result);
      running_step_ = -1;
      done_.notify_all();
    });
    write = nullptr;  // the host copies go now, not when the next write starts
    await_previous();  // this thread ends after the one before it: Join waits for all
  });
}

void CheckpointWriter::Start(std::string job_dir, Snapshot snapshot, int keep, std::string dir,
                             Others others, std::function<void()> ready) {
  const int64_t step = snapshot.manifest.step();
  Run(step, [this, step, job_dir = std::move(job_dir), snapshot = std::move(snapshot), keep,
             dir = std::move(dir), others = std::move(others),
             ready = std::move(ready)](const std::function<void()>& await_previous,
                                       const Publish& publish) mutable {
    const auto start = std::chrono::steady_clock::now();
    // The previous write's deletion goes on beside this write where the disk has room for both
    // (else first: the files it frees may be the room this one needs). The previous write has
    // published by now (Run), so last_bytes_ is its size.
    uint64_t expected_bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      expected_bytes = last_bytes_;
    }
    if (!HasRoomFor(job_dir, expected_bytes)) {
      const auto waited = std::chrono::steady_clock::now();
      await_previous();
      const double waited_s = SecondsSince(waited);
      if (waited_s > 0.1) {
        spdlog::info("checkpoint of step {}: waited {:.2f} s for the older checkpoints' "
                     "deletion to free room on the disk", step, waited_s);
      }
    }
    auto write = [&]() -> absl::StatusOr<Result> {
      AwaitCopies(ready, snapshot.manifest.step());
      auto failed = [&](const absl::Status& status) {
        spdlog::error("checkpoint of step {} under {} failed (the previous ones are intact): {}",
                      snapshot.manifest.step(), job_dir, status.ToString());
        return status;
      };
      if (dir.empty()) {
        absl::StatusOr<std::string> begun = BeginCheckpoint(job_dir, snapshot.manifest.step());
        if (!begun.ok()) return failed(begun.status());
        dir = std::move(*begun);
      }
      // This daemon's shares (daemon-<f>), then the others' (waited for even when one of these
      // failed: their writes end before the directory goes).
      std::vector<v1::CheckpointShare> shares;
      absl::Status mine;
      for (size_t f = 0; f < snapshot.files.size() && mine.ok(); ++f) {
        absl::StatusOr<v1::CheckpointShare> share =
            WriteShare(dir, absl::StrCat("daemon-", f), snapshot.files[f]);
        if (share.ok()) {
          shares.push_back(std::move(*share));
        } else {
          mine = share.status();
        }
      }
      snapshot.files.clear();
      absl::StatusOr<std::vector<v1::CheckpointShare>> theirs =
          others ? others() : std::vector<v1::CheckpointShare>();
      if (!mine.ok() || !theirs.ok()) {
        AbandonCheckpoint(dir);
        return failed(!mine.ok() ? mine : theirs.status());
      }
      for (v1::CheckpointShare& share : *theirs) shares.push_back(std::move(share));
      absl::StatusOr<v1::CheckpointManifest> written =
          CommitCheckpoint(job_dir, dir, snapshot.manifest, shares);
      if (!written.ok()) return failed(written.status());
      Result r;
      r.manifest = std::move(*written);
      r.bytes = FileBytes(r.manifest.files());
      r.write_s = SecondsSince(start);
      spdlog::info("checkpoint of '{}' step {} committed: {} bytes in {:.2f} s ({:.0f} MB/s)",
                   r.manifest.job_name(), r.manifest.step(), r.bytes, r.write_s,
                   r.write_s > 0 ? static_cast<double>(r.bytes) / r.write_s / 1e6 : 0.0);
      return r;
    };
    absl::StatusOr<Result> result = write();
    if (!result.ok()) {
      publish(std::move(result));
      return;
    }
    // The older ones beyond `keep` leave the listing before the answer, and their files go
    // after it: a caller waiting for the write does not wait for the deletion (seconds for
    // large checkpoints). The previous write's deletion may still go on: what it deletes, which
    // this listing names too, is left to it.
    const std::string name = result->manifest.job_name();
    const auto prune_start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<std::string>> retired = RetireCheckpoints(job_dir, keep);
    if (retired.ok()) *retired = Claim(std::move(*retired));
    publish(std::move(result));
    absl::Status pruned = retired.ok() ? RemoveRetired(*retired) : retired.status();
    if (retired.ok()) Release(*retired);
    if (!pruned.ok()) {
      spdlog::warn("checkpoint of step {} committed, but pruning older ones failed: {}", step,
                   pruned.ToString());
    } else if (!retired->empty()) {
      spdlog::info("checkpoints of '{}' older than the newest {} removed in {:.2f} s", name,
                   keep, SecondsSince(prune_start));
    }
  });
}

std::vector<std::string> CheckpointWriter::Claim(std::vector<std::string> paths) {
  std::lock_guard<std::mutex> lock(mu_);
  paths.erase(std::remove_if(paths.begin(), paths.end(),
                             [&](const std::string& p) { return !deleting_.insert(p).second; }),
              paths.end());
  return paths;
}

void CheckpointWriter::Release(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& p : paths) deleting_.erase(p);
}

void CheckpointWriter::StartShare(std::string dir, std::string prefix, int64_t step,
                                  std::vector<Piece> pieces, std::function<void()> ready) {
  Run(step, [dir = std::move(dir), prefix = std::move(prefix), step, pieces = std::move(pieces),
             ready = std::move(ready)](const std::function<void()>&,
                                       const Publish& publish) mutable {
    auto write = [&]() -> absl::StatusOr<Result> {
      const auto start = std::chrono::steady_clock::now();
      AwaitCopies(ready, step);
      absl::StatusOr<v1::CheckpointShare> share = WriteShare(dir, prefix, pieces);
      pieces.clear();
      if (!share.ok()) {
        spdlog::error("writing this daemon's share of checkpoint step {} into {} failed: {}",
                      step, dir, share.status().ToString());
        return share.status();
      }
      Result r;
      r.manifest.set_step(step);
      *r.manifest.mutable_files() = std::move(*share->mutable_files());
      *r.manifest.mutable_entries() = std::move(*share->mutable_entries());
      r.bytes = FileBytes(r.manifest.files());
      r.write_s = SecondsSince(start);
      spdlog::info("share of checkpoint step {} written: {} bytes in {:.2f} s ({:.0f} MB/s)",
                   step, r.bytes, r.write_s,
                   r.write_s > 0 ? static_cast<double>(r.bytes) / r.write_s / 1e6 : 0.0);
      return r;
    };
    publish(write());
  });
}

absl::StatusOr<CheckpointWriter::Result> CheckpointWriter::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return running_step_ < 0; });
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
