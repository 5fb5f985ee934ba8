#include "daemon/planner/profiler.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/memory_tracker.h"
#include "daemon/common/status.h"
#include "daemon/graph/structure.h"
#include "daemon/graph/subgraph.h"
#include "daemon/runtime/autocast.h"
#include "daemon/common/stats.h"

namespace rannc {
namespace planner {
namespace {

// What a block's measurement depends on besides its ops: each input's role, dtype and shape,
// with the batch dimension written per sample, so two layers of a model (or of two models, or
// of one model at two global batches) that run the same ops on the same kinds of inputs share
// one key.
std::string InputKinds(const IrGraph& ir, const Subgraph& sub) {
  std::string out;
  for (int v : sub.inputs) {
    const IrValue& x = ir.values[v];
    absl::StrAppend(&out, ValueRoleName(x.role), ":");
    if (!x.is_tensor) {
      absl::StrAppend(&out, "-;");
      continue;
    }
    absl::StrAppend(&out, c10::toString(x.dtype), "[");
    for (size_t d = 0; d < x.shape.size(); ++d) {
      if (static_cast<int>(d) != x.batch_dim) {
        absl::StrAppend(&out, x.shape[d], ",");
      } else if (ir.example_batch > 0 && x.shape[d] % ir.example_batch == 0) {
        absl::StrAppend(&out, "b*", x.shape[d] / ir.example_batch, ",");
      } else {
        absl::StrAppend(&out, x.shape[d], "@b", ir.example_batch, ",");
      }
    }
    absl::StrAppend(&out, "];");
  }
  return out;
}

// Autocast (AMP) changes what every op computes, though not the graph.
std::string AutocastState() {
  auto name = [](AmpDtype d) { return d ? std::string(c10::toString(*d)) : std::string("off"); };
  return absl::StrCat("amp=", name(CurrentAutocast()), "/", name(CurrentAutocast(/*cuda=*/true)));
}

// The structural identity of a block: equal for blocks that compute the same thing.
std::string Structure(const IrGraph& ir, const Subgraph& sub) {
  return absl::StrCat(CanonicalGraphText(*sub.graph), "\n", InputKinds(ir, sub));
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

uint64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// Class ids of `structures`: equal strings, equal ids, numbered by first appearance.
std::vector<int> Classes(const std::vector<std::string>& structures) {
  std::unordered_map<std::string, int> ids;
  std::vector<int> out;
  for (const std::string& s : structures) {
    out.push_back(ids.emplace(s, static_cast<int>(ids.size())).first->second);
  }
  return out;
}

// Waits until `device` has finished what this thread queued on it (nothing for the CPU), so
// that a host clock read after it ends a device's timing.
void Sync(c10::Device device) {
  if (device.is_cpu()) return;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(device.type());
  c10::Event done(device.type());
  done.record(impl->getStream(device));
  // LibTorch 1.x's Event has no synchronize(); its query() is in every version.
  while (!done.query()) std::this_thread::yield();
}

// While profiling on an accelerator: its current device, and the CPU's autocast (under which
// the job plans) as the accelerator's, since ops on its tensors follow its own autocast state.
class OnDevice {
 public:
  explicit OnDevice(c10::Device device) {
    if (device.is_cpu()) return;
    guard_.emplace(device);
    if (device.is_cuda()) amp_.emplace(CurrentAutocast(), /*cuda=*/true);
  }

 private:
  std::optional<c10::DeviceGuard> guard_;
  std::optional<AutocastGuard> amp_;
};

}  // namespace

Profiler::Profiler(const IrGraph& ir, std::vector<at::Tensor> tensors,
                   std::vector<at::Tensor> example_inputs, ProfileCache* cache,
                   ProfilerOptions options)
    : ir_(ir),
      tensors_(std::move(tensors)),
      example_inputs_(std::move(example_inputs)),
      cache_(cache),
      options_(std::move(options)) {
  if (!options_.device.is_cpu()) {
    for (at::Tensor& t : tensors_) t = t.to(options_.device);
    for (at::Tensor& t : example_inputs_) t = t.to(options_.device);
  }
}

absl::StatusOr<std::vector<at::Tensor>> Profiler::Batch(int64_t samples) const {
  std::vector<at::Tensor> client;
  for (const at::Tensor& t : example_inputs_) client.push_back(RepeatSamples(t, samples));
  absl::StatusOr<std::vector<at::Tensor>> batch =
      WithStepInputs(ir_, std::move(client), tensors_);
  if (!batch.ok()) return batch.status();
  for (at::Tensor& t : *batch) t = t.to(options_.device);
  return batch;
}

absl::StatusOr<Profiler::Blocks> Profiler::BuildBlocks(const std::vector<int>& starts,
                                                         int64_t batch,
                                                         const std::string& options) const {
  Blocks blocks;
  const int n = static_cast<int>(starts.size());
  for (int b = 0; b < n; ++b) {
    const int end = b + 1 < n ? starts[b + 1] : static_cast<int>(ir_.nodes.size());
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir_, starts[b], end);
    if (!sub.ok()) return sub.status();
    blocks.structures.push_back(Structure(ir_, *sub));
    PlaceOnDevice(*sub->graph, options_.device);
    blocks.keys.push_back({absl::StrCat("s/", StableHash(blocks.structures.back())), batch,
                           options_.device_type, options});
    blocks.cached.push_back(cache_ ? cache_->Find(blocks.keys.back()) : std::nullopt);
    blocks.subs.push_back(std::move(*sub));
  }
  return blocks;
}

absl::StatusOr<std::vector<double>> Profiler::AtomicForwardMs() {
  OnDevice on_device(options_.device);
  const int n = static_cast<int>(ir_.nodes.size());
  const std::string options = absl::StrCat("atomic-fwd,r", options_.repeats, ",", AutocastState());
  std::vector<int> every_node(n);
  for (int i = 0; i < n; ++i) every_node[i] = i;
  absl::StatusOr<Blocks> nodes = BuildBlocks(every_node, ir_.example_batch, options);
  if (!nodes.ok()) return nodes.status();
  const std::vector<Subgraph>& subs = nodes->subs;
  const std::vector<ProfileKey>& keys = nodes->keys;
  const std::vector<std::optional<ProfileRecord>>& cached = nodes->cached;
  node_classes_ = Classes(nodes->structures);
  std::vector<double> node_ms(n);
  // The first node of each class; later ones take its time (and, in the pass below, its
  // outputs as theirs, which have the same shapes).
  std::vector<int> first(n, -1);
  int last_needed = -1;
  for (int i = 0; i < n; ++i) {
    int& f = first[node_classes_[i]];
    if (f < 0) {
      f = i;
      if (!cached[i]) last_needed = i;
    }
    if (cached[i]) node_ms[i] = cached[i]->fwd_ms;
  }
  if (last_needed < 0) {
    cache_hits_ += n;
    return node_ms;
  }

  absl::StatusOr<std::vector<at::Tensor>> batch = Batch(ir_.example_batch);
  if (!batch.ok()) return batch.status();
  std::unordered_map<int, c10::IValue> env;
  for (size_t i = 0; i < batch->size(); ++i) env[ir_.inputs[i]] = (*batch)[i];
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const int v = ir_.inputs[ir_.num_user_inputs + i];
    env[v] = ir_.values[v].written ? tensors_[i].clone() : tensors_[i];  // buffers may change
  }
  at::NoGradGuard no_grad;
  for (int i = 0; i < n; ++i) {
    const Subgraph& sub = subs[i];
    const int same = first[node_classes_[i]];
    if (same != i) {
      node_ms[i] = node_ms[same];
      ++shared_;
      if (i <= last_needed) {
        for (size_t o = 0; o < sub.outputs.size(); ++o) {
          env[sub.outputs[o]] = env.at(subs[same].outputs[o]);
        }
      }
      continue;
    }
    if (i > last_needed) {  // nothing after this needs running
      ++cache_hits_;
      continue;
    }
    std::vector<c10::IValue> inputs;
    for (int v : sub.inputs) inputs.push_back(env.at(v));
    std::vector<c10::IValue> outputs;
    absl::Status status = TorchCall(absl::StatusCode::kInternal, "profiling a node", [&] {
      torch::jit::Code code(sub.graph, "node");
      // No warm-up: the whole pass warms the process, and coarsening needs relative times.
      std::vector<double> times;
      double total = 0;
      do {
        torch::jit::Stack stack = inputs;
        Sync(options_.device);
        auto start = std::chrono::steady_clock::now();
        torch::jit::InterpreterState(code).run(stack);
        Sync(options_.device);
        times.push_back(Ms(std::chrono::steady_clock::now() - start));
        total += times.back();
        outputs = std::move(stack);
      } while (!cached[i] && static_cast<int>(times.size()) < options_.repeats &&
               total < options_.min_time_ms);
      if (cached[i]) {
        ++cache_hits_;
      } else {
        ProfileRecord record;
        record.fwd_ms = Median(times);
        if (cache_) cache_->Insert(keys[i], record);
        node_ms[i] = record.fwd_ms;
        ++measured_;
      }
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    for (size_t o = 0; o < sub.outputs.size(); ++o) env[sub.outputs[o]] = outputs[o];
  }
  return node_ms;
}

absl::StatusOr<std::vector<ProfileRecord>> Profiler::ProfileBlocks(const std::vector<int>& starts,
                                                                   int64_t micro_batch) {
  if (starts.empty() || starts[0] != 0 || micro_batch < 1) {
    return absl::InvalidArgumentError("ProfileBlocks: blocks must start at node 0, batch >= 1");
  }
  OnDevice on_device(options_.device);
  const std::string options =
      absl::StrCat("fwd+bwd,w", options_.warmup, ",r", options_.repeats, ",t",
                   options_.min_time_ms, ",l", options_.long_run_ms, ",", AutocastState());
  const int num_blocks = static_cast<int>(starts.size());
  std::vector<ProfileRecord> records(num_blocks);
  absl::StatusOr<Blocks> blocks = BuildBlocks(starts, micro_batch, options);
  if (!blocks.ok()) return blocks.status();
  const std::vector<Subgraph>& subs = blocks->subs;
  const std::vector<ProfileKey>& keys = blocks->keys;
  const std::vector<std::optional<ProfileRecord>>& hits = blocks->cached;
  // A block that repeats an earlier one (the same ops on the same kinds of inputs) is measured
  // once: it takes the earlier block's record, and its outputs as its own.
  const std::vector<int> classes = Classes(blocks->structures);
  std::vector<int> first(num_blocks, -1);
  int last_needed = -1;
  for (int b = 0; b < num_blocks; ++b) {
    int& f = first[classes[b]];
    if (f < 0) {
      f = b;
      if (!hits[b]) last_needed = b;
    }
  }
  if (last_needed < 0) {
    for (int b = 0; b < num_blocks; ++b) records[b] = *hits[b];
    cache_hits_ += num_blocks;
    return records;
  }
  // Values passed between blocks, detached: each block is profiled as a stage that receives
  // activations and returns their gradients.
  absl::StatusOr<std::vector<at::Tensor>> batch = Batch(micro_batch);
  if (!batch.ok()) return batch.status();
  std::unordered_map<int, at::Tensor> env;
  for (size_t i = 0; i < batch->size(); ++i) env[ir_.inputs[i]] = (*batch)[i];
  for (int b = 0; b < num_blocks; ++b) {
    const int end = b + 1 < num_blocks ? starts[b + 1] : static_cast<int>(ir_.nodes.size());
    const Subgraph* sub = &subs[b];
    const ProfileKey& key = keys[b];
    const int same = first[classes[b]];
    if (same != b || b > last_needed) {
      // Blocks after the last one to measure need no run: what is left is cached or repeats.
      records[b] = same != b ? records[same] : *hits[b];
      if (same != b) {
        ++shared_;
      } else {
        ++cache_hits_;
      }
      if (same != b && b <= last_needed) {
        for (size_t i = 0; i < sub->outputs.size(); ++i) {
          env[sub->outputs[i]] = env.at(subs[same].outputs[i]);
        }
      }
      continue;
    }
    const std::optional<ProfileRecord>& cached = hits[b];

    ProfileRecord record;
    std::vector<at::Tensor> outputs;
    absl::Status status = TorchCall(absl::StatusCode::kInternal,
                                    absl::StrCat("profiling nodes [", starts[b], ", ", end, ")"),
                                    [&]() -> absl::Status {
      // This block's own copies of what it reads, so gradients and buffer updates stay here.
      std::vector<at::Tensor> inputs;
      std::vector<at::Tensor> params;
      for (int v : sub->inputs) {
        const IrValue& value = ir_.values[v];
        if (value.role == ValueRole::kParam || value.role == ValueRole::kBuffer) {
          at::Tensor t = tensors_[v - ir_.num_user_inputs].detach().clone();
          if (value.role == ValueRole::kParam && t.is_floating_point()) {
            t.requires_grad_(true);
            t.mutable_grad() = at::zeros_like(t);  // accumulate in place, as in training
            params.push_back(t);
          }
          record.param_bytes += Bytes(t);
          inputs.push_back(t);
        } else {
          at::Tensor t = env.at(v).detach();
          if (value.role == ValueRole::kActivation && t.is_floating_point()) {
            t = t.clone().requires_grad_(true);
          }
          inputs.push_back(t);
        }
      }
      torch::jit::Code code(sub->graph, "block");
      auto forward = [&]() {
        torch::jit::Stack stack(inputs.begin(), inputs.end());
        torch::jit::InterpreterState(code).run(stack);
        std::vector<at::Tensor> out;
        for (const c10::IValue& v : stack) out.push_back(v.toTensor());
        return out;
      };
      if (cached) {
        at::NoGradGuard no_grad;
        outputs = forward();
        record = *cached;
        ++cache_hits_;
        return absl::OkStatus();
      }
      std::vector<double> fwd_times, bwd_times;
      double timed_ms = 0;
      auto tracker = std::make_shared<MemoryTracker>(options_.device);
      for (int r = 0; r < options_.warmup + options_.repeats; ++r) {
        bool measure = r >= options_.warmup;
        if (!fwd_times.empty() && timed_ms >= options_.min_time_ms) break;
        outputs.clear();  // the last run's, so the tracker sees this run's memory alone
        c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, tracker);
        const int64_t base = tracker->current();
        tracker->ResetPeak();
        Sync(options_.device);
        auto start = std::chrono::steady_clock::now();
        outputs = forward();
        Sync(options_.device);
        auto fwd_end = std::chrono::steady_clock::now();
        const int64_t kept = tracker->current() - base;
        const int64_t fwd_peak = tracker->peak() - base;
        std::vector<at::Tensor> roots, grads;
        for (const at::Tensor& o : outputs) {
          if (o.requires_grad()) {
            roots.push_back(o);
            grads.push_back(at::ones_like(o));
          }
        }
        const int64_t bwd_base = tracker->current();
        tracker->ResetPeak();
        auto bwd_start = std::chrono::steady_clock::now();
        if (!roots.empty()) torch::autograd::backward(roots, grads);
        Sync(options_.device);
        auto bwd_end = std::chrono::steady_clock::now();
        const int64_t bwd_peak = tracker->peak() - bwd_base;
        // A warm-up that ran long is a measurement too: what a first run costs extra (fresh
        // pages, lazy initialisation) is small beside it, and a second run would double the
        // time profiling a large block takes.
        measure = measure || Ms(bwd_end - start) >= options_.long_run_ms;
        if (measure) {
          fwd_times.push_back(Ms(fwd_end - start));
          bwd_times.push_back(Ms(bwd_end - bwd_start));
          timed_ms += fwd_times.back() + bwd_times.back();
          record.act_bytes = static_cast<uint64_t>(std::max<int64_t>(kept, 0));
          record.peak_bytes = static_cast<uint64_t>(
              std::max<int64_t>({fwd_peak - kept, bwd_peak, int64_t{0}}));
        }
        for (at::Tensor& in : inputs) {
          if (in.requires_grad() && in.grad().defined()) in.mutable_grad().reset();
        }
        for (at::Tensor& o : outputs) o = o.detach();
      }
      record.fwd_ms = Median(fwd_times);
      record.bwd_ms = Median(bwd_times);
      for (const at::Tensor& o : outputs) record.output_bytes += Bytes(o);
      if (cache_) cache_->Insert(key, record);
      ++measured_;
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    for (size_t i = 0; i < sub->outputs.size(); ++i) env[sub->outputs[i]] = outputs[i].detach();
    records[b] = record;
  }
  return records;
}

}  // namespace planner
}  // namespace rannc
