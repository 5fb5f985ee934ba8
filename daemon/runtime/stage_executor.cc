#include "daemon/runtime/stage_executor.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <optional>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#if __has_include(<ATen/ops/_foreach_copy.h>)
#include <ATen/ops/_foreach_copy.h>  // LibTorch 2.x
#define RANNC_HAS_FOREACH_COPY 1
#endif

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"

namespace rannc {
namespace {

// The default generators are shared by all device threads, and a draw by another stage in the
// middle of a forward that will be replayed would make its random numbers impossible to replay.
// Such forwards, and their replays, hold this lock exclusively; every other forward of a random
// stage holds it shared, so those still run at once (their draws are never replayed).
std::shared_mutex& RngMutex() {
  static std::shared_mutex mutex;
  return mutex;
}

// Values that some op writes in place: arguments its schema marks as written, and the running
// statistics of the norms, which update them although their schemas do not say so.
void CollectWrittenValues(const torch::jit::Block* block,
                          std::set<const torch::jit::Value*>* written) {
  static const std::set<std::string> norms = {
      "aten::batch_norm", "aten::instance_norm", "aten::_batch_norm_impl_index",
      "aten::native_batch_norm", "aten::_native_batch_norm_legit"};
  for (const torch::jit::Node* n : block->nodes()) {
    const bool is_norm = norms.count(n->kind().toQualString()) > 0;
    const c10::FunctionSchema* schema = n->maybeSchema();
    for (size_t i = 0; i < n->inputs().size(); ++i) {
      bool writes = is_norm;
      if (schema != nullptr && i < schema->arguments().size()) {
        const auto& alias = schema->arguments()[i].alias_info();
        writes = writes || (alias && alias->isWrite());
      }
      if (writes) written->insert(n->inputs()[i]);
    }
    for (const torch::jit::Block* b : n->blocks()) CollectWrittenValues(b, written);
  }
}

at::Tensor GetState(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetState(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Subgraph input `v`'s index among the IR's lifted inputs, or -1 for a data input.
int LiftedIndexOf(const IrGraph& ir, int v) {
  const int lifted_index = v - static_cast<int>(ir.num_user_inputs);
  return v < static_cast<int>(ir.inputs.size()) && lifted_index >= 0 ? lifted_index : -1;
}

// A block hook's status; OK where none is set.
absl::Status CallHook(const std::function<absl::Status(int)>& hook, int block) {
  return hook ? hook(block) : absl::OkStatus();
}

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// dst[i] = src[i] in dst[i]'s dtype, for tensors of one dtype each side: one multi-tensor copy
// where LibTorch has torch._foreach_copy_ (2.x), else one copy each.
void CopyAll(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
#ifdef RANNC_HAS_FOREACH_COPY
  at::_foreach_copy_(dst, src);
#else
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
#endif
}

// A group of parameters (of one dtype) cast to `low` as one autograd node: its backward widens
// the gradients its outputs got back to the parameters' dtype, as each cast's own backward
// would (an exact conversion), and leaves those that got none undefined. `made`, where given,
// holds the casts of these parameters' present values made already (an earlier micro-batch's,
// StageExecutor::SharedCast): its outputs are then those tensors' data, copied by nothing.
struct GroupCast : public torch::autograd::Function<GroupCast> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList params, at::ScalarType low,
                                                const std::vector<at::Tensor>* made) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["wide"] = static_cast<int64_t>(params[0].scalar_type());
    std::vector<at::Tensor> copies;
    copies.reserve(params.size());
    if (made != nullptr) {
      // New tensors over the same memory, each to get this node as its history.
      for (const at::Tensor& c : *made) copies.push_back(c.detach());
      return copies;
    }
    for (const at::Tensor& p : params) copies.push_back(at::empty_like(p, p.options().dtype(low)));
    CopyAll(copies, params.vec());
    return copies;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto wide = static_cast<at::ScalarType>(ctx->saved_data["wide"].toInt());
    torch::autograd::variable_list widened(grads.size() + 2);  // the last two: `low`, `made`
    std::vector<at::Tensor> dst, src;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      widened[i] = at::empty_like(grads[i], grads[i].options().dtype(wide));
      dst.push_back(widened[i]);
      src.push_back(grads[i]);
    }
    if (!dst.empty()) CopyAll(dst, src);
    return widened;
  }
};

}  // namespace

StageExecutor::~StageExecutor() = default;

absl::StatusOr<std::unique_ptr<StageExecutor>> StageExecutor::Create(
    const IrGraph& ir, Subgraph subgraph, const std::vector<at::Tensor>& lifted,
    StageOptions options) {
  if (lifted.size() != ir.tensor_names.size()) {
    return absl::InternalError(absl::StrCat("StageExecutor: ", lifted.size(),
                                            " lifted tensors for ", ir.tensor_names.size()));
  }
  std::unique_ptr<StageExecutor> stage(new StageExecutor());
  stage->module_ = ir.module;
  stage->options_ = options;
  std::set<const torch::jit::Value*> written;
  CollectWrittenValues(subgraph.graph->block(), &written);
  for (size_t i = 0; i < subgraph.inputs.size(); ++i) {
    const int v = subgraph.inputs[i];
    const int lifted_index = LiftedIndexOf(ir, v);
    stage->lifted_index_.push_back(lifted_index);
    if (lifted_index >= 0) {
      stage->input_slot_.push_back(-1);
      stage->lifted_.push_back(lifted[lifted_index]);
      if (ir.values[v].role == ValueRole::kBuffer && written.count(subgraph.graph->inputs()[i])) {
        stage->mutated_buffers_.push_back(i);
      }
    } else {
      stage->input_slot_.push_back(static_cast<int>(stage->data_inputs_.size()));
      stage->data_inputs_.push_back(v);
      stage->lifted_.emplace_back();
    }
  }
  stage->random_ = HasRandomOps(subgraph.graph->block());
  if (options.cast_group_bytes > 0 && !options.recompute) {
    // The parameters each read by one cast, in the order of their casts.
    std::map<const torch::jit::Value*, size_t> slot_of;
    for (size_t i = 0; i < subgraph.inputs.size(); ++i) {
      if (stage->lifted_index_[i] >= 0) slot_of[subgraph.graph->inputs()[i]] = i;
    }
    int64_t bytes = 0;
    for (const torch::jit::Node* n : subgraph.graph->nodes()) {
      if (n->kind() != c10::aten::to || n->inputs().empty()) continue;
      auto it = slot_of.find(n->input(0));
      if (it == slot_of.end()) continue;
      const size_t slot = it->second;
      const std::optional<at::ScalarType> low = LowPrecisionRead(ir, stage->lifted_index_[slot]);
      const at::Tensor& param = stage->lifted_[slot];
      if (!low || !param.is_floating_point() || param.scalar_type() == *low) continue;
      const int64_t b = Bytes(param);
      std::vector<CastGroup>& groups = stage->cast_groups_;
      if (groups.empty() || groups.back().wide != param.scalar_type() ||
          groups.back().low != *low || bytes + b > options.cast_group_bytes) {
        groups.push_back({{}, param.scalar_type(), *low});
        bytes = 0;
      }
      groups.back().slots.push_back(slot);
      bytes += b;
    }
  }
  if (!options.device.is_cpu()) {
    absl::Status placed =
        TorchCall(absl::StatusCode::kInternal, "placing a stage's constants", [&] {
          PlaceOnDevice(*subgraph.graph, options.device);
          return absl::OkStatus();
        });
    if (!placed.ok()) return placed;
  }
  absl::Status compiled = TorchCall(absl::StatusCode::kInternal, "compiling a stage", [&] {
    stage->code_ = std::make_shared<torch::jit::Code>(subgraph.graph, "stage");
    return absl::OkStatus();
  });
  if (!compiled.ok()) return compiled;
  stage->subgraph_ = std::move(subgraph);
  return stage;
}

absl::StatusOr<std::unique_ptr<StageExecutor>> StageExecutor::CreateBlocked(
    const IrGraph& ir, Subgraph subgraph, const std::vector<int>& block_starts,
    const std::vector<at::Tensor>& lifted, StageOptions options, StageBlockHooks hooks) {
  if (subgraph.nodes.empty() || block_starts.empty() ||
      block_starts.front() != subgraph.nodes.front()) {
    return absl::InternalError("StageExecutor: blocks must start at the stage's first node");
  }
  const int end = subgraph.nodes.back() + 1;
  std::unique_ptr<StageExecutor> stage(new StageExecutor());
  stage->module_ = ir.module;
  stage->options_ = options;
  stage->hooks_ = std::move(hooks);
  for (size_t k = 0; k < block_starts.size(); ++k) {
    const int first = block_starts[k];
    const int last = k + 1 < block_starts.size() ? block_starts[k + 1] : end;
    if (last <= first) {
      return absl::InternalError(absl::StrCat("StageExecutor: block ", k, " [", first, ", ",
                                              last, ") of a stage ending at ", end));
    }
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, first, last);
    if (!sub.ok()) return sub.status();
    absl::StatusOr<std::unique_ptr<StageExecutor>> block =
        Create(ir, std::move(*sub), lifted, options);
    if (!block.ok()) return block.status();
    stage->random_ = stage->random_ || (*block)->random_;
    stage->blocks_.push_back(std::move(*block));
  }
  // The stage's own inputs, in the subgraph's order, as Create orders them.
  for (int v : subgraph.inputs) {
    if (LiftedIndexOf(ir, v) < 0) stage->data_inputs_.push_back(v);
  }
  stage->subgraph_ = std::move(subgraph);
  return stage;
}

std::vector<int> StageExecutor::block_lifted(int block) const {
  if (!blocks_.empty()) return blocks_[block]->block_lifted(0);
  std::vector<int> out;
  for (int li : lifted_index_) {
    if (li >= 0) out.push_back(li);
  }
  return out;
}

bool StageExecutor::SharedCast::Matches(const std::vector<size_t>& now_slots,
                                        const std::vector<at::Tensor>& params) const {
  if (now_slots != slots) return false;
  for (size_t k = 0; k < params.size(); ++k) {
    if (params[k].data_ptr() != data[k] || params[k]._version() != versions[k]) return false;
  }
  return true;
}

void StageExecutor::SharedCast::Keep(const std::vector<size_t>& now_slots,
                                     const std::vector<at::Tensor>& params,
                                     const std::vector<at::Tensor>& made) {
  slots = now_slots;
  data.clear();
  versions.clear();
  copies.clear();
  for (size_t k = 0; k < params.size(); ++k) {
    data.push_back(params[k].data_ptr());
    versions.push_back(params[k]._version());
    copies.push_back(made[k].detach());
  }
}

void StageExecutor::ShareCasts(bool share) {
  share_casts_ = share && blocks_.empty() && !cast_groups_.empty();
  shared_casts_.clear();
  if (share_casts_) shared_casts_.resize(cast_groups_.size());
}

int StageExecutor::num_cast_groups() const {
  int n = static_cast<int>(cast_groups_.size());
  for (const auto& block : blocks_) n += block->num_cast_groups();
  return n;
}

void StageExecutor::Release(int micro_batch) {
  pending_.erase(micro_batch);
  for (auto& block : blocks_) block->Release(micro_batch);
}

std::vector<at::Tensor> StageExecutor::Run(const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& buffers) const {
  torch::jit::Stack stack;
  stack.reserve(input_slot_.size());
  for (size_t i = 0; i < input_slot_.size(); ++i) {
    if (input_slot_[i] < 0) {
      stack.emplace_back(lifted_[i]);
    } else {
      stack.emplace_back(inputs[input_slot_[i]]);
    }
  }
  for (size_t k = 0; k < buffers.size(); ++k) stack[mutated_buffers_[k]] = buffers[k];
  for (size_t g = 0; g < cast_groups_.size(); ++g) {
    const CastGroup& group = cast_groups_[g];
    // A parameter the engine holds in `low` already (offload's low-precision streaming), or
    // frozen, is cast by the graph as it comes.
    std::vector<size_t> slots;
    std::vector<at::Tensor> params;
    for (size_t slot : group.slots) {
      const at::Tensor& p = lifted_[slot];
      if (p.scalar_type() != group.wide || !p.requires_grad()) continue;
      slots.push_back(slot);
      params.push_back(p);
    }
    if (params.empty()) continue;
    SharedCast* shared = share_casts_ ? &shared_casts_[g] : nullptr;
    const bool reuse = shared != nullptr && shared->Matches(slots, params);
    torch::autograd::variable_list copies = GroupCast::apply(
        at::TensorList(params), group.low, reuse ? &shared->copies : nullptr);
    if (shared != nullptr && !reuse) shared->Keep(slots, params, copies);
    for (size_t k = 0; k < slots.size(); ++k) stack[slots[k]] = std::move(copies[k]);
  }
  {
    AutocastGuard amp(options_.amp, options_.device.is_cuda());
    torch::jit::InterpreterState(*code_).run(stack);
  }
  std::vector<at::Tensor> outputs;
  for (const c10::IValue& v : stack) outputs.push_back(v.toTensor());
  return outputs;
}

std::vector<at::Tensor> StageExecutor::AsLeaves(const std::vector<at::Tensor>& inputs) {
  // Inputs become leaves of this stage's autograd graph, so backward can hand their gradients
  // to the stage that produced them.
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& in : inputs) {
    leaves.push_back(in.is_floating_point() ? in.detach().requires_grad_(true) : in);
  }
  return leaves;
}

std::vector<at::Generator> StageExecutor::Generators(const std::vector<at::Tensor>& inputs) const {
  // CPU ops may run on any stage (a mask made on the host), so its generator is always replayed.
  std::vector<at::Generator> generators = {at::globalContext().defaultGenerator(at::kCPU)};
  std::vector<at::Device> devices;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || t.device().is_cpu()) return;
    if (std::find(devices.begin(), devices.end(), t.device()) != devices.end()) return;
    devices.push_back(t.device());
    generators.push_back(at::globalContext().defaultGenerator(t.device()));
  };
  for (const at::Tensor& t : inputs) add(t);
  for (const at::Tensor& t : lifted_) add(t);
  return generators;
}

int64_t StageExecutor::PendingBytes() const {
  int64_t total = 0;
  for (const auto& block : blocks_) total += block->PendingBytes();
  for (const auto& [micro_batch, pending] : pending_) {
    for (const at::Tensor& t : pending.inputs) total += Bytes(t);
    for (const at::Tensor& t : pending.outputs) total += Bytes(t);
    for (const at::Tensor& t : pending.buffers) total += Bytes(t);
    for (const RngState& r : pending.rng) total += Bytes(r.state);
  }
  return total;
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::Forward(
    int micro_batch, const std::vector<at::Tensor>& inputs, bool requires_grad) {
  if (!blocks_.empty()) return ForwardBlocks(micro_batch, inputs, requires_grad);
  if (inputs.size() != data_inputs_.size()) {
    return absl::InternalError(absl::StrCat("stage forward: ", inputs.size(), " inputs for ",
                                            data_inputs_.size()));
  }
  if (pending_.count(micro_batch)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage forward: micro-batch ", micro_batch, " already has a forward pending"));
  }
  const bool recompute = requires_grad && options_.recompute;
  Pending pending;
  std::vector<at::Tensor> outputs;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "the stage's forward failed",
                                  [&] {
    std::unique_lock<std::shared_mutex> replayed_lock;
    std::shared_lock<std::shared_mutex> shared_lock;
    if (random_ && recompute) replayed_lock = std::unique_lock<std::shared_mutex>(RngMutex());
    if (random_ && !recompute) shared_lock = std::shared_lock<std::shared_mutex>(RngMutex());
    std::optional<at::NoGradGuard> no_grad;
    if (!requires_grad || recompute) no_grad.emplace();
    if (recompute) {
      for (const at::Tensor& in : inputs) pending.inputs.push_back(in.detach());
      for (size_t slot : mutated_buffers_) pending.buffers.push_back(lifted_[slot].clone());
      if (random_) {
        for (const at::Generator& g : Generators(inputs)) pending.rng.push_back({g, GetState(g)});
      }
    } else {
      pending.inputs = requires_grad ? AsLeaves(inputs) : inputs;
    }
    outputs = Run(pending.inputs);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (requires_grad) {
    if (!recompute) pending.outputs = outputs;
    pending_.emplace(micro_batch, std::move(pending));
  }
  return outputs;
}

absl::Status StageExecutor::Recompute(Pending* pending) const {
  return TorchCall(absl::StatusCode::kInternal, "the stage's recomputed forward failed", [&] {
    std::unique_lock<std::shared_mutex> rng_lock;
    if (random_) rng_lock = std::unique_lock<std::shared_mutex>(RngMutex());
    // Replays the forward's random draws; the generators go back to where they are now even if
    // the forward throws, so recomputation never shifts the stream other stages draw from.
    struct Replay {
      std::vector<RngState> now;
      ~Replay() {
        for (RngState& r : now) SetState(r.generator, r.state);
      }
    } replay;
    for (RngState& r : pending->rng) {
      replay.now.push_back({r.generator, GetState(r.generator)});
      SetState(r.generator, r.state);
    }
    pending->inputs = AsLeaves(pending->inputs);
    // The replay updates the forward's copies of the buffers it writes, not the device's.
    pending->outputs = Run(pending->inputs, pending->buffers);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::Backward(
    int micro_batch, const std::vector<at::Tensor>& output_grads, bool retain_graph) {
  if (!blocks_.empty()) return BackwardBlocks(micro_batch, output_grads, retain_graph);
  auto it = pending_.find(micro_batch);
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage backward: micro-batch ", micro_batch, " has no forward with gradients pending"));
  }
  Pending released;
  if (!retain_graph) {
    released = std::move(it->second);
    pending_.erase(it);
  }
  Pending& pending = retain_graph ? it->second : released;
  // The inputs' gradients are this backward's alone (a retained graph's leaves keep theirs).
  for (at::Tensor& in : pending.inputs) {
    if (in.requires_grad()) in.mutable_grad() = at::Tensor();
  }
  if (output_grads.size() != subgraph_.outputs.size()) {
    return absl::InternalError(absl::StrCat("stage backward: ", output_grads.size(),
                                            " gradients for ", subgraph_.outputs.size(),
                                            " outputs"));
  }
  if (options_.recompute) {
    absl::Status recomputed = Recompute(&pending);
    if (!recomputed.ok()) return recomputed;
  }
  std::vector<at::Tensor> roots, grads;
  for (size_t i = 0; i < output_grads.size(); ++i) {
    const at::Tensor& out = pending.outputs[i];
    const at::Tensor& grad = output_grads[i];
    if (!grad.defined() || !out.requires_grad()) continue;
    if (!grad.sizes().equals(out.sizes())) {
      return absl::InternalError(absl::StrCat(
          "stage backward: gradient ", DescribeTensor(grad.scalar_type(), grad.sizes()),
          " for output ", DescribeTensor(out.scalar_type(), out.sizes())));
    }
    roots.push_back(out);
    grads.push_back(grad);
  }
  std::vector<at::Tensor> input_grads(pending.inputs.size());
  absl::Status status = absl::OkStatus();
  if (!roots.empty()) {
    status = TorchCall(absl::StatusCode::kInternal, "the stage's backward failed", [&] {
      torch::autograd::backward(roots, grads, retain_graph);
      return absl::OkStatus();
    });
  }
  if (!status.ok()) return status;
  for (size_t i = 0; i < pending.inputs.size(); ++i) {
    if (pending.inputs[i].requires_grad()) input_grads[i] = pending.inputs[i].grad();
  }
  return input_grads;
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::ForwardBlocks(
    int micro_batch, const std::vector<at::Tensor>& inputs, bool requires_grad) {
  if (inputs.size() != data_inputs_.size()) {
    return absl::InternalError(absl::StrCat("stage forward: ", inputs.size(), " inputs for ",
                                            data_inputs_.size()));
  }
  if (blocks_[0]->pending_.count(micro_batch)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage forward: micro-batch ", micro_batch, " already has a forward pending"));
  }
  std::map<int, at::Tensor> values;  // IR value -> tensor
  for (size_t i = 0; i < inputs.size(); ++i) values[data_inputs_[i]] = inputs[i];
  for (size_t k = 0; k < blocks_.size(); ++k) {
    StageExecutor& block = *blocks_[k];
    absl::Status s = CallHook(hooks_.before_forward, static_cast<int>(k));
    if (s.ok()) {
      std::vector<at::Tensor> in;
      for (int v : block.data_inputs()) in.push_back(values.at(v));
      absl::StatusOr<std::vector<at::Tensor>> out = block.Forward(micro_batch, in, requires_grad);
      if (out.ok()) {
        for (size_t i = 0; i < out->size(); ++i) values[block.outputs()[i]] = (*out)[i];
        s = CallHook(hooks_.after_forward, static_cast<int>(k));
      } else {
        s = out.status();
      }
    }
    if (!s.ok()) {
      Release(micro_batch);
      return s;
    }
  }
  std::vector<at::Tensor> outputs;
  for (int v : subgraph_.outputs) outputs.push_back(values.at(v));
  return outputs;
}

absl::StatusOr<std::vector<at::Tensor>> StageExecutor::BackwardBlocks(
    int micro_batch, const std::vector<at::Tensor>& output_grads, bool retain_graph) {
  if (!blocks_[0]->pending_.count(micro_batch)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage backward: micro-batch ", micro_batch, " has no forward with gradients pending"));
  }
  if (output_grads.size() != subgraph_.outputs.size()) {
    return absl::InternalError(absl::StrCat("stage backward: ", output_grads.size(),
                                            " gradients for ", subgraph_.outputs.size(),
                                            " outputs"));
  }
  // Per IR value, its gradient so far: a value read by several blocks (or also a stage output)
  // gets the sum of theirs.
  std::map<int, at::Tensor> grads;
  auto add = [&](int v, const at::Tensor& g) {
    if (!g.defined()) return;
    at::Tensor& sum = grads[v];
    sum = sum.defined() ? sum + g : g;
  };
  for (size_t i = 0; i < output_grads.size(); ++i) add(subgraph_.outputs[i], output_grads[i]);
  for (int k = static_cast<int>(blocks_.size()) - 1; k >= 0; --k) {
    StageExecutor& block = *blocks_[k];
    absl::Status before = CallHook(hooks_.before_backward, k);
    if (!before.ok()) return before;
    std::vector<at::Tensor> out_grads;
    for (int v : block.outputs()) {
      auto it = grads.find(v);
      out_grads.push_back(it == grads.end() ? at::Tensor() : it->second);
    }
    absl::StatusOr<std::vector<at::Tensor>> in_grads =
        block.Backward(micro_batch, out_grads, retain_graph);
    if (!in_grads.ok()) return in_grads.status();
    for (size_t i = 0; i < in_grads->size(); ++i) add(block.data_inputs()[i], (*in_grads)[i]);
    absl::Status after = CallHook(hooks_.after_backward, k);
    if (!after.ok()) return after;
  }
  std::vector<at::Tensor> input_grads;
  for (int v : data_inputs_) {
    auto it = grads.find(v);
    input_grads.push_back(it == grads.end() ? at::Tensor() : it->second);
  }
  return input_grads;
}

}  // namespace rannc
