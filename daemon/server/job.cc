#include "daemon/server/job.h"

#include <chrono>
#include <future>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/files.h"
#include "daemon/common/json_log.h"
#include "daemon/common/status.h"
#include "daemon/server/job_model.h"
#include "daemon/server/rank_batches.h"

namespace rannc {

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kDeployed: return "DEPLOYED";
    case JobState::kUndeployed: return "UNDEPLOYED";
  }
  return "UNKNOWN";
}

namespace {

// What the optimizer step and ClipGradNorm answer while delayed backwards' gradients are not
// reduced: RaNNC requires allreduce_grads() before them, and so do we rather than use partial
// sums.
absl::Status NotReduced(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": the gradients of delayed backwards (delay_grad_allreduce(True)) are not "
      "all-reduced yet; call allreduce_grads() first"));
}

const char* OpName(JobOp::Kind kind) {
  switch (kind) {
    case JobOp::Kind::kStep: return "step";
    case JobOp::Kind::kAllReduceGrads: return "allreduce_grads";
    case JobOp::Kind::kZeroGrad: return "zero_grad";
    case JobOp::Kind::kRecreateCommunicators: return "recreate_all_communicators";
    case JobOp::Kind::kGradNorms: return "grad_norms";
    case JobOp::Kind::kScaleGrads: return "scale_grads";
  }
  return "op";
}

}  // namespace

Job::Job(std::string id, JobSettings settings, PartChannels* channels)
    : settings_(std::move(settings)), coordinator_(settings_, channels) {
  info_.id = std::move(id);
  info_.name = settings_.name;
  info_.client_world = settings_.client_world;
  info_.amp = settings_.amp.has_value();
  info_.lease = settings_.lease;
  info_.created = std::chrono::system_clock::now();
  NameJob(info_.id, info_.name);  // JSON log lines about the job carry its name
}

Job::~Job() { ForgetJob(info_.id); }

absl::StatusOr<std::unique_ptr<Job>> Job::Create(std::string id, JobSettings settings,
                                                 const std::string& model_bytes,
                                                 const std::vector<at::Tensor>& example_inputs,
                                                 const SentTensors& sent,
                                                 PartChannels* channels) {
  // A resumed job's checkpoint is read meanwhile.
  std::future<ResumeRead> resume_read;
  if (settings.checkpoints.resume >= 0 && !settings.is_part) {
    resume_read = std::async(std::launch::async, &Job::ReadResume, settings.checkpoints,
                             settings.name);
  }
  auto phase = std::chrono::steady_clock::now();
  absl::StatusOr<ImportedModel> model =
      ImportJobModel(settings, model_bytes, sent, example_inputs);
  if (!model.ok()) return model.status();
  std::unique_ptr<Job> job(new Job(std::move(id), std::move(settings), channels));
  JobInfo& info = job->info_;
  info.import_s = SecondsSince(phase);
  LocalJob::Made made;
  Coordinator* coordinator = &job->coordinator_;
  absl::StatusOr<std::unique_ptr<LocalJob>> local = LocalJob::Create(
      job->settings_, *model, example_inputs,
      [coordinator] { return coordinator->NewCancelFlag(); }, &made);
  if (!local.ok()) return local.status();
  job->local_ = std::move(*local);
  LocalJob* local_job = job->local_.get();
  job->coordinator_.set_on_failure([local_job] { local_job->Release(); });
  info.plan = std::move(made.plan);
  info.outputs = std::move(made.output_specs);
  info.ir_s = made.ir_s;
  info.plan_s = made.plan_s;
  std::set<int> used;
  for (const v1::DeploymentStage& s : info.plan.stages()) {
    used.insert(s.devices().begin(), s.devices().end());
  }
  const JobSettings& s = job->settings_;
  for (int d : used) {
    info.devices.push_back(d < static_cast<int>(s.device_names.size())
                               ? s.device_names[d]
                               : absl::StrCat(s.plan_target.device_type, ":", d));
  }

  job->last_hypers_ = s.optimizer.group_hyper;
  if (resume_read.valid() && s.members.empty()) {
    // On one daemon the checkpoint goes into the job before its devices get the parameters, so
    // they get the checkpoint's once (and the optimizer state with them).
    absl::Status resumed = job->Resume(resume_read.get());
    if (!resumed.ok()) return resumed;
  }
  phase = std::chrono::steady_clock::now();
  std::string whole;
  if (!s.members.empty() && !sent.empty()) {
    // The parts take one whole archive: the sent tensors go back into it.
    absl::StatusOr<std::string> serialized = SerializeModule(*model);
    if (!serialized.ok()) return serialized.status();
    whole = std::move(*serialized);
  }
  absl::Status deployed = job->coordinator_.CreateParts(
      info.plan, example_inputs, whole.empty() ? model_bytes : whole,
      [local_job] { return local_job->EnsureDeployed(); });
  if (!deployed.ok()) return Annotate(deployed, "deploying the model on its devices");
  info.place_s = SecondsSince(phase);
  // The job holds the model's tensors now; the module's references to them would only keep
  // memory the job lets go of (ReleaseModuleTensors).
  ReleaseModuleTensors(&*model);
  if (s.client_world > 1) {
    job->client_ranks_ = std::make_unique<ClientRendezvous>(s.client_world, s.client_timeout);
  }
  if (resume_read.valid()) {
    // Over several daemons, once every part exists: the state goes to the parts that hold it.
    absl::Status resumed = job->Resume(resume_read.get());
    if (!resumed.ok()) return resumed;
  }
  job->counters_ = local_job->counters();
  job->metrics_.SetPlan(info.plan.estimated_step_ms() / 1000, info.plan.estimated_bubble());
  job->metrics_.SetState(JobStateName(job->state_));
  job->metrics_.SetSteps(job->steps_);
  job->MeasuredMemory();
  return job;
}

// ---------------------------------------------------------------------------------------------
// Metrics (job_metrics.h).

void Job::Measured(std::chrono::steady_clock::time_point start, JobMetrics::Call call) {
  metrics_.AddBusy(SecondsSince(start), call);
  metrics_.SetState(JobStateName(state_));
  // A lost job's engine may still be waiting on the daemon that went: it is not read.
  if (coordinator_.Lost().ok()) MeasuredMemory();
}

void Job::MeasuredForward(const std::vector<at::Tensor>& inputs) {
  // Samples: the first input's leading dimension. Tokens: the elements of the first integer
  // input (a language model's token ids), else the samples.
  int64_t samples = 0, tokens = -1;
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) continue;
    if (samples == 0 && t.dim() > 0) samples = t.size(0);
    if (tokens < 0 && at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
      tokens = t.numel();
    }
  }
  metrics_.AddForward(samples, tokens < 0 ? samples : tokens);
}

void Job::MeasuredStep() {
  metrics_.EndStep(steps_, counters_ ? counters_->compute_ns.load() : 0,
                   counters_ ? counters_->schedule_ns.load() : 0);
}

void Job::MeasuredMemory() {
  std::vector<int64_t> bytes, peak;
  LossScaler scaler(settings_.loss_scale);
  local_->Usage(&bytes, &peak, &scaler);
  metrics_.SetMemory(std::move(bytes), std::move(peak));
}

JobMetrics::Snapshot Job::Measure() const {
  JobMetrics::Snapshot s = metrics_.Read();
  if (counters_) s.data_plane_bytes = counters_->data_plane_bytes->load();
  const checkpoint::CheckpointWriter::Totals written = writer_.totals();
  s.checkpoints_written = written.written;
  s.checkpoints_failed = written.failed;
  s.checkpoint_bytes = written.bytes;
  return s;
}

RemoteRead Job::Remote() {
  if (!coordinator_.leads()) return nullptr;
  return [this](const std::string& name) { return coordinator_.ReadTensor(name, false); };
}

std::vector<int> Job::OutputBatchDims() const {
  std::vector<int> dims;
  for (const OutputSpec& o : info_.outputs) dims.push_back(o.batch_dim);
  return dims;
}

absl::Status Job::AddMode(const ModelMode& mode, const std::string& model_bytes) {
  absl::StatusOr<ImportedModel> model = ImportTorchScript(model_bytes);
  if (!model.ok()) return model.status();
  std::lock_guard<std::mutex> lock(mu_);
  return local_->AddMode(mode, std::move(*model));
}

bool Job::SetMode(const ModelMode& mode) {
  std::lock_guard<std::mutex> lock(mu_);
  return local_->SetMode(mode);
}

absl::StatusOr<std::vector<at::Tensor>> Job::ForwardLocked(const std::vector<at::Tensor>& inputs,
                                                           bool requires_grad,
                                                           bool delay_grad_allreduce) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<at::Tensor>> out =
      ForwardUnmeasured(inputs, requires_grad, delay_grad_allreduce);
  Measured(start, JobMetrics::Call::kForward);
  if (out.ok() && requires_grad) MeasuredForward(inputs);
  return out;
}

absl::StatusOr<std::vector<at::Tensor>> Job::ForwardUnmeasured(
    const std::vector<at::Tensor>& inputs, bool requires_grad, bool delay_grad_allreduce) {
  absl::Status checked = local_->CheckInputs(inputs);
  if (!checked.ok()) return checked;
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  std::map<std::string, at::Tensor> buffers;
  absl::StatusOr<std::vector<at::Tensor>> outputs;
  auto local = [&]() -> absl::Status {
    state_ = JobState::kDeployed;
    outputs = local_->Forward(inputs, requires_grad, delay_grad_allreduce, Remote(), &buffers);
    if (!outputs.ok()) outputs = coordinator_.PartStatus(outputs.status());
    return outputs.status();
  };
  if (!coordinator_.leads()) {
    local().IgnoreError();
  } else if (local_->flags().planned_mode) {
    // Every daemon's part computes its devices' share; the shares add up to the outputs.
    std::map<size_t, std::vector<at::Tensor>> shares;  // by part, added in part order
    std::mutex shares_mu;
    absl::Status status = coordinator_.OnParts(
        [&](PartChannel& part, size_t index) -> absl::Status {
          absl::StatusOr<std::vector<at::Tensor>> share =
              part.Forward(inputs, requires_grad, delay_grad_allreduce);
          if (!share.ok()) return share.status();
          std::lock_guard<std::mutex> lock(shares_mu);
          shares[index] = std::move(*share);
          return absl::OkStatus();
        },
        local);
    if (!status.ok()) return status;
    at::NoGradGuard no_grad;
    for (const auto& [index, share] : shares) {
      for (size_t i = 0; i < share.size() && i < outputs->size(); ++i) {
        (*outputs)[i] = (*outputs)[i] + share[i].to((*outputs)[i].scalar_type());
      }
    }
  } else {
    // Another mode's graph runs whole here; the buffers it updated go to the parts.
    local().IgnoreError();
    if (outputs.ok() && !buffers.empty()) {
      absl::Status pushed = coordinator_.Push(buffers);
      if (!pushed.ok()) outputs = pushed;
    }
  }
  if (outputs.ok()) ++forwards_;
  return outputs;
}

absl::Status Job::BackwardLocked(const OutputGrads& output_grads, bool retain_graph,
                                 bool delay_grad_allreduce) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = BackwardUnmeasured(output_grads, retain_graph, delay_grad_allreduce);
  Measured(start, JobMetrics::Call::kBackward);
  return s;
}

absl::Status Job::BackwardUnmeasured(const OutputGrads& output_grads, bool retain_graph,
                                     bool delay_grad_allreduce) {
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  auto local = [&] {
    return coordinator_.PartStatus(
        local_->Backward(output_grads, retain_graph, delay_grad_allreduce));
  };
  if (!coordinator_.leads()) return local();
  if (!local_->flags().engine_forward) {
    return absl::UnimplementedError(
        "backward through a graph traced in another mode than the job's (train/eval) is not "
        "supported for a job over several daemons; run that forward under torch.no_grad()");
  }
  return coordinator_.OnParts(
      [&](PartChannel& part, size_t) {
        return part.Backward(output_grads, retain_graph, delay_grad_allreduce);
      },
      local);
}

absl::StatusOr<NamedTensors> Job::RunLocked(const JobOp& op) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<NamedTensors> out = RunUnmeasured(op);
  const bool step = op.kind == JobOp::Kind::kStep;
  // The step's memory too.
  Measured(start, step ? JobMetrics::Call::kStep : JobMetrics::Call::kOther);
  if (out.ok() && step) MeasuredStep();
  return out;
}

absl::StatusOr<NamedTensors> Job::RunUnmeasured(const JobOp& op) {
  // A lost job's engine may still wait on the daemon that went: it is not touched again.
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  const bool pending = local_->flags().grads_pending;
  switch (op.kind) {
    case JobOp::Kind::kStep:
      if (!settings_.optimizer.enabled) {
        return absl::FailedPreconditionError(
            "the job was created without an optimizer; pass one to RaNNCModule to call step()");
      }
      if (pending) return NotReduced("optimizer step");
      if (settings_.fence) {
        if (absl::Status fenced = settings_.fence(); !fenced.ok()) return fenced;
      }
      break;
    case JobOp::Kind::kAllReduceGrads:
      // Every daemon of the job has seen the same backwards, so what is pending here is pending
      // on each part: they all reduce, or none does.
      if (!pending) return NamedTensors();
      break;
    case JobOp::Kind::kRecreateCommunicators:
      // Released: the next call builds them, here and on every part (released with it).
      if (!local_->flags().deployed) return NamedTensors();
      break;
    default:
      break;
  }
  NamedTensors out;
  auto local = [&]() -> absl::Status {
    // These deploy a released job (the others leave it so, or need it deployed already).
    if (op.kind == JobOp::Kind::kStep || op.kind == JobOp::Kind::kAllReduceGrads ||
        op.kind == JobOp::Kind::kGradNorms) {
      state_ = JobState::kDeployed;
    }
    absl::StatusOr<NamedTensors> ran = local_->Run(op);
    if (!ran.ok()) return coordinator_.PartStatus(ran.status());
    out = std::move(*ran);
    return absl::OkStatus();
  };
  absl::Status status;
  if (!coordinator_.leads()) {
    status = local();
  } else {
    status = coordinator_.OnParts([&](PartChannel& part, size_t) { return part.Run(op).status(); },
                                  local);
    // A part that is gone fails the next forward, which names it.
    if (op.kind == JobOp::Kind::kZeroGrad) status = absl::OkStatus();
  }
  if (!status.ok()) return status;
  if (op.kind == JobOp::Kind::kStep) {
    ++steps_;
    if (!settings_.step_log_daemon.empty()) LogStep();
    // The first checkpoint's host memory, made ready while training goes on (pinned_arena.h).
    if (!settings_.checkpoints.dir.empty()) local_->PrepareCheckpointMemory();
    if (!op.hypers.empty()) last_hypers_ = op.hypers;
    const int every = settings_.checkpoints.every;
    if (every > 0 && !settings_.is_part && steps_ % every == 0) CheckpointAfterStep();
  }
  return out;
}

absl::StatusOr<double> Job::ClipLocked(double max_norm, double norm_type) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<double> norm = ClipUnmeasured(max_norm, norm_type);
  Measured(start, JobMetrics::Call::kOther);
  return norm;
}

absl::StatusOr<double> Job::ClipUnmeasured(double max_norm, double norm_type) {
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  if (local_->flags().grads_pending) return NotReduced("clip_grad_norm");
  if (!coordinator_.leads()) return local_->ClipGradNorm(max_norm, norm_type);
  std::vector<std::string> order;  // the client's parameter order
  for (const ParamStore::Entry& e : local_->params().entries()) {
    if (e.is_parameter) order.push_back(e.name);
  }
  return coordinator_.Clip(
      max_norm, norm_type, order,
      [&]() -> absl::StatusOr<NamedTensors> {
        JobOp op;
        op.kind = JobOp::Kind::kGradNorms;
        op.norm_type = norm_type;
        return local_->Run(op);
      },
      [&](const at::Tensor& coefficient) {
        JobOp op;
        op.kind = JobOp::Kind::kScaleGrads;
        op.coefficient = coefficient;
        return local_->Run(op).status();
      });
}

// ---------------------------------------------------------------------------------------------
// The calls, from one client rank of several or the only one.

absl::StatusOr<std::vector<at::Tensor>> Job::Forward(int client_rank,
                                                     const std::vector<at::Tensor>& inputs,
                                                     bool requires_grad,
                                                     bool delay_grad_allreduce) {
  if (!client_ranks_) {
    std::lock_guard<std::mutex> lock(mu_);
    return ForwardLocked(inputs, requires_grad, delay_grad_allreduce);
  }
  using Shares = std::vector<std::vector<at::Tensor>>;
  std::function<absl::StatusOr<Shares>(std::vector<std::vector<at::Tensor>>&)> run =
      [&](std::vector<std::vector<at::Tensor>>& all) -> absl::StatusOr<Shares> {
    std::lock_guard<std::mutex> lock(mu_);
    if (!settings_.gather_inputs) {
      absl::StatusOr<std::vector<at::Tensor>> out =
          ForwardLocked(all[0], requires_grad, delay_grad_allreduce);
      if (!out.ok()) return out.status();
      return Shares(all.size(), *out);
    }
    std::vector<int64_t> rows;
    absl::StatusOr<std::vector<at::Tensor>> gathered = GatherRankInputs(all, &rows);
    if (!gathered.ok()) return gathered.status();
    absl::StatusOr<std::vector<at::Tensor>> out =
        ForwardLocked(*gathered, requires_grad, delay_grad_allreduce);
    if (!out.ok()) return out.status();
    rank_rows_ = rows;
    return SplitRankOutputs(*out, OutputBatchDims(), rows);
  };
  absl::StatusOr<Shares> shares =
      client_ranks_->Meet<std::vector<at::Tensor>, Shares>("forward", client_rank, inputs, run);
  if (!shares.ok()) return shares.status();
  return (*shares)[client_rank];
}

absl::Status Job::Backward(int client_rank, const OutputGrads& output_grads, bool retain_graph,
                           bool delay_grad_allreduce) {
  if (!client_ranks_) {
    std::lock_guard<std::mutex> lock(mu_);
    return BackwardLocked(output_grads, retain_graph, delay_grad_allreduce);
  }
  std::function<absl::StatusOr<bool>(std::vector<OutputGrads>&)> run =
      [&](std::vector<OutputGrads>& all) -> absl::StatusOr<bool> {
    std::lock_guard<std::mutex> lock(mu_);
    OutputGrads grads = all[0];
    if (settings_.gather_inputs) {
      absl::StatusOr<OutputGrads> combined = CombineRankGrads(all, OutputBatchDims(), rank_rows_);
      if (!combined.ok()) return combined.status();
      grads = std::move(*combined);
    }
    absl::Status s = BackwardLocked(grads, retain_graph, delay_grad_allreduce);
    if (!s.ok()) return s;
    return true;
  };
  return client_ranks_->Meet<OutputGrads, bool>("backward", client_rank, output_grads, run)
      .status();
}

void Job::LogStep() {
  const std::string path = JoinPath(checkpoint_job_dir(), "steps.log");
  const std::string line = absl::StrCat(
      std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch()).count(),
      " ", settings_.step_log_daemon, " ", info_.id, " ", steps_, "\n");
  absl::Status appended = AppendToFile(path, line);
  if (!appended.ok()) {
    spdlog::warn("job {}: step {} is not in its step log: {}", info_.id, steps_,
                 appended.ToString());
  }
}

absl::StatusOr<NamedTensors> Job::Run(int client_rank, const JobOp& op) {
  if (!client_ranks_ || op.kind == JobOp::Kind::kRecreateCommunicators) {
    std::lock_guard<std::mutex> lock(mu_);
    return RunLocked(op);
  }
  std::function<absl::StatusOr<NamedTensors>(std::vector<JobOp>&)> run =
      [&](std::vector<JobOp>& all) -> absl::StatusOr<NamedTensors> {
    std::lock_guard<std::mutex> lock(mu_);
    return RunLocked(all[0]);
  };
  return client_ranks_->Meet<JobOp, NamedTensors>(OpName(op.kind), client_rank, op, run);
}

absl::StatusOr<double> Job::ClipGradNorm(int client_rank, double max_norm, double norm_type) {
  if (!client_ranks_) {
    std::lock_guard<std::mutex> lock(mu_);
    return ClipLocked(max_norm, norm_type);
  }
  std::function<absl::StatusOr<double>(std::vector<std::pair<double, double>>&)> run =
      [&](std::vector<std::pair<double, double>>& all) -> absl::StatusOr<double> {
    std::lock_guard<std::mutex> lock(mu_);
    return ClipLocked(all[0].first, all[0].second);
  };
  return client_ranks_->Meet<std::pair<double, double>, double>(
      "clip_grad_norm", client_rank, {max_norm, norm_type}, run);
}

// ---------------------------------------------------------------------------------------------
// State.

absl::StatusOr<std::optional<at::Tensor>> Job::GetTensor(const std::string& name, bool grad) {
  std::lock_guard<std::mutex> lock(mu_);
  if (grad && local_->flags().grads_pending) {
    // On one daemon the engine reads a pending gradient as its holders' sum; over several, the
    // leading daemon reduces everywhere first, and a part holds only its share.
    if (settings_.is_part) return NotReduced(absl::StrCat("gradient of '", name, "'"));
    if (coordinator_.leads()) {
      JobOp reduce;
      reduce.kind = JobOp::Kind::kAllReduceGrads;
      absl::Status reduced = RunLocked(reduce).status();
      if (!reduced.ok()) return Annotate(reduced, "all-reducing the gradients to read them");
    }
  }
  absl::StatusOr<std::optional<at::Tensor>> t = local_->Read(name, grad);
  if (t.status().code() == absl::StatusCode::kNotFound && coordinator_.leads() &&
      local_->params().Find(name) != nullptr) {
    return coordinator_.ReadTensor(name, grad);  // another daemon's part holds it
  }
  return t;
}

std::vector<StateEntry> Job::StateDict() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<at::Tensor> values = local_->Values(Remote());
  std::vector<StateEntry> state;
  const ParamStore& store = local_->params();
  for (const std::string& key : store.state_keys()) {
    const ParamStore::Entry* entry = store.Find(key);
    // Tied names share one copy, as they share one tensor in the model.
    state.push_back({key, values[entry - store.entries().data()], !entry->is_parameter});
  }
  return state;
}

absl::Status Job::LoadStateDict(const std::map<std::string, at::Tensor>& state, bool strict,
                                std::vector<std::string>* missing,
                                std::vector<std::string>* unexpected) {
  std::lock_guard<std::mutex> lock(mu_);
  return LoadStateLocked(state, strict, missing, unexpected);
}

absl::Status Job::LoadStateLocked(const std::map<std::string, at::Tensor>& state, bool strict,
                                  std::vector<std::string>* missing,
                                  std::vector<std::string>* unexpected) {
  absl::Status loaded = local_->Load(state, strict, missing, unexpected);
  if (!loaded.ok() || !coordinator_.leads()) return loaded;
  // The parts take what they hold, deployed or not (an undeployed part deploys from its store).
  std::map<std::string, at::Tensor> known;
  for (const auto& [key, value] : state) {
    if (local_->params().Find(key) != nullptr) known.emplace(key, value);
  }
  return Annotate(coordinator_.Push(known), "loading the state into the job's other daemons");
}

absl::StatusOr<std::vector<OptimizerEntry>> Job::OptimizerState() {
  std::lock_guard<std::mutex> lock(mu_);
  return OptimizerStateLocked();
}

absl::StatusOr<std::vector<OptimizerEntry>> Job::OptimizerStateLocked() {
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  std::vector<OptimizerEntry> state = local_->OptimizerState();
  if (!coordinator_.leads()) return state;
  // With ZeRO, a stage's replicas all run on one daemon (PipelineEngine::SetOptimizer), which
  // assembles their shards.
  absl::Status gathered = coordinator_.GatherOptimizerState(&state);
  if (!gathered.ok()) return gathered;
  return state;
}

absl::Status Job::LoadOptimizerState(const std::vector<OptimizerEntry>& state) {
  std::lock_guard<std::mutex> lock(mu_);
  return LoadOptimizerStateLocked(state);
}

absl::Status Job::LoadOptimizerStateLocked(const std::vector<OptimizerEntry>& state) {
  if (absl::Status lost = coordinator_.Lost(); !lost.ok()) return lost;
  if (!coordinator_.leads()) return local_->LoadOptimizerState(state);
  // Checked here first (the leader knows every parameter), so no daemon loads a bad state.
  absl::Status checked = local_->LoadOptimizerState(state, /*check_only=*/true);
  if (!checked.ok()) return checked;
  return coordinator_.PushOptimizerState(state, [&] { return local_->LoadOptimizerState(state); });
}

void Job::Undeploy() {
  std::lock_guard<std::mutex> lock(mu_);
  local_->Release();
  coordinator_.UndeployParts();
  state_ = JobState::kUndeployed;
  metrics_.SetState(JobStateName(state_));
  MeasuredMemory();
}

JobSummary Job::Summary() {
  std::lock_guard<std::mutex> lock(mu_);
  JobSummary s;
  s.state = state_;
  s.num_params = local_->params().NumParameterElements();
  s.steps = steps_;
  s.forwards = forwards_;
  LossScaler scaler(settings_.loss_scale);
  local_->Usage(&s.device_bytes, &s.peak_device_bytes, &scaler);
  metrics_.SetMemory(s.device_bytes, s.peak_device_bytes);  // Measure's, now
  s.loss_scale = scaler.scale();
  s.skipped_steps = scaler.skipped_steps();
  return s;
}

}  // namespace rannc
