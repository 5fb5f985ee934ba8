// Durable jobs (ranncd --state-dir; docs/checkpoints.md): each job that writes checkpoints has a
// record on disk (rannc.v1.JobRecord: the client's spec, its TorchScript archive, the example
// inputs and tensors sent beside the archive, the plan), so that after a restart the daemon
// lists it as suspended and can recreate it from its latest checkpoint. A record goes when its
// job is deleted.
//
//   JobRecords records("/var/lib/rannc");              // "" : none kept
//   records.Save(id, spec, model_bytes, examples, sent, plan);
//   records.SaveInBackground(id, spec, model_bytes, examples, sent, plan);  // CreateJob's way
//   for (const v1::JobRecord& r : records.List()) ...   // suspended unless live
//   absl::StatusOr<JobRecords::Loaded> job = records.Load(id);
//
// gRPC-free; thread-safe (each record is written into a new directory renamed into place).
#ifndef RANNC_DAEMON_SERVER_JOB_RECORDS_H_
#define RANNC_DAEMON_SERVER_JOB_RECORDS_H_

#include <future>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/graph/torchscript_import.h"
#include "rannc/v1/checkpoint.pb.h"

namespace rannc {

class JobRecords {
 public:
  // Records under `state_dir`/jobs; an empty `state_dir` keeps none (every call is a no-op).
  explicit JobRecords(std::string state_dir);
  ~JobRecords();  // waits for the records still being written

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }  // <state_dir>/jobs, or ""
  absl::Status Save(const std::string& job_id, const v1::JobSpec& spec,
                    const std::string& model_bytes, const std::vector<at::Tensor>& example_inputs,
                    const SentTensors& sent, const v1::Deployment& plan);
  // Save on a thread of its own, so that creating a job does not wait for its record's fsyncs
  // (a failure is logged: the job runs, not durable). Every other call waits for the records
  // being written first, so they see them.
  void SaveInBackground(std::string job_id, v1::JobSpec spec, std::string model_bytes,
                        std::vector<at::Tensor> example_inputs, SentTensors sent,
                        v1::Deployment plan);
  // Removing a record that does not exist is OK.
  absl::Status Remove(const std::string& job_id);
  // Every record that reads, oldest first; those that do not are logged and skipped.
  std::vector<v1::JobRecord> List() const;
  // The record of the job `id_or_name` (an id, else the newest record of that name): NOT_FOUND.
  absl::StatusOr<v1::JobRecord> Find(const std::string& id_or_name) const;

  struct Loaded {
    v1::JobRecord record;
    std::string model_bytes;
    std::vector<at::Tensor> example_inputs;
    SentTensors sent;
  };
  absl::StatusOr<Loaded> Load(const std::string& job_id) const;

 private:
  std::string JobDir(const std::string& job_id) const;
  void WaitForSaves() const;

  const std::string dir_;  // <state_dir>/jobs, or ""
  mutable std::mutex mu_;
  mutable std::mutex pending_mu_;
  mutable std::vector<std::shared_future<void>> pending_;  // SaveInBackground's writes
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_RECORDS_H_
