// `rannc submit`, `status`, `logs` and `cancel`: detached jobs, which the daemon trains on its
// own (docs/detached.md). A job file is TOML:
//
//   name = "tiny-lm"
//   model = "lm.pt"              # paths relative to this file; the daemon reads them
//   tokens = "train.bin"
//   token_dtype = "uint16"       # uint8, uint16, uint32 or int32
//   eval_tokens = "val.bin"      # optional
//   batch = 8
//   seq = 64
//   steps = 200
//   seed = 0
//   eval_every = 50              # 0: only at the end
//   eval_batches = 4
//   [optimizer]
//   type = "adamw"               # torch.optim's name in lower case
//   lr = 3e-3                    # the other keys: HyperParams' fields; betas = [b1, b2]
//   weight_decay = 0.1
//   [schedule]
//   kind = "cosine"              # constant, linear or cosine
//   warmup_steps = 20
//   min_lr = 3e-4
//   [config]                     # job config keys (docs/config.md)
//   checkpoint_dir = "ckpt"      # relative paths: to this file
//   checkpoint_every = 50
//
// Free functions; the CLI calls them from its main thread.
#ifndef RANNC_CLIENT_DETACHED_CLI_H_
#define RANNC_CLIENT_DETACHED_CLI_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/rannc_client.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

// The job file at `path` as a spec, its paths made absolute. INVALID_ARGUMENT naming the key
// for an unknown key or a value of the wrong type; NOT_FOUND for a file that does not open.
absl::StatusOr<v1::DetachedJobSpec> ReadJobFile(const std::string& path);

// The commands print what they show; an error comes back for the CLI to report.
//
// Whether `rannc submit` sends the job's files (UploadFile) instead of naming them: always, never,
// or when the daemon's host (GetInfo's hostname) is not this one.
enum class UploadFiles { kIfRemote, kYes, kNo };

// `rannc submit FILE [--follow] [--upload|--no-upload]`: prints the job id (first sending the
// files when `upload` says so). With `follow`, then the job's log until it
// ends, or `interrupted` says so (it goes on), with a progress bar on stderr when that is a
// terminal (tqdm's: percent, bar, step/steps, elapsed<ETA, tokens/s, loss); through a restart
// of the daemon when it answers again within `wait_for_daemon` (--wait-for-daemon). Returns the
// exit status: 0, or 1 for a followed job that ended other than done (or did not end: its
// daemon stopped).
absl::StatusOr<int> RunSubmit(const Client& client, const std::string& file, bool follow,
                              UploadFiles upload, absl::Duration wait_for_daemon,
                              const std::function<bool()>& interrupted);
// `rannc status JOB`: state, progress, loss, rate, ETA, evaluation, plan and memory.
absl::Status RunStatus(const Client& client, const std::string& job);
// `rannc logs JOB [-f]`; followed through a restart of the daemon as RunSubmit's.
absl::Status RunLogs(const Client& client, const std::string& job, bool follow,
                     absl::Duration wait_for_daemon, const std::function<bool()>& interrupted);
// `rannc queue`'s table of ListDetachedJobs' statuses, a header row first: id, name, state,
// place in the queue, step of steps, last loss, tokens/s, elapsed time, ETA, and what a queued
// job waits for or why a job failed.
std::vector<std::vector<std::string>> QueueTable(const std::vector<v1::DetachedStatus>& jobs);
// `rannc cancel JOB`.
absl::Status RunCancel(const Client& client, const std::string& job);

}  // namespace rannc

#endif  // RANNC_CLIENT_DETACHED_CLI_H_
