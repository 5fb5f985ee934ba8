// The leading daemon's line to another daemon's part of a job over the cluster
// (docs/cluster.md): the calls it makes there while running its own share. Two implementations:
// GrpcPartChannels (grpc_part_channel.h: JobPartService on the member) and FakePartChannels
// (fake_part_channel.h: another in-process "daemon", for tests), as cluster::PeerTransport has.
//
//   absl::StatusOr<std::unique_ptr<PartChannel>> part =
//       channels->CreatePart(address, spec, part_spec, model_bytes);
//   absl::Status s = (*part)->Step(hypers);
//
// Errors: UNAVAILABLE means the member could not be reached (gone, or cut off): the caller takes
// it for lost. Any other status is the part's own answer, its message naming the daemon; a
// part answers ABORTED when its step failed because another daemon's did.
//
// Thread-safety: one call at a time per channel, except Notify, CancelCalls and
// CheckpointShare, which may come from any thread while a call is in flight. Channels outlive no job: the Coordinator owns them.
#ifndef RANNC_DAEMON_SERVER_PART_CHANNEL_H_
#define RANNC_DAEMON_SERVER_PART_CHANNEL_H_

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/optim/optimizer.h"
#include "rannc/v1/checkpoint.pb.h"
#include "rannc/v1/job_part.pb.h"

namespace rannc {

using OutputGrads = std::vector<std::pair<size_t, at::Tensor>>;  // by output index
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// One tensor of the optimizer's state, as torch.optim's state_dict holds it: a parameter (its
// entry name), a key ("step", "exp_avg", "momentum_buffer", ...), the value.
struct OptimizerEntry {
  std::string param;
  std::string key;
  at::Tensor value;
};

// One-way notices: best effort within a deadline, the answer ignored (a part that does not
// answer is gone or cut off, and found lost by the cluster's heartbeats anyway).
enum class PartNotice {
  kAbortStep,  // fail the step in progress at once
  kUndeploy,   // release the devices, keeping the state on the host
  kDelete,     // the job is gone
};

// The job's calls that take and give no batch: the optimizer step, allreduce_grads(),
// zero_grad(), recreate_all_communicators(), and clip_grad_norm's two rounds over the daemons
// (the norms of the gradients a daemon holds, by parameter name; then every copy there times
// `coefficient`). Only kGradNorms answers with tensors.
struct JobOp {
  enum class Kind {
    kStep, kAllReduceGrads, kZeroGrad, kRecreateCommunicators, kGradNorms, kScaleGrads
  };
  Kind kind = Kind::kStep;
  std::vector<HyperParams> hypers;  // kStep: per param group
  bool set_to_none = false;         // kZeroGrad
  double norm_type = 2;             // kGradNorms
  at::Tensor coefficient;           // kScaleGrads: a scalar
};

class PartChannel {
 public:
  virtual ~PartChannel() = default;

  const std::string& address() const { return address_; }

  // The part's share of the outputs (they add up over the daemons to the outputs).
  virtual absl::StatusOr<std::vector<at::Tensor>> Forward(const std::vector<at::Tensor>& inputs,
                                                          bool requires_grad,
                                                          bool delay_grad_allreduce) = 0;
  virtual absl::Status Backward(const OutputGrads& grads, bool retain_graph,
                                bool delay_grad_allreduce) = 0;
  virtual absl::StatusOr<NamedTensors> Run(const JobOp& op) = 0;
  // A parameter or buffer (or its gradient; nullopt when None) the part holds; NOT_FOUND when
  // another daemon holds it.
  virtual absl::StatusOr<std::optional<at::Tensor>> GetTensor(const std::string& name,
                                                              bool grad) = 0;
  // state_dict entries; the part takes those it holds.
  virtual absl::Status LoadState(const std::map<std::string, at::Tensor>& state) = 0;
  // The optimizer's state of the parameters the part holds; replacing it (the part takes the
  // entries of the parameters it holds).
  virtual absl::StatusOr<std::vector<OptimizerEntry>> OptimizerState() = 0;
  virtual absl::Status LoadOptimizerState(const std::vector<OptimizerEntry>& state) = 0;
  // A checkpoint over several daemons (docs/checkpoints.md): the part copies the tensors it
  // writes (LocalJob::Saves) to host memory and starts writing them into `dir`, the leader's
  // uncommitted checkpoint directory, as files `<prefix>*.pt`; CheckpointShare waits for that
  // write of checkpoint `step` and answers its files and entries. CheckpointShare may come
  // from any thread while another call is in flight.
  virtual absl::Status StartCheckpointShare(const std::string& dir, const std::string& prefix,
                                            int64_t step) = 0;
  virtual absl::StatusOr<v1::CheckpointShare> CheckpointShare(int64_t step) = 0;
  // A job resumed from a checkpoint: the part's engine takes the loss scaler's state.
  virtual absl::Status RestoreLossScaler(double scale, int good_steps, int skipped_steps) = 0;
  virtual void Notify(PartNotice notice, std::chrono::milliseconds deadline) = 0;
  // Abandons the calls in flight (they fail soon): a member was lost, and one cut off by a
  // partition would otherwise be waited for until TCP gives up.
  virtual void CancelCalls() = 0;

 protected:
  explicit PartChannel(std::string address) : address_(std::move(address)) {}

 private:
  const std::string address_;
};

// Creates parts on the cluster's members. Thread-safe.
class PartChannels {
 public:
  virtual ~PartChannels() = default;
  // The job's part on the daemon at `address`: `spec` (the client's, with the leader's plan to
  // load) run on `part`'s devices, from the TorchScript archive `model_bytes`.
  virtual absl::StatusOr<std::unique_ptr<PartChannel>> CreatePart(
      const std::string& address, const v1::JobSpec& spec, const v1::PartSpec& part,
      const std::string& model_bytes) = 0;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_PART_CHANNEL_H_
