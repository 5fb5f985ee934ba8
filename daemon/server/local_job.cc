#include "daemon/server/local_job.h"

#include <algorithm>
#include <chrono>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/comm/grpc_store.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/status.h"
#include "daemon/graph/index_bounds.h"
#include "daemon/optim/grad_norm.h"
#include "daemon/runtime/autocast.h"

namespace rannc {

LocalJob::LocalJob(const JobSettings& settings,
                   std::function<std::shared_ptr<std::atomic<bool>>()> new_cancel)
    : settings_(settings),
      new_cancel_(std::move(new_cancel)),
      mode_(settings.mode),
      parked_loss_scaler_(settings.loss_scale) {}

absl::StatusOr<std::unique_ptr<LocalJob>> LocalJob::Create(
    const JobSettings& settings, const ImportedModel& model,
    const std::vector<at::Tensor>& example_inputs,
    std::function<std::shared_ptr<std::atomic<bool>>()> new_cancel, Made* made) {
  std::unique_ptr<LocalJob> job(new LocalJob(settings, std::move(new_cancel)));
  // Before the planner's profiling runs, which must time what training will run.
  absl::StatusOr<std::unique_ptr<NumericsLease>> numerics =
      NumericsLease::Acquire(settings.numerics, settings.name);
  if (!numerics.ok()) return numerics.status();
  job->numerics_ = std::move(*numerics);
  job->store_ = ParamStore::FromModuleTensors(model.tensors);
  if (settings.check_unused_values) {
    absl::Status unused = CheckUnusedValues(model, job->store_);
    if (!unused.ok()) return unused;
  }
  for (size_t i = 0; i < example_inputs.size(); ++i) {
    std::string name = i < settings.input_names.size() && !settings.input_names[i].empty()
                           ? settings.input_names[i]
                           : model.input_names[i];
    job->signature_.push_back({name, example_inputs[i].scalar_type(),
                               example_inputs[i].sizes().vec()});
  }
  job->runner_ = std::make_unique<ModelRunner>(&job->store_);
  absl::Status added = job->runner_->AddMode(job->mode_, model);
  if (!added.ok()) return added;
  if (settings.optimizer.enabled) {
    absl::Status valid = CheckOptimizer(settings.optimizer, job->store_);
    if (!valid.ok()) return valid;
  }

  // Every forward of an AMP job at O1 runs under autocast, the IR's and profiler's below
  // included (so the outputs' dtypes the client learns are the training run's); at O2 the graph
  // itself computes in the AMP dtype.
  AutocastGuard amp(settings.autocast());
  absl::StatusOr<PlannedModel> planned =
      PlanJobModel(settings, model, job->store_, example_inputs);
  if (!planned.ok()) return planned.status();
  // The outputs' specs come from the IR's example run (its probes, extrapolated to the example
  // batch): no forward of the whole example batch on the host is needed.
  for (int id : planned->ir->outputs) {
    const IrValue& v = planned->ir->values[id];
    made->output_specs.push_back({v.dtype, v.shape, v.batch_dim});
  }
  // Integer inputs that index tables (token ids, class targets) are range-checked on the host
  // with every batch: on a GPU an index out of range would be a device-side assert.
  for (const IndexBound& b : FindIndexBounds(*planned->ir)) {
    job->signature_[b.input].ranges.push_back({b.limit, b.ignore, b.what});
  }
  job->ir_ = std::move(planned->ir);
  job->plan_ = std::move(planned->plan);
  made->plan = job->plan_;
  made->ir_s = planned->ir_s;
  made->plan_s = planned->plan_s;
  // The plan's memory switches: the job's, or more when nothing fit without them
  // (PlannerConfig::auto_memory), or those a loaded plan was made with.
  job->zero_ = settings.zero || job->plan_.zero();
  job->offload_ = settings.offload || job->plan_.offload();
  job->lifted_of_entry_ = LiftedOfEntries(job->store_, *job->ir_);
  if (settings.optimizer.enabled) {
    job->optimizer_groups_ =
        OptimizerGroups(settings.optimizer, job->store_, job->lifted_of_entry_);
  }
  return job;
}

absl::Status LocalJob::CheckInputs(const std::vector<at::Tensor>& inputs) const {
  return rannc::CheckInputs(signature_, inputs);
}

absl::Status LocalJob::AddMode(const ModelMode& mode, ImportedModel model) {
  if (model.input_names.size() != signature_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", mode.ToString(), " graph takes ", model.input_names.size(),
        " inputs; the job's model takes ", signature_.size()));
  }
  std::vector<c10::ScalarType> inputs;
  for (const InputSignature& in : signature_) inputs.push_back(in.dtype);
  absl::Status lowered = LowerPrecision(settings_, &model, inputs);
  if (!lowered.ok()) return lowered;
  return runner_->AddMode(mode, model);
}

bool LocalJob::SetMode(const ModelMode& mode) {
  mode_ = mode;
  return runner_->HasMode(mode);
}

bool LocalJob::planned_mode() const {
  return mode_.training == settings_.mode.training && mode_.dropout == settings_.mode.dropout;
}

int LocalJob::LiftedOf(const ParamStore::Entry& entry) const {
  return lifted_of_entry_[&entry - store_.entries().data()];
}

absl::Status LocalJob::Deploy() {
  std::vector<at::Tensor> lifted(ir_->tensor_names.size());
  for (size_t i = 0; i < lifted.size(); ++i) {
    lifted[i] = store_.Find(ir_->tensor_names[i])->tensor;
  }
  EngineOptions options;
  options.backend = settings_.backend;
  options.num_devices = settings_.plan_target.num_devices;
  options.local_devices = settings_.local_devices;
  options.placement = settings_.placement;
  options.group = settings_.engine_group;
  options.zero = zero_;
  options.offload = offload_;
  options.offload_block_bytes = settings_.planner.offload_block_bytes;
  options.offload_low_precision = settings_.planner.offload_low_precision;
  options.amp_cast_group_bytes = settings_.amp_cast_group_bytes;
  options.outputs_before_backward = settings_.outputs_before_backward;
  options.loss_scaler = parked_loss_scaler_;
  options.amp = settings_.autocast();
  options.grad_wire_dtype = settings_.grad_wire_dtype();
  options.cancel = new_cancel_();
  options.checkpoint_memory = checkpoint_memory_;
  options.counters = counters_;
  if (settings_.engine_store != nullptr) {
    options.store = settings_.engine_store;
  } else if (!settings_.engine_store_address.empty()) {
    if (!part_store_) part_store_ = comm::MakeGrpcStore(settings_.engine_store_address);
    options.store = part_store_.get();
  }
  if (!options.group.empty()) {
    // A redeployed job's communicators must not meet the previous deployment's keys.
    options.group = absl::StrCat(options.group, "/", deployments_++);
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
      PipelineEngine::Create(*ir_, plan_, lifted, options);
  if (!engine.ok()) return engine.status();
  const double engine_s = SecondsSince(start);
  if (settings_.optimizer.enabled) {
    absl::Status s = (*engine)->SetOptimizer(settings_.optimizer.kind, optimizer_groups_,
                                             settings_.optimizer.group_hyper,
                                             settings_.optimizer.scripted);
    if (s.ok()) s = (*engine)->LoadOptimizerState(parked_optimizer_state_);
    if (!s.ok()) return s;
  }
  // Gradients accumulated before a release go back to the devices.
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const at::Tensor& t = entries[e].tensor;
    if (lifted_of_entry_[e] < 0 || !t.grad().defined()) continue;
    if (grad_shares_) {
      (*engine)->AddGradShare(lifted_of_entry_[e], t.grad());
    } else {
      (*engine)->AddGrad(lifted_of_entry_[e], t.grad());
    }
    t.mutable_grad().reset();
  }
  grad_shares_ = false;
  parked_optimizer_state_.clear();
  engine_ = std::move(*engine);
  ThinStore();
  const double deploy_s = SecondsSince(start);
  spdlog::log(deploy_s >= 0.1 ? spdlog::level::info : spdlog::level::debug,
              "deployed in {:.2f} s: engine {:.2f} (split in its own line), optimizer state "
              "and gradients {:.2f}",
              deploy_s, engine_s, deploy_s - engine_s);
  if (held_.empty()) {
    for (size_t li = 0; li < lifted.size(); ++li) {
      held_.push_back(engine_->Holds(static_cast<int>(li)));
      saved_.push_back(engine_->Saves(static_cast<int>(li)));
    }
  }
  return absl::OkStatus();
}

void LocalJob::ThinStore() {
  // What the store is for stays true: it holds the values between deployments (SyncStore
  // restores and writes them before the engine goes), and Load writes into it before SetParam.
  // With offload the store's tensors take the host masters' memory (set_, so every reference to
  // them sees it), the same values: once the engine is gone they are the store's.
  at::NoGradGuard no_grad;
  thin_entries_.clear();
  for (size_t e = 0; e < store_.entries().size(); ++e) {
    const int li = lifted_of_entry_[e];
    if (li < 0 || !store_.entries()[e].is_parameter || !Held(li) || !engine_->Holds(li)) {
      continue;
    }
    const at::Tensor master = offload_ ? engine_->HostMaster(li) : at::Tensor();
    const at::Tensor& t = store_.entries()[e].tensor;
    if (master.defined() && master.sizes().equals(t.sizes()) &&
        master.scalar_type() == t.scalar_type()) {
      t.set_(master);
    } else {
      thin_entries_.push_back(e);
    }
  }
  DropStoreCopies();
}

void LocalJob::DropStoreCopies() {
  if (!engine_ || runner_->holds_graph()) return;
  for (size_t e : thin_entries_) store_.Drop(e);
}

absl::Status LocalJob::EnsureDeployed() {
  if (engine_) return absl::OkStatus();
  return Annotate(Deploy(), "deploying the model on its devices");
}

bool LocalJob::Held(int lifted) const {
  if (!spans_daemons()) return true;
  return lifted >= 0 && lifted < static_cast<int>(held_.size()) && held_[lifted];
}

bool LocalJob::Saves(const std::string& name) const {
  if (!spans_daemons()) return true;
  const ParamStore::Entry* entry = store_.Find(name);
  if (entry == nullptr) return false;
  const int li = LiftedOf(*entry);
  // Not in the plan: in the leader's master only.
  if (li < 0 || li >= static_cast<int>(saved_.size())) return !settings_.is_part;
  return saved_[li];
}

LocalJob::Flags LocalJob::flags() const {
  Flags f;
  f.deployed = engine_ != nullptr;
  f.zero = zero_;
  f.planned_mode = planned_mode();
  f.engine_forward = engine_forward_;
  f.grads_pending = grad_shares_ || (engine_ && engine_->grads_pending());
  return f;
}

void LocalJob::SyncStore(bool grads, const RemoteRead& remote) {
  at::NoGradGuard no_grad;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const int li = lifted_of_entry_[e];
    if (li < 0) continue;
    const at::Tensor& t = entries[e].tensor;
    if (!Held(li)) {
      // Another daemon's part holds it (a part keeps its store's copy of what it doesn't hold).
      if (grads || !remote) continue;
      absl::StatusOr<std::optional<at::Tensor>> value = remote(entries[e].name);
      if (value.ok() && value->has_value()) t.copy_(**value);
      continue;
    }
    if (!engine_) continue;
    store_.Restore(e);
    t.copy_(engine_->ParamAt(li));
    if (grads && entries[e].is_parameter) t.mutable_grad() = engine_->GradAt(li);
  }
}

std::vector<at::Tensor> LocalJob::Values(const RemoteRead& remote) {
  at::NoGradGuard no_grad;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  std::vector<at::Tensor> values(entries.size());
  for (size_t e = 0; e < entries.size(); ++e) {
    const int li = lifted_of_entry_[e];
    // Read: the engine's copy, or the store's where no device here holds it.
    absl::StatusOr<std::optional<at::Tensor>> value =
        li >= 0 && !Held(li) && remote ? remote(entries[e].name) : Read(entries[e].name, false);
    values[e] = value.ok() && value->has_value() ? std::move(**value)
                                                 : entries[e].tensor.detach().clone();
  }
  return values;
}

void LocalJob::Release() {
  runner_->ReleaseOutputs();
  if (!engine_) return;
  // With every device here, a pending gradient read from the engine is already the sum over
  // its holders; over several daemons it is this daemon's share.
  grad_shares_ = engine_->grads_pending() && spans_daemons();
  SyncStore(/*grads=*/true, nullptr);  // this daemon's values only: the others keep theirs
  parked_optimizer_state_ = engine_->OptimizerState();
  parked_loss_scaler_ = engine_->loss_scaler();
  engine_.reset();
  thin_entries_.clear();
}

absl::StatusOr<std::vector<at::Tensor>> LocalJob::Forward(
    const std::vector<at::Tensor>& inputs, bool requires_grad, bool delay_grad_allreduce,
    const RemoteRead& remote, std::map<std::string, at::Tensor>* buffers) {
  if (planned_mode()) {
    engine_forward_ = true;
    absl::Status deployed = EnsureDeployed();
    if (!deployed.ok()) return deployed;
    DropStoreCopies();  // restored by another mode's forward since
    engine_->SetDelayGradReduction(delay_grad_allreduce);
    absl::StatusOr<std::vector<at::Tensor>> outputs = engine_->Forward(inputs, requires_grad);
    if (engine_->broken()) Release();
    return outputs;
  }
  // Another mode's graph runs whole on the host over the devices' current values; buffers it
  // updates (BatchNorm statistics in train mode) go back to the devices.
  engine_forward_ = false;
  if (!spans_daemons()) {
    absl::Status deployed = EnsureDeployed();
    if (!deployed.ok()) return deployed;
  }
  SyncStore(/*grads=*/false, remote);
  absl::StatusOr<std::vector<at::Tensor>> outputs;
  {
    AutocastGuard amp(settings_.autocast());
    outputs = runner_->Forward(mode_, signature_, inputs, requires_grad);
  }
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    if (entries[e].is_parameter || lifted_of_entry_[e] < 0) continue;
    if (engine_ && Held(lifted_of_entry_[e])) {
      engine_->SetParam(lifted_of_entry_[e], entries[e].tensor);
    }
    // Only a training-mode graph updates buffers (BatchNorm statistics).
    if (mode_.training) (*buffers)[entries[e].name] = entries[e].tensor;
  }
  return outputs;
}

absl::Status LocalJob::Backward(const OutputGrads& grads, bool retain_graph,
                                bool delay_grad_allreduce) {
  if (!engine_) {
    return absl::FailedPreconditionError(
        "backward called with no forward pending (the job was undeployed since)");
  }
  if (engine_forward_) {
    engine_->SetDelayGradReduction(delay_grad_allreduce);
    absl::Status status = engine_->Backward(grads, retain_graph);
    if (engine_->broken()) Release();
    return status;
  }
  absl::Status status = runner_->Backward(grads, retain_graph);
  if (!status.ok()) return status;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    const at::Tensor& t = entries[e].tensor;
    if (lifted_of_entry_[e] < 0 || !t.grad().defined()) continue;
    engine_->AddGrad(lifted_of_entry_[e], t.grad());
    t.mutable_grad().reset();
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> LocalJob::Run(const JobOp& op) {
  switch (op.kind) {
    case JobOp::Kind::kZeroGrad:
      ZeroGrad(op.set_to_none);
      return NamedTensors();
    case JobOp::Kind::kRecreateCommunicators: {
      if (!engine_) return NamedTensors();  // released: the next call builds them
      Release();
      absl::Status deployed = Annotate(Deploy(), "recreating the job's communicators");
      if (!deployed.ok()) return deployed;
      return NamedTensors();
    }
    case JobOp::Kind::kGradNorms:
      return GradNorms(op.norm_type);
    case JobOp::Kind::kScaleGrads: {
      absl::Status scaled = ScaleGrads(op.coefficient);
      if (!scaled.ok()) return scaled;
      return NamedTensors();
    }
    case JobOp::Kind::kStep:
    case JobOp::Kind::kAllReduceGrads:
      break;
  }
  absl::Status deployed = EnsureDeployed();
  if (!deployed.ok()) return deployed;
  absl::Status status;
  if (op.kind == JobOp::Kind::kStep) {
    status = TorchCall(absl::StatusCode::kInternal, "optimizer step",
                       [&] { return engine_->Step(op.hypers); });
  } else {
    status = engine_->AllReduceGrads();
  }
  if (engine_ && engine_->broken()) Release();
  if (!status.ok()) return status;
  return NamedTensors();
}

void LocalJob::ZeroGrad(bool set_to_none) {
  if (engine_) engine_->ZeroGrad(set_to_none);
  grad_shares_ = false;  // the store's gradients are zeroed below
  for (at::Tensor p : store_.Parameters()) {
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad.reset();
    } else {
      // As torch.nn.Module.zero_grad: a grad with history is detached before zeroing.
      if (grad.grad_fn()) {
        grad = grad.detach();
      } else {
        grad.requires_grad_(false);
      }
      grad.zero_();
    }
  }
}

std::vector<int> LocalJob::ClippedParams() const {
  std::vector<int> params;
  for (const ParamStore::Entry& e : store_.entries()) {
    if (e.is_parameter && LiftedOf(e) >= 0) params.push_back(LiftedOf(e));
  }
  return params;
}

absl::StatusOr<NamedTensors> LocalJob::GradNorms(double norm_type) {
  absl::Status deployed = EnsureDeployed();
  if (!deployed.ok()) return deployed;
  std::map<int, std::string> name_of_lifted;
  const std::vector<ParamStore::Entry>& entries = store_.entries();
  for (size_t e = 0; e < entries.size(); ++e) name_of_lifted[lifted_of_entry_[e]] = entries[e].name;
  NamedTensors out;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    absl::StatusOr<std::vector<std::pair<int, at::Tensor>>> norms = engine_->GradNorms(
        ClippedParams(), norm_type);
    if (!norms.ok()) return norms.status();
    for (auto& [li, norm] : *norms) out.emplace_back(name_of_lifted[li], norm);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return out;
}

absl::Status LocalJob::ScaleGrads(const at::Tensor& coefficient) {
  if (!engine_) {
    return absl::FailedPreconditionError("clip_grad_norm: this part was undeployed meanwhile");
  }
  return TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    engine_->ScaleGrads(ClippedParams(), coefficient);
    return absl::OkStatus();
  });
}

absl::StatusOr<double> LocalJob::ClipGradNorm(double max_norm, double norm_type) {
  if (engine_) {
    absl::StatusOr<double> total = 0.0;
    absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
      total = engine_->ClipGradNorm(ClippedParams(),
                                    max_norm, norm_type);
      return total.status();
    });
    if (!status.ok()) return status;
    return total;
  }
  double total = 0;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "clip_grad_norm", [&] {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : store_.Parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return absl::OkStatus();
    const at::Tensor total_norm = TotalGradNorm(grads, norm_type);
    const at::Tensor clamped = ClipCoefficient(total_norm, max_norm);
    for (const at::Tensor& g : grads) g.detach().mul_(clamped);
    total = total_norm.item<double>();
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return total;
}

absl::StatusOr<std::optional<at::Tensor>> LocalJob::Read(const std::string& name, bool grad) {
  const ParamStore::Entry* entry = store_.Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "the model has no parameter or buffer named '", name, "'"));
  }
  if (grad && !entry->is_parameter) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is a buffer; it has no gradient"));
  }
  const int lifted = LiftedOf(*entry);
  if (lifted >= 0 && !Held(lifted)) {
    return absl::NotFoundError(absl::StrCat("'", name, "' is held by another daemon's part"));
  }
  if (engine_ && lifted >= 0) {
    at::Tensor t = grad ? engine_->GradAt(lifted) : engine_->ParamAt(lifted);
    if (!t.defined()) return std::optional<at::Tensor>();
    return std::optional<at::Tensor>(t);
  }
  if (!grad) return std::optional<at::Tensor>(entry->tensor.detach().clone());
  const at::Tensor& g = entry->tensor.grad();
  if (!g.defined()) return std::optional<at::Tensor>();
  return std::optional<at::Tensor>(g.detach().clone());
}

absl::Status LocalJob::Load(const std::map<std::string, at::Tensor>& state, bool strict,
                            std::vector<std::string>* missing,
                            std::vector<std::string>* unexpected) {
  // Entries the state leaves out keep the devices' values: only those it writes go there.
  absl::Status loaded = store_.Load(state, strict, missing, unexpected);
  if (!loaded.ok() || !engine_) return loaded;
  std::set<size_t> written;
  for (const auto& [key, value] : state) {
    if (const ParamStore::Entry* entry = store_.Find(key)) {
      written.insert(entry - store_.entries().data());
    }
  }
  for (size_t e : written) {
    const int li = lifted_of_entry_[e];
    if (li >= 0 && Held(li)) engine_->SetParam(li, store_.entries()[e].tensor);
  }
  DropStoreCopies();
  return absl::OkStatus();
}

std::vector<OptimizerEntry> LocalJob::OptimizerState() {
  std::vector<OptimizerEntry> out;
  if (!settings_.optimizer.enabled) return out;
  const std::map<int, std::vector<std::pair<std::string, at::Tensor>>> state =
      engine_ ? engine_->OptimizerState() : parked_optimizer_state_;
  for (const ParamStore::Entry& e : store_.entries()) {
    const int li = LiftedOf(e);
    auto it = state.find(li);
    if (!e.is_parameter || it == state.end() || !Held(li)) continue;
    for (const auto& [key, value] : it->second) {
      // The engine's are host copies already; the parked state is copied (the caller keeps
      // what it gets).
      out.push_back({e.name, key,
                     engine_ ? value.detach()
                             : value.detach().to(at::TensorOptions().device(at::kCPU),
                                                 /*non_blocking=*/false, /*copy=*/true)});
    }
  }
  return out;
}

std::vector<LocalJob::OptimizerPiece> LocalJob::OptimizerStatePieces() {
  std::vector<OptimizerPiece> out;
  if (!settings_.optimizer.enabled) return out;
  if (!engine_) {  // released: the parked state, whole
    for (OptimizerEntry& e : OptimizerState()) out.push_back({std::move(e), 0, false});
    return out;
  }
  std::map<int, const ParamStore::Entry*> entry_of;
  for (const ParamStore::Entry& e : store_.entries()) {
    const int li = LiftedOf(e);
    if (e.is_parameter && li >= 0 && Held(li)) entry_of.emplace(li, &e);
  }
  for (PipelineEngine::StatePiece& p : engine_->OptimizerStatePieces()) {
    auto it = entry_of.find(p.lifted);
    if (it == entry_of.end()) continue;
    out.push_back({{it->second->name, std::move(p.key), std::move(p.value)}, p.offset, p.slice});
  }
  return out;
}

void LocalJob::PrepareCheckpointMemory() {
  if (!engine_ || checkpoint_memory_->prepared()) return;
  // The parameters Job::CopyShareLocked reads from the devices, in its order (the buffers are
  // read before the arena opens), then the optimizer's state.
  std::vector<int> lifted;
  for (const ParamStore::Entry& e : store_.entries()) {
    if (e.is_parameter && Saves(e.name)) lifted.push_back(LiftedOf(e));
  }
  const size_t bytes = PinnedArena::SpanOf(engine_->CheckpointCudaReads(lifted));
  if (bytes > 0) checkpoint_memory_->Prepare(bytes);
}

void LocalJob::BeginAsyncReads() {
  if (engine_) engine_->BeginAsyncReads();
}

std::function<void()> LocalJob::EndAsyncReads() {
  if (!engine_) return [] {};
  return engine_->EndAsyncReads();
}

absl::StatusOr<LocalJob::ByLifted> LocalJob::OptimizerStateByLifted(
    const std::vector<OptimizerEntry>& state) const {
  if (!settings_.optimizer.enabled) {
    return absl::FailedPreconditionError(
        "the job was created without an optimizer; it has no optimizer state to load");
  }
  std::set<int> optimized;
  for (const std::vector<int>& group : optimizer_groups_) optimized.insert(group.begin(),
                                                                          group.end());
  const std::vector<std::string>& keys = settings_.optimizer.StateKeys();
  ByLifted by_lifted;
  for (const OptimizerEntry& entry : state) {
    const std::string what = absl::StrCat("optimizer state '", entry.key, "' of '",
                                          entry.param, "'");
    const ParamStore::Entry* e = store_.Find(entry.param);
    const int li = e == nullptr ? -1 : LiftedOf(*e);
    if (e == nullptr || !e->is_parameter || !optimized.count(li)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": no parameter of that name is in the optimizer's param groups"));
    }
    if (std::find(keys.begin(), keys.end(), entry.key) == keys.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": this optimizer keeps ", absl::StrJoin(keys, ", ")));
    }
    const bool scalar = IsScalarOptimizerState(entry.key);
    if (!entry.value.defined() || (scalar ? entry.value.numel() != 1
                                          : !entry.value.sizes().equals(e->tensor.sizes()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": shape ", entry.value.defined() ? c10::str(entry.value.sizes()) : "none",
          ", expected ", scalar ? "one number" : c10::str(e->tensor.sizes())));
    }
    if (!Held(li)) continue;  // another daemon's
    at::Tensor value = entry.value.detach();
    if (!scalar) value = value.to(e->tensor.scalar_type());
    by_lifted[li].emplace_back(entry.key, value.clone());
  }
  return by_lifted;
}

absl::Status LocalJob::LoadOptimizerState(const std::vector<OptimizerEntry>& state,
                                          bool check_only) {
  absl::StatusOr<ByLifted> by_lifted = OptimizerStateByLifted(state);
  if (!by_lifted.ok() || check_only) return by_lifted.status();
  if (!engine_) {
    parked_optimizer_state_ = std::move(*by_lifted);
    return absl::OkStatus();
  }
  return TorchCall(absl::StatusCode::kInvalidArgument, "loading the optimizer state",
                   [&] { return engine_->LoadOptimizerState(*by_lifted); });
}

void LocalJob::Usage(std::vector<int64_t>* bytes, std::vector<int64_t>* peak,
                     LossScaler* scaler) const {
  std::set<int> used;
  for (const v1::DeploymentStage& s : plan_.stages()) {
    used.insert(s.devices().begin(), s.devices().end());
  }
  for (int d : used) {
    bytes->push_back(engine_ ? engine_->DeviceBytes(d) : 0);
    peak->push_back(engine_ ? engine_->PeakDeviceBytes(d) : 0);
  }
  *scaler = engine_ ? engine_->loss_scaler() : parked_loss_scaler_;
}

void LocalJob::RestoreLossScaler(const LossScaler& scaler) {
  Release();
  parked_loss_scaler_ = scaler;
}

}  // namespace rannc
