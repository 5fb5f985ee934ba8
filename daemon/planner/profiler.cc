#include "daemon/planner/profiler.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/memory_tracker.h"
#include "daemon/common/status.h"
#include "daemon/graph/subgraph.h"

namespace rannc {
namespace planner {
namespace {

std::string GraphKey(const IrGraph& ir, const Subgraph& sub) {
  return absl::StrCat(ir.hash, "/", StableHash(ir.hash + sub.graph->toString()));
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

uint64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

}  // namespace

Profiler::Profiler(const IrGraph& ir, std::vector<at::Tensor> tensors,
                   std::vector<at::Tensor> example_inputs, ProfileCache* cache,
                   ProfilerOptions options)
    : ir_(ir),
      tensors_(std::move(tensors)),
      example_inputs_(std::move(example_inputs)),
      cache_(cache),
      options_(std::move(options)) {}

absl::StatusOr<std::vector<double>> Profiler::AtomicForwardMs() {
  const int n = static_cast<int>(ir_.nodes.size());
  const std::string options = absl::StrCat("atomic-fwd,r", options_.repeats);
  std::vector<Subgraph> subs;
  std::vector<ProfileKey> keys;
  std::vector<std::optional<ProfileRecord>> cached;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir_, i, i + 1);
    if (!sub.ok()) return sub.status();
    keys.push_back({GraphKey(ir_, *sub), ir_.example_batch, options_.device_type, options});
    cached.push_back(cache_ ? cache_->Find(keys.back()) : std::nullopt);
    subs.push_back(std::move(*sub));
  }
  std::vector<double> node_ms(n);
  bool all_cached = true;
  for (int i = 0; i < n; ++i) {
    all_cached = all_cached && cached[i].has_value();
    if (cached[i]) node_ms[i] = cached[i]->fwd_ms;
  }
  if (all_cached) {
    cache_hits_ += n;
    return node_ms;
  }

  std::unordered_map<int, c10::IValue> env;
  for (size_t i = 0; i < example_inputs_.size(); ++i) env[ir_.inputs[i]] = example_inputs_[i];
  for (size_t i = 0; i < tensors_.size(); ++i) {
    env[ir_.inputs[ir_.num_user_inputs + i]] = tensors_[i].clone();  // buffers may be mutated
  }
  at::NoGradGuard no_grad;
  for (int i = 0; i < n; ++i) {
    const Subgraph& sub = subs[i];
    // An identical node measured earlier in this pass: use its time, so a plan from the cache
    // later sees exactly the times this one did.
    if (!cached[i] && cache_) cached[i] = cache_->Find(keys[i]);
    if (cached[i]) node_ms[i] = cached[i]->fwd_ms;
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
        auto start = std::chrono::steady_clock::now();
        torch::jit::InterpreterState(code).run(stack);
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
  const std::string options = absl::StrCat("fwd+bwd,w", options_.warmup, ",r", options_.repeats,
                                           ",t", options_.min_time_ms);
  std::vector<ProfileRecord> records;
  std::vector<Subgraph> subs;
  std::vector<ProfileKey> keys;
  std::vector<std::optional<ProfileRecord>> hits;
  bool all_cached = true;
  for (size_t b = 0; b < starts.size(); ++b) {
    const int end = b + 1 < starts.size() ? starts[b + 1] : static_cast<int>(ir_.nodes.size());
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir_, starts[b], end);
    if (!sub.ok()) return sub.status();
    keys.push_back({GraphKey(ir_, *sub), micro_batch, options_.device_type, options});
    hits.push_back(cache_ ? cache_->Find(keys.back()) : std::nullopt);
    all_cached = all_cached && hits.back().has_value();
    subs.push_back(std::move(*sub));
  }
  if (all_cached) {
    for (const auto& hit : hits) records.push_back(*hit);
    cache_hits_ += static_cast<int>(hits.size());
    return records;
  }
  // Values passed between blocks, detached: each block is profiled as a stage that receives
  // activations and returns their gradients.
  std::unordered_map<int, at::Tensor> env;
  for (size_t i = 0; i < example_inputs_.size(); ++i) {
    env[ir_.inputs[i]] = RepeatSamples(example_inputs_[i], micro_batch);
  }
  for (size_t b = 0; b < starts.size(); ++b) {
    const int end = b + 1 < starts.size() ? starts[b + 1] : static_cast<int>(ir_.nodes.size());
    const Subgraph* sub = &subs[b];
    const ProfileKey& key = keys[b];
    // An identical block measured earlier in this pass counts as cached (see AtomicForwardMs).
    if (!hits[b] && cache_) hits[b] = cache_->Find(key);
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
      auto tracker = std::make_shared<MemoryTracker>();
      for (int r = 0; r < options_.warmup + options_.repeats; ++r) {
        const bool measure = r >= options_.warmup;
        if (measure && !fwd_times.empty() && timed_ms >= options_.min_time_ms) break;
        outputs.clear();  // the last run's, so the tracker sees this run's memory alone
        c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, tracker);
        const int64_t base = tracker->current();
        tracker->ResetPeak();
        auto start = std::chrono::steady_clock::now();
        outputs = forward();
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
        auto bwd_end = std::chrono::steady_clock::now();
        const int64_t bwd_peak = tracker->peak() - bwd_base;
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
    records.push_back(record);
  }
  return records;
}

}  // namespace planner
}  // namespace rannc
