// The cross-daemon half of a job (docs/cluster.md). On the daemon that leads a job over the
// cluster it owns the parts (one PartChannel per member whose devices the plan uses) and makes
// each call on all of them at once while this daemon runs its own share (OnParts); on every
// daemon of the job (leader or part) it holds whether the job was lost with a member, and the
// flag that cancels the engine's step in progress.
//
//   Coordinator coordinator(settings, channels);
//   coordinator.set_on_failure([&] { /* release this daemon's engine */ });
//   absl::Status s = coordinator.OnParts(
//       [&](PartChannel& part, size_t) { return part.Run(op); },
//       [&] { return engine->Step(hypers); });
//
// A part that cannot be reached loses the job (MemberLost: every later call fails UNAVAILABLE
// naming it); any other failure, here or on a part, aborts the step everywhere at once
// (PartNotice::kAbortStep), and every daemon's engine is released, losing nothing, to be
// rebuilt by the next call.
//
// Thread-safety: CreateParts, OnParts and the calls built on it come from the job's calls,
// which the Job serializes; MemberLost, AbortStep, Lost and PartStatus may come from any thread.
#ifndef RANNC_DAEMON_SERVER_COORDINATOR_H_
#define RANNC_DAEMON_SERVER_COORDINATOR_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/part_channel.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {

class Coordinator {
 public:
  // `channels` (not owned; null when `settings` has no members) creates the members' parts.
  Coordinator(const JobSettings& settings, PartChannels* channels);
  // Deletes the parts (PartNotice::kDelete), waiting at most ten seconds for each.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Whether this daemon leads parts of the job on other daemons.
  bool leads() const { return !parts_.empty(); }
  // What OnParts runs after a failure: releasing this daemon's engine (losing nothing).
  void set_on_failure(std::function<void()> release) { on_failure_ = std::move(release); }

  // Creates a part on every member whose devices `plan` uses (the client's spec, the plan to
  // load, this daemon's store) while `local` deploys here.
  absl::Status CreateParts(const v1::Deployment& plan,
                           const std::vector<at::Tensor>& example_inputs,
                           const std::string& model_bytes,
                           const std::function<absl::Status()>& local);

  // One call on every part at once (`index`: the part's, 0..) while `local` runs here. The
  // status is the cause of a failure rather than its consequences elsewhere (ABORTED, or a
  // member lost).
  using Call = std::function<absl::Status(PartChannel& part, size_t index)>;
  absl::Status OnParts(const Call& call, const std::function<absl::Status()>& local);

  // A tensor (or its gradient) a part holds; NOT_FOUND when none does.
  absl::StatusOr<std::optional<at::Tensor>> ReadTensor(const std::string& name, bool grad);
  // state_dict entries to every part (each takes those it holds).
  absl::Status Push(const std::map<std::string, at::Tensor>& state);
  // The optimizer's state on every part, appended to `state` (a parameter's entries once, as
  // the first daemon holding it reports them); and `state` to every part, while `local` loads
  // it here.
  absl::Status GatherOptimizerState(std::vector<OptimizerEntry>* state);
  absl::Status PushOptimizerState(const std::vector<OptimizerEntry>& state,
                                  const std::function<absl::Status()>& local);
  // clip_grad_norm over every daemon: the parts' norms and this daemon's (`local_norms`, by
  // parameter name) combined in `order` (the client's parameter order, as PyTorch sums them),
  // then every copy scaled by the one coefficient (`local_scale` here). Returns the total norm.
  absl::StatusOr<double> Clip(double max_norm, double norm_type,
                              const std::vector<std::string>& order,
                              const std::function<absl::StatusOr<NamedTensors>()>& local_norms,
                              const std::function<absl::Status(const at::Tensor&)>& local_scale);
  // The parts' shares of checkpoint `step` (PartChannel::CheckpointShare), in the parts' order,
  // once each is written. May come from another thread (the checkpoint writer's) while the
  // job's calls run.
  absl::StatusOr<std::vector<v1::CheckpointShare>> CheckpointShares(int64_t step);
  // Every part releases its engine, as this daemon has; nothing once the job is lost.
  void UndeployParts();

  // A daemon running a part of this job, or leading it, is gone (cluster::OnMemberDown): the
  // step in progress fails at once, and every later call fails with UNAVAILABLE naming it.
  // Returns whether it led this job (a part: nothing can use it any more). No-op for a daemon
  // the job does not use.
  bool MemberLost(const std::string& address, const std::string& reason);
  // The leading daemon failed the step in progress: its waits here are abandoned at once.
  void AbortStep();
  // OK, or why the job was lost.
  absl::Status Lost() const;
  // A fresh flag that cancels one engine's steps (PipelineEngine's EngineOptions::cancel), set
  // already when the job is lost.
  std::shared_ptr<std::atomic<bool>> NewCancelFlag();
  // On a part, a step's failure to reach a peer (UNAVAILABLE) is the consequence of a failure
  // elsewhere, which the leader reports: ABORTED, so the leader does not take this daemon for
  // lost. Other statuses, and every status off a part, pass unchanged.
  absl::Status PartStatus(absl::Status status) const;

 private:
  // Fails the step in progress here and on every part, at most once per OnParts.
  void AbortEverywhere();
  void NotifyParts(PartNotice notice, std::chrono::milliseconds deadline);

  const JobSettings& settings_;
  PartChannels* const channels_;
  std::vector<std::unique_ptr<PartChannel>> parts_;
  std::function<void()> on_failure_;
  std::atomic<bool> aborting_{false};
  mutable std::mutex mu_;  // guards part_members_, lost_ and cancel_
  std::set<std::string> part_members_;  // the members given a part (asked to create one)
  absl::Status lost_;
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_COORDINATOR_H_
