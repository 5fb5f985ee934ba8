// Writes a job's checkpoints on a thread of its own, so that training goes on meanwhile: the
// job copies its state to host memory at a step boundary (a Snapshot), hands it over, and
// returns. One write at a time: a new one waits for the one in flight. After each commit the
// job directory is pruned to the newest `keep`: the older ones leave the listing before Wait
// answers, and their files are deleted after it. The next write, its answer and its own
// deletion go on beside that deletion when the disk has room for it (the last checkpoint's size,
// +10% and 1 GiB), else the write starts after it.
// Over several daemons the leader's writer also
// waits for the others' shares before it commits, and each other daemon's writes its share
// (StartShare).
//
//   CheckpointWriter writer;
//   writer.Start(job_dir, std::move(snapshot), /*keep=*/3);
//   absl::StatusOr<CheckpointWriter::Result> done = writer.Wait();  // or later, or never
//
// Thread-safe. The destructor waits for the write in flight and the deletion after it.
#ifndef RANNC_DAEMON_CHECKPOINT_CHECKPOINT_WRITER_H_
#define RANNC_DAEMON_CHECKPOINT_CHECKPOINT_WRITER_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/checkpoint/checkpoint.h"

namespace rannc {
namespace checkpoint {

class CheckpointWriter {
 public:
  struct Result {
    // The committed manifest (Start), or the share's step, files and entries (StartShare).
    v1::CheckpointManifest manifest;
    uint64_t bytes = 0;   // of the tensor files
    double write_s = 0;   // until committed (the copies awaited, written, committed)
  };
  // Waits for the other daemons' shares of the checkpoint being written.
  using Others = std::function<absl::StatusOr<std::vector<v1::CheckpointShare>>()>;

  CheckpointWriter() = default;
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Waits for the write in flight (its result stays readable through last_error()), then
  // starts writing `snapshot` under `job_dir`: into `dir` when given (BeginCheckpoint's, which
  // the other daemons write their shares into; `others` waits for those), else a directory of
  // its own. On failure the directory is abandoned. `ready`, when given, returns once the
  // snapshot's tensors hold their values (copies from devices still running when Start is
  // called: PipelineEngine::BeginAsyncReads); the writer's thread calls it first.
  void Start(std::string job_dir, Snapshot snapshot, int keep, std::string dir = "",
             Others others = nullptr, std::function<void()> ready = nullptr);
  // Another daemon's share of the leader's checkpoint `step`: `pieces` into `dir` as files
  // `<prefix>*.pt` (WriteShare), `ready` as Start's.
  void StartShare(std::string dir, std::string prefix, int64_t step, std::vector<Piece> pieces,
                  std::function<void()> ready = nullptr);
  // Waits for the write in flight to commit (or fail); the result of the last write started
  // (FAILED_PRECONDITION when none was).
  absl::StatusOr<Result> Wait();
  // The last finished write's failure ("" when it succeeded, or none finished).
  std::string last_error() const;
  // The step of the write in flight, or -1.
  int64_t busy_step() const;
  // Totals since the writer was made, for the job's metrics: writes finished, writes that
  // failed, and the bytes of the tensor files of those that succeeded.
  struct Totals {
    uint64_t written = 0;
    uint64_t failed = 0;
    uint64_t bytes = 0;
  };
  Totals totals() const;

 private:
  // Answers Wait: called once by each write, when its result is known.
  using Publish = std::function<void(absl::StatusOr<Result>)>;
  // A write: its first argument joins the previous write's thread (which may still be deleting
  // what that write pruned), at most once; the thread joins it anyway before it ends.
  using Write = std::function<void(const std::function<void()>&, const Publish&)>;
  void Join();
  // Waits for the write in flight to publish, then runs `write` on a thread of its own.
  void Run(int64_t step, Write write);
  // The paths of `paths` no other write is deleting, now marked as this one's to delete;
  // Release unmarks them once deleted.
  std::vector<std::string> Claim(std::vector<std::string> paths);
  void Release(const std::vector<std::string>& paths);

  mutable std::mutex mu_;
  std::condition_variable done_;  // running_step_ went to -1
  std::thread thread_;  // the last write's; it joins the one before
  int64_t running_step_ = -1;
  std::optional<absl::StatusOr<Result>> result_;  // of the last write started, once done
  Totals totals_;  // guarded by mu_
  uint64_t last_bytes_ = 0;  // of the last write that succeeded (all daemons'); guarded by mu_
  std::set<std::string> deleting_;  // retired directories a write is deleting; guarded by mu_
};

}  // namespace checkpoint
}  // namespace rannc

#endif  // RANNC_DAEMON_CHECKPOINT_CHECKPOINT_WRITER_H_
