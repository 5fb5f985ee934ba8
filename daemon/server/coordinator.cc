#include "daemon/server/coordinator.h"

#include <chrono>
#include <future>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/optim/grad_norm.h"

namespace rannc {
namespace {

// Which of several daemons' errors in one step the client gets: the cause (a bad input, say)
// rather than its consequences on the other daemons, a peer that went away (UNAVAILABLE) or a
// step abandoned (ABORTED).
int ErrorRank(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return 0;
    case absl::StatusCode::kAborted: return 1;
    case absl::StatusCode::kUnavailable: return 2;
    default: return 3;
  }
}

}  // namespace

Coordinator::Coordinator(const JobSettings& settings, PartChannels* channels)
    : settings_(settings), channels_(channels) {}

Coordinator::~Coordinator() { NotifyParts(PartNotice::kDelete, std::chrono::seconds(10)); }

absl::Status Coordinator::CreateParts(const v1::Deployment& plan,
                                      const std::vector<at::Tensor>& example_inputs,
                                      const std::string& model_bytes,
                                      const std::function<absl::Status()>& local) {
  if (settings_.members.empty()) return local();
  // The members whose devices the plan uses each get a part: the client's spec with the plan
  // to load and the devices to run.
  std::set<int> used;
  for (const v1::DeploymentStage& s : plan.stages()) used.insert(s.devices().begin(),
                                                                 s.devices().end());
  v1::JobSpec spec = settings_.spec;
  spec.mutable_options()->set_load_deployment(plan.SerializeAsString());
  spec.clear_example_inputs();
  spec.clear_model_tensors();  // in model_bytes; they may name the client's shm files
  // A part lives as long as the job that leads it (the Coordinator deletes it), not by a lease;
  // the client ranks meet here, at the leader.
  spec.mutable_options()->set_lease_ms(0);
  spec.mutable_options()->set_client_world(0);
  for (const at::Tensor& t : example_inputs) {
    absl::Status encoded = EncodeTensor(t, spec.add_example_inputs(), nullptr);
    if (!encoded.ok()) return encoded;
  }
  spec.set_model_bytes(model_bytes.size());
  std::vector<std::string> addresses;
  std::vector<std::future<absl::StatusOr<std::unique_ptr<PartChannel>>>> created;
  for (const JobSettings::Member& member : settings_.members) {
    v1::PartSpec part;
    for (int d : member.devices) {
      if (used.count(d)) part.add_local_devices(d);
    }
    if (part.local_devices().empty()) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      part_members_.insert(member.address);
    }
    part.set_store_address(settings_.self_address);
    part.set_num_devices(settings_.plan_target.num_devices);
    part.set_group(settings_.engine_group);
    addresses.push_back(member.address);
    // At once: the parts' engines meet this daemon's while `local` deploys it.
    created.push_back(std::async(std::launch::async, [this, address = member.address, part,
                                                      &spec, &model_bytes] {
      return channels_->CreatePart(address, spec, part, model_bytes);
    }));
  }
  absl::Status status = local();
  for (size_t i = 0; i < created.size(); ++i) {
    absl::StatusOr<std::unique_ptr<PartChannel>> part = created[i].get();
    if (part.ok()) {
      parts_.push_back(std::move(*part));
    } else if (status.ok()) {
      status = Annotate(part.status(), absl::StrCat("creating this job's part on ",
                                                    addresses[i]));
    }
  }
  return status;
}

absl::Status Coordinator::OnParts(const Call& call, const std::function<absl::Status()>& local) {
  aborting_ = false;
  std::vector<std::future<absl::Status>> remote;
  for (size_t i = 0; i < parts_.size(); ++i) {
    remote.push_back(std::async(std::launch::async, [this, &call, i] {
      PartChannel& part = *parts_[i];
      absl::Status s = call(part, i);
      if (s.code() == absl::StatusCode::kUnavailable) {
        MemberLost(part.address(), std::string(s.message()));  // gone, or cut off
      } else if (!s.ok() && s.code() != absl::StatusCode::kAborted) {
        AbortEverywhere();  // the others' waits on this part would only time out
      }
      return s;
    }));
  }
  absl::Status status = local();
  if (!status.ok()) AbortEverywhere();
  for (std::future<absl::Status>& f : remote) {
    // A daemon cut off by a partition (not killed: no connection reset) never answers, and its
    // call would wait until TCP gives up, minutes later. Once a member is lost (heartbeats),
    // stop waiting for any part.
    while (f.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
      if (Lost().ok()) continue;
      for (const std::unique_ptr<PartChannel>& part : parts_) part->CancelCalls();
    }
    absl::Status s = f.get();
    if (ErrorRank(s) > ErrorRank(status)) status = s;
  }
  if (absl::Status lost = Lost(); !lost.ok()) return lost;
  if (!status.ok()) {
    // Every daemon starts the next call from a fresh engine, with what it had before this one.
    if (on_failure_) on_failure_();
    UndeployParts();
  }
  return status;
}

void Coordinator::NotifyParts(PartNotice notice, std::chrono::milliseconds deadline) {
  std::vector<std::future<void>> sent;
  for (std::unique_ptr<PartChannel>& part : parts_) {
    PartChannel* p = part.get();
    sent.push_back(std::async(std::launch::async, [p, notice, deadline] {
      p->Notify(notice, deadline);
    }));
  }
  for (std::future<void>& f : sent) f.get();
}

void Coordinator::AbortEverywhere() {
  if (aborting_.exchange(true)) return;
  AbortStep();
  // Briefly: a part cut off by a partition does not answer.
  NotifyParts(PartNotice::kAbortStep, std::chrono::seconds(2));
}

void Coordinator::UndeployParts() {
  if (!Lost().ok()) return;  // nothing to keep in step
  NotifyParts(PartNotice::kUndeploy, std::chrono::seconds(30));
}

absl::Status Coordinator::Push(const std::map<std::string, at::Tensor>& state) {
  return OnParts([&](PartChannel& part, size_t) { return part.LoadState(state); },
                 [] { return absl::OkStatus(); });
}

absl::Status Coordinator::GatherOptimizerState(std::vector<OptimizerEntry>* state) {
  std::set<std::string> seen;  // parameters already reported
  for (const OptimizerEntry& e : *state) seen.insert(e.param);
  for (std::unique_ptr<PartChannel>& part : parts_) {
    absl::StatusOr<std::vector<OptimizerEntry>> theirs = part->OptimizerState();
    if (!theirs.ok()) return theirs.status();
    std::set<std::string> added;
    for (OptimizerEntry& e : *theirs) {
      if (seen.count(e.param)) continue;  // replicated or tied: the same state
      added.insert(e.param);
      state->push_back(std::move(e));
    }
    seen.insert(added.begin(), added.end());
  }
  return absl::OkStatus();
}

absl::Status Coordinator::PushOptimizerState(const std::vector<OptimizerEntry>& state,
                                             const std::function<absl::Status()>& local) {
  return OnParts([&](PartChannel& part, size_t) { return part.LoadOptimizerState(state); },
                 local);
}

absl::StatusOr<std::vector<v1::CheckpointShare>> Coordinator::CheckpointShares(int64_t step) {
  std::vector<v1::CheckpointShare> shares;
  absl::Status first;
  // Every part is waited for, even after one failed: each write ends before the directory it
  // writes into is abandoned.
  for (std::unique_ptr<PartChannel>& part : parts_) {
    absl::StatusOr<v1::CheckpointShare> share = part->CheckpointShare(step);
    if (share.ok()) {
      shares.push_back(std::move(*share));
    } else if (first.ok()) {
      first = share.status();
    }
  }
  if (!first.ok()) return first;
  return shares;
}

absl::StatusOr<std::optional<at::Tensor>> Coordinator::ReadTensor(const std::string& name,
                                                                  bool grad) {
  for (std::unique_ptr<PartChannel>& part : parts_) {
    absl::StatusOr<std::optional<at::Tensor>> t = part->GetTensor(name, grad);
    if (t.status().code() == absl::StatusCode::kNotFound) continue;  // held elsewhere
    return t;
  }
  return absl::NotFoundError(absl::StrCat("no daemon of this job holds ", name));
}

absl::StatusOr<double> Coordinator::Clip(
    double max_norm, double norm_type, const std::vector<std::string>& order,
    const std::function<absl::StatusOr<NamedTensors>()>& local_norms,
    const std::function<absl::Status(const at::Tensor&)>& local_scale) {
  // Round 1: every daemon's norms of the gradients it holds (a tied parameter held by several
  // reports the same all-reduced gradient: it is counted once).
  std::map<std::string, at::Tensor> norms;
  std::mutex norms_mu;
  auto keep = [&](const NamedTensors& named) {
    std::lock_guard<std::mutex> lock(norms_mu);
    for (const auto& [name, norm] : named) norms.emplace(name, norm);
  };
  absl::Status status = OnParts(
      [&](PartChannel& part, size_t) -> absl::Status {
        JobOp op;
        op.kind = JobOp::Kind::kGradNorms;
        op.norm_type = norm_type;
        absl::StatusOr<NamedTensors> theirs = part.Run(op);
        if (!theirs.ok()) return theirs.status();
        keep(*theirs);
        return absl::OkStatus();
      },
      [&]() -> absl::Status {
        absl::StatusOr<NamedTensors> mine = local_norms();
        if (!mine.ok()) return mine.status();
        keep(*mine);
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  std::vector<at::Tensor> ordered;  // in the client's parameter order, as PyTorch sums them
  for (const std::string& name : order) {
    auto it = norms.find(name);
    if (it != norms.end()) ordered.push_back(it->second);
  }
  if (ordered.empty()) return 0.0;
  // Round 2: every daemon scales its copies by the one coefficient.
  at::Tensor total, coefficient;
  status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    at::NoGradGuard no_grad;
    total = CombineNorms(ordered, norm_type);
    coefficient = ClipCoefficient(total, max_norm);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  JobOp scale;
  scale.kind = JobOp::Kind::kScaleGrads;
  scale.coefficient = coefficient;
  status = OnParts([&](PartChannel& part, size_t) { return part.Run(scale).status(); },
                   [&] { return local_scale(coefficient); });
  if (!status.ok()) return status;
  return total.item<double>();
}

bool Coordinator::MemberLost(const std::string& address, const std::string& reason) {
  // A member whose devices the plan leaves unused holds no part: its loss is not this job's.
  const bool leader = settings_.is_part && settings_.engine_store_address == address;
  std::lock_guard<std::mutex> lock(mu_);
  if (!leader && part_members_.count(address) == 0) return false;
  if (lost_.ok()) {
    lost_ = absl::UnavailableError(absl::StrCat(
        "daemon ", address, ", which ", leader ? "leads" : "runs part of",
        " this job, is lost (", reason,
        "); the job cannot go on: delete it and create it again once the cluster is whole"));
  }
  cancel_->store(true);
  return leader;
}

void Coordinator::AbortStep() {
  std::lock_guard<std::mutex> lock(mu_);
  cancel_->store(true);
}

absl::Status Coordinator::Lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

std::shared_ptr<std::atomic<bool>> Coordinator::NewCancelFlag() {
  // A fresh flag per engine: an aborted step leaves the next engine untouched.
  std::lock_guard<std::mutex> lock(mu_);
  cancel_ = std::make_shared<std::atomic<bool>>(!lost_.ok());
  return cancel_;
}

absl::Status Coordinator::PartStatus(absl::Status status) const {
  if (!settings_.is_part || status.code() != absl::StatusCode::kUnavailable) return status;
  return absl::AbortedError(status.message());
}

}  // namespace rannc
