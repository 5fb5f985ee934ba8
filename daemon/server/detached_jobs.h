// Detached jobs: the daemon trains them on its own, with no client attached (`rannc submit`,
// docs/detached.md). A DetachedJobSpec names a TorchScript model returning its loss and its data
// (a token file or a tensor dataset, detached_data.h) on the daemon's file system; the job is
// checked and planned at submission (its data range-checked whole), waits its turn (by
// priority, then FIFO, and while the memory its plan needs is held by other jobs), then a
// thread of its own runs the training loop through the same Job a client would drive, on
// batches a prefetching thread draws: zero_grad, forward, backward, the optimizer step at the
// schedule's lr, an evaluation on held-out data every N steps, checkpoints as its config keys
// say. Status (step, loss, tokens/s, ETA, eval loss) and a
// log of lines are kept for `rannc status` and `rannc logs`; Cancel stops it after its current
// step and deletes its Job (its checkpoints stay).
//
// Durable: with a records directory, each unfinished job's spec is kept there, and a daemon that
// restarts submits them again under their ids with config resume=latest: each resumes from its
// newest checkpoint and draws the batches an uninterrupted run would (the sampler is advanced
// past the steps the checkpoint holds).
//
// Thread-safety: every method is safe from any thread. The destructor cancels every job and
// joins their threads.
#ifndef RANNC_DAEMON_SERVER_DETACHED_JOBS_H_
#define RANNC_DAEMON_SERVER_DETACHED_JOBS_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "daemon/graph/index_bounds.h"
#include "daemon/server/job.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// The files `spec` names (its model and data), those set.
std::vector<std::string> NamedFiles(const v1::DetachedJobSpec& spec);

class DetachedJobs {
 public:
  struct Hooks {
    // Makes and registers the job `id` (as CreateJob does, without a lease or a record).
    std::function<absl::StatusOr<std::shared_ptr<Job>>(const std::string& id,
                                                       const v1::JobSpec& spec,
                                                       const std::string& model,
                                                       const std::vector<at::Tensor>& examples)>
        start;
    // Deletes the job `id` (frees its devices).
    std::function<void(const std::string& id)> remove;
    // The bytes a job of `spec` would hold on each of this daemon's devices (its plan's
    // estimates; its settings and plan checked as CreateJob checks them) and the ranges its
    // integer inputs must keep to (an embedding's rows); and why those bytes do not fit what the
    // live jobs' plans leave of the devices' memory now ("" when they fit). A job starts once
    // its plan fits.
    struct Need {
      std::vector<uint64_t> bytes;
      std::vector<IndexBound> bounds;
      std::string plan;  // the serialized Deployment, which the job starts with (not planned again)
    };
    std::function<absl::StatusOr<Need>(const v1::JobSpec& spec, const std::string& model,
                                       const std::vector<at::Tensor>& examples)>
        need;
    std::function<std::string(const std::vector<uint64_t>& need)> short_of;
    std::function<std::string()> new_id;
    // The job ended (not stopped with the daemon): what its spec named that is kept for it
    // alone (uploaded files) can go. May be null.
    std::function<void(const v1::DetachedJobSpec&)> ended;
  };

  // `records_dir`: where unfinished jobs' specs are kept ("" keeps none), with their logs:
  // `<id>.json` and `<id>.log` (a line of JSON per log line, appended as it is logged), so that
  // a restarted daemon's job goes on with its log, numbered on from where it was.
  DetachedJobs(Hooks hooks, std::string records_dir);
  // Stop().
  ~DetachedJobs();
  DetachedJobs(const DetachedJobs&) = delete;
  DetachedJobs& operator=(const DetachedJobs&) = delete;

  // The new job's id, once the spec is checked and the job planned on its first batch.
  // INVALID_ARGUMENT naming the field for a spec that cannot run: sizes not positive, a model
  // or data file that does not open (NOT_FOUND), data shorter than one window or batch, an
  // unknown dtype, optimizer or schedule, bad config keys, a model that does not take the data,
  // a value of the data outside what the model indexes with it;
  // RESOURCE_EXHAUSTED for a plan that cannot fit the devices even with no other job.
  absl::StatusOr<std::string> Submit(const v1::DetachedJobSpec& spec);
  // NOT_FOUND for an id that was never submitted here. A recorded job that a restarted daemon
  // has yet to resubmit is QUEUED; one it could not resubmit is FAILED, with the reason.
  absl::StatusOr<v1::DetachedStatus> Status(const std::string& id);
  // Every job's Status: the running ones (by start), the queue (in its order), the other
  // queued ones (yet to be resubmitted, or stopped with the daemon; by id), then the ended ones
  // (by id).
  std::vector<v1::DetachedStatus> List();
  // Ends the job: a queued one at once, a running one after its current step, a recorded one
  // not yet resubmitted before it starts, one stopped with the daemon for good (its record
  // goes: the next start does not resume it). NOT_FOUND for an unknown id; OK (nothing to do)
  // for one that has ended.
  absl::Status Cancel(const std::string& id);
  // The log lines numbered above `after_seq`. With `wait` > 0 and none yet, waits up to `wait`
  // for one (and for a recorded job to be resubmitted). `ended`: the job has ended and every
  // line is in `out`, or the daemon is stopping (its jobs go on at its next start, their logs
  // numbered on).
  absl::Status Lines(const std::string& id, int64_t after_seq, std::chrono::milliseconds wait,
                     std::vector<v1::DetachedLogLine>* out, bool* ended);
  // The daemon is stopping: every job stops after its current step, a running one saved there
  // as a checkpoint first (CheckpointBeforeStop), and their records stay, for the next start;
  // meanwhile each shows QUEUED, waiting for that start. Returns when every job's thread has
  // ended. Idempotent.
  void Stop();
  // How many jobs wait in the queue.
  size_t Queued();
  // The queue's aging: a waiting job counts one priority higher for each `aging` it has
  // waited, so that a stream of higher-priority submissions cannot hold it back for good.
  // Default 1 h (daemon option queue_aging).
  void set_queue_aging(std::chrono::milliseconds aging) { queue_aging_ = aging; }
  // The files (model, data) named by the jobs not ended, and by the records of those a
  // restarted daemon resubmits.
  std::set<std::string> PathsInUse();
  // Submits again, under their ids and with config resume=latest, the jobs whose records a
  // previous run left (a restart); once the hooks can make jobs. A record that no longer
  // submits (a file gone) is logged and dropped.
  void ResubmitRecorded();

 private:
  struct Entry;

  absl::StatusOr<std::string> SubmitAs(const std::string& id, const v1::DetachedJobSpec& spec,
                                       bool resume);
  void Run(Entry* entry);
  // Appends a line to `entry`'s log (and the daemon's); mu_ must not be held.
  void Log(Entry* entry, const std::string& text);
  // Ends `entry` in `state` on its own thread: deletes its job, drops its record (unless the
  // daemon is stopping) and releases its model and data.
  void Finish(Entry* entry, v1::DetachedState state, const std::string& error);
  // `entry` ended after `step`: done, or `stopping` with the daemon (SIGTERM). Its state is
  // saved as a checkpoint (waiting for the write) unless it has no checkpoint_dir or one of this
  // step exists: the trained model, or where the restarted daemon resumes it. A failure is
  // logged; a stopped job then resumes from its last checkpoint.
  void CheckpointAtEnd(Entry* entry, Job* job, int64_t step, bool stopping);
  // Lists `id` as ended in `state` (FAILED, CANCELLED) without running it, and `why` in its log
  // (and its error, FAILED): a recorded job that was not resubmitted after a restart.
  void AddEnded(const std::string& id, const v1::DetachedJobSpec& spec, v1::DetachedState state,
                const std::string& why);
  std::string RecordPath(const std::string& id) const;
  std::string LogPath(const std::string& id) const;
  // The lines of `id`'s log file (the last kKeptLines, in order): into `entry`'s log, its next
  // line numbered after them. A line that does not parse (the last one, cut by a crash) is
  // skipped.
  void RestoreLog(const std::string& id, Entry* entry);
  // `entry`'s record and log file go; later lines stay in memory only.
  void DropRecord(Entry* entry);
  // `entry` has ended for good: DropRecord, what its spec named for it alone goes
  // (Hooks::ended), and `last_line` ends its log.
  void EndRun(Entry* entry, const std::string& last_line);
  // With mu_ held: orders queue_ by priority plus one for each queue_aging_ waited, then by
  // the time each joined it (FIFO among equals).
  void OrderQueueLocked();
  // With mu_ held: takes `id` out of queue_ (if there); the entry of `id`, or NOT_FOUND.
  void DequeueLocked(const std::string& id);
  absl::StatusOr<Entry*> FindLocked(const std::string& id);

  const Hooks hooks_;
  const std::string records_dir_;
  std::atomic<bool> stopping_{false};  // the destructor's: runs end, records stay
  std::atomic<std::chrono::milliseconds> queue_aging_{std::chrono::hours(1)};
  std::mutex mu_;
  std::condition_variable changed_;                   // a job's state, log or the queue
  std::map<std::string, std::unique_ptr<Entry>> jobs_;  // guarded by mu_
  // The recorded jobs ResubmitRecorded has yet to submit again (listed by the constructor; each
  // is checked and planned first): Status reports them queued, not unknown, to a client asking
  // right after a restart; Lines waits for them; Cancel notes them in cancelled_early_, and they
  // end as cancelled.
  std::set<std::string> resubmitting_;    // guarded by mu_
  std::set<std::string> cancelled_early_;  // guarded by mu_
  std::deque<std::string> queue_;  // guarded by mu_; waiting, by priority, then FIFO
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_DETACHED_JOBS_H_
