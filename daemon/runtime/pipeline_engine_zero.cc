// ZeRO stage 2 in the pipeline engine (EngineOptions::zero; pipeline_internal::ZeroPartition
// says how a stage's parameters are laid out and sharded over its replicas). Every function here
// runs on one device's worker, or, for the reads, on the engine's calling thread between steps.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/runtime/pipeline_engine_impl.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {

using pipeline_internal::Device;
using pipeline_internal::ZeroPartition;

namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<int64_t> ContiguousStrides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * std::max<int64_t>(sizes[i + 1], 1);
  }
  return strides;
}

// Optimizer state that is one scalar per parameter (PyTorch's step count) rather than one value
// per element.
bool IsScalarState(const std::string& key) { return IsScalarOptimizerState(key); }

}  // namespace

absl::Status PipelineEngine::Impl::SetUpZero(Device& d,
                                             const std::vector<std::vector<int>>& groups,
                                             std::vector<ParamGroup>* device_groups,
                                             std::vector<std::vector<int>>* ids) {
  const int R = static_cast<int>(stages_[d.stage].devices.size());
  for (const Device* r : Replicas(d.stage)) {
    if (!r->local) {
      return absl::UnimplementedError(absl::StrCat(
          "enable_zero with stage ", d.stage, "'s replicas run by different daemons"));
    }
  }
  const std::set<int> tied(tied_.begin(), tied_.end());
  at::NoGradGuard no_grad;
  d.zero_reducer.reset();  // its hooks and buffers refer to the old partitions
  d.zero.clear();
  // The optimizer group of each parameter ZeRO shards (the first group naming it).
  std::map<int, int> group_of;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int li : groups[g]) {
      if (!d.lifted[li].defined() || !d.Master(li).requires_grad() || tied.count(li)) continue;
      group_of.emplace(li, static_cast<int>(g));
    }
  }
  // Partitions are the reduce-scatter's buckets, so they are laid out as GradReducer lays out
  // its own: walking the parameters backwards (autograd produces gradients roughly in that
  // order), one open partition per (group, dtype), closed once it holds bucket_bytes_. The
  // first partitions are then complete early in the backward and reduce-scatter while it goes
  // on. The order is the same on every replica.
  std::vector<int64_t> sizes;  // elements per partition
  std::map<std::pair<int, at::ScalarType>, int> open;
  const std::vector<int>& stage_params = stages_[d.stage].params;
  for (auto it = stage_params.rbegin(); it != stage_params.rend(); ++it) {
    const int li = *it;
    auto g = group_of.find(li);
    if (g == group_of.end()) continue;
    const at::Tensor& p = d.Master(li);
    const std::pair<int, at::ScalarType> key{g->second, p.scalar_type()};
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    auto o = open.find(key);
    if (o != open.end() &&
        (sizes[o->second] * static_cast<int64_t>(p.element_size()) + bytes) >
            static_cast<int64_t>(bucket_bytes_)) {
      open.erase(o);
      o = open.end();
    }
    if (o == open.end()) {
      o = open.emplace(key, static_cast<int>(d.zero.size())).first;
      d.zero.emplace_back().group = g->second;
      sizes.push_back(0);
    }
    const int k = o->second;
    d.zero[k].params.push_back(li);
    d.zero[k].offsets.push_back(sizes[k]);
    sizes[k] += p.numel();
    if (sizes[k] * static_cast<int64_t>(p.element_size()) >= static_cast<int64_t>(bucket_bytes_)) {
      open.erase(o);
    }
  }
  std::set<int> sharded;
  GradReducer::Options scatter;
  std::vector<at::Tensor> handles;  // the zero reducer's parameters, partition by partition
  for (size_t k = 0; k < d.zero.size(); ++k) {
    ZeroPartition& part = d.zero[k];
    const at::ScalarType type = d.Master(part.params[0]).scalar_type();
    part.len = (sizes[k] + R - 1) / R;
    // Offloaded, the flat buffer is only where the host shard is cut from.
    part.flat = at::zeros({part.len * R}, offload_ ? at::TensorOptions().dtype(type) : d.On(type));
    for (size_t i = 0; i < part.params.size(); ++i) {
      at::Tensor& p = d.Master(part.params[i]);
      part.flat.narrow(0, part.offsets[i], p.numel()).copy_(p.reshape(-1));
      // The parameter becomes a slice of the flat buffer, in place: the stage executor's
      // handle to it sees the new storage. (Offloaded, it is empty until Upload gathers it.)
      if (!offload_) {
        p.set_(part.flat.storage(), part.offsets[i], p.sizes(), ContiguousStrides(p.sizes()));
      }
    }
    part.shard_offset = d.replica * part.len;
    if (offload_) {
      // The host shard becomes the master of its slice; the whole parameters are not kept.
      part.shard = part.flat.narrow(0, part.shard_offset, part.len).clone();
      if (d.place.is_cuda()) {
        at::Tensor pinned = PinnedExact(part.shard);
        if (pinned.defined()) part.shard = pinned.copy_(part.shard);
      }
      part.flat = at::Tensor();
    } else {
      part.shard = at::empty({0}, part.flat.options());
      part.shard.set_(part.flat.storage(), part.shard_offset, {part.len}, {1});
    }
    part.shard.requires_grad_(true);
    std::vector<int>& bucket = scatter.scatter_buckets.emplace_back();
    for (size_t i = 0; i < part.params.size(); ++i) {
      const int li = part.params[i];
      zero_slots_[li] = {d.stage, static_cast<int>(k), static_cast<int>(i)};
      sharded.insert(li);
      bucket.push_back(static_cast<int>(handles.size()));
      handles.push_back(d.lifted[li]);
      // Offloaded, the handles are empty between steps (Upload fills them).
      if (offload_) scatter.numels.push_back(Numel(lifted_shapes_[li]));
    }
    (*device_groups)[part.group].params.push_back(part.shard);
    (*ids)[part.group].push_back(-1 - static_cast<int>(k));
  }
  if (offload_) {
    for (int li : sharded) d.host[li] = at::Tensor();
    // The whole parameters' page-locked memory is not asked for again in those sizes.
    if (host_pool_) host_pool_->Trim();
  }
  if (!d.zero.empty()) {
    absl::StatusOr<std::unique_ptr<GradReducer>> reducer =
        GradReducer::Create(std::move(handles), d.replicas.get(), scatter);
    if (!reducer.ok()) return reducer.status();
    d.zero_reducer = std::move(*reducer);
  }
  // The bucketed all-reduce keeps what ZeRO does not shard (parameters outside the optimizer).
  std::vector<int> rest;
  for (int li : stages_[d.stage].params) {
    if (!tied.count(li) && !sharded.count(li)) rest.push_back(li);
  }
  d.reducer.reset();
  absl::StatusOr<std::unique_ptr<GradReducer>> reducer = MakeReducer(d, rest);
  if (!reducer.ok()) return reducer.status();
  d.reducer = std::move(*reducer);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> PipelineEngine::Impl::ReduceScatterZero(Device& d) {
  std::vector<at::Tensor> shards;
  if (!d.zero_reducer) return shards;
  // Armed already when this step ran a backward on this device (nothing when so).
  d.zero_reducer->BeginFinalBackward();
  absl::Status s = d.zero_reducer->Finish(
      [&](std::unique_ptr<comm::Work> work, at::Tensor keep, const std::string& what) {
        return Wait(d, std::move(work), std::move(keep), absl::StrCat(what, " (ZeRO)"));
      },
      &shards);
  if (!s.ok()) return s;
  if (shards.size() != d.zero.size()) {
    return absl::InternalError(
        absl::StrCat(shards.size(), " ZeRO gradient shards for ", d.zero.size(), " partitions"));
  }
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < shards.size(); ++k) {
    if (shards[k].numel() != d.zero[k].len) {
      return absl::InternalError(absl::StrCat("ZeRO partition ", k, "'s gradient shard has ",
                                              shards[k].numel(), " elements, not ",
                                              d.zero[k].len));
    }
    if (scaler_.enabled()) Unscale(shards[k]);
    if (offload_) shards[k] = ToHost(shards[k]);  // the shard's master is in host memory
  }
  return shards;
}

void PipelineEngine::Impl::AddZeroShards(Device& d, std::vector<at::Tensor> shards, bool fused) {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < shards.size(); ++k) {
    ZeroPartition& part = d.zero[k];
    if (fused) {
      part.fused_grad = std::move(shards[k]);
    } else if (part.shard.grad().defined()) {
      part.shard.mutable_grad().add_(shards[k]);
    } else {
      part.shard.mutable_grad() = std::move(shards[k]);
    }
  }
}

void PipelineEngine::Impl::AddZeroFusedGrads(Device& d, double g, bool retain_graph) {
  at::NoGradGuard no_grad;
  for (ZeroPartition& part : d.zero) {
    if (part.fused_grad.defined() && g != 0.0) {
      at::Tensor& grad = part.shard.mutable_grad();
      if (grad.defined()) {
        grad.add_(part.fused_grad, g);
      } else {
        grad = g == 1.0 && !retain_graph ? part.fused_grad : part.fused_grad * g;
      }
    }
    if (!retain_graph) part.fused_grad.reset();
  }
}

absl::Status PipelineEngine::Impl::GatherZeroParams(Device& d) {
  for (ZeroPartition& part : d.zero) {
    at::Tensor mine = part.shard.detach().clone();
    absl::StatusOr<comm::Buffer> in = BufferOf(mine);
    if (!in.ok()) return in.status();
    absl::StatusOr<comm::Buffer> all = BufferOf(part.flat);
    if (!all.ok()) return all.status();
    absl::Status s = Wait(d, d.replicas->AllGather(*in, *all), mine,
                          "all-gathering ZeRO parameters");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::ForShardSlice(
    const ZeroPartition& part, size_t i,
    const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
  const int64_t numel = Numel(lifted_shapes_[part.params[i]]);
  const int64_t from = std::max(part.offsets[i], part.shard_offset);
  const int64_t to = std::min(part.offsets[i] + numel, part.shard_offset + part.len);
  if (from < to) fn(from - part.shard_offset, from - part.offsets[i], to - from);
}

at::Tensor PipelineEngine::Impl::FullGrad(int lifted) const {
  auto slot = zero_slots_.find(lifted);
  if (slot == zero_slots_.end()) {
    const at::Tensor t = OwnerTensor(lifted);
    return t.defined() ? t.grad() : at::Tensor();
  }
  return Assemble(slot->second, lifted, /*grad=*/true);
}

at::Tensor PipelineEngine::Impl::ShardedValue(int lifted) const {
  return Assemble(zero_slots_.at(lifted), lifted, /*grad=*/false);
}

at::Tensor PipelineEngine::Impl::Assemble(const ZeroSlot& slot, int lifted, bool grad) const {
  std::vector<at::Tensor> shards;
  for (const Device* r : Replicas(slot.stage)) {
    const at::Tensor& shard = r->zero[slot.partition].shard;
    const at::Tensor& t = grad ? shard.grad() : shard;
    if (!t.defined()) return at::Tensor();
    shards.push_back(ToHost(t.detach()));
  }
  const ZeroPartition& part = Replicas(slot.stage)[0]->zero[slot.partition];
  const std::vector<int64_t>& shape = lifted_shapes_[lifted];
  return at::cat(shards).narrow(0, part.offsets[slot.index], Numel(shape)).view(shape).clone();
}

std::vector<PipelineEngine::StatePiece> PipelineEngine::Impl::OptimizerStatePieces() const {
  std::vector<PipelineEngine::StatePiece> out;
  for (const Device& d : devices_) {
    if (!d.optimizer) continue;
    for (const auto& [name, value] : d.optimizer->NamedState()) {
      const auto [li, key] = d.StateOf(name);
      if (li < 0 || owner_[li] != d.world_rank) continue;  // a ZeRO shard: below
      out.push_back({li, key, ReadCopy(value.detach()), 0, false});
    }
    if (d.zero.empty() || d.replica != 0) continue;  // replica 0 reports every replica's
    for (const Device* r : Replicas(d.stage)) {
      for (size_t k = 0; k < r->zero.size(); ++k) {
        const ZeroPartition& part = r->zero[k];
        const int index = static_cast<int>(
            std::find(r->optimizer_params.begin(), r->optimizer_params.end(),
                      -1 - static_cast<int>(k)) - r->optimizer_params.begin());
        const std::string prefix = absl::StrCat(index, ".");
        for (const auto& [name, value] : r->optimizer->NamedState()) {
          if (name.rfind(prefix, 0) != 0) continue;
          const std::string key = name.substr(prefix.size());
          for (size_t i = 0; i < part.params.size(); ++i) {
            if (IsScalarState(key)) {
              // The same on every shard: replica 0's, whole.
              if (r == &d) out.push_back({part.params[i], key, ReadCopy(value.detach()), 0, false});
              continue;
            }
            // A structured binding is not captured by lambdas before C++20 (clang refuses it).
            const at::Tensor& state = value;
            ForShardSlice(part, i, [&](int64_t shard_from, int64_t param_from, int64_t count) {
              out.push_back({part.params[i], key,
                             ReadCopy(state.detach().narrow(0, shard_from, count)), param_from,
                             true});
            });
          }
        }
      }
    }
  }
  return out;
}

void PipelineEngine::Impl::LoadZeroOptimizerState(
    const Device& d, const std::map<int, std::vector<std::pair<std::string, at::Tensor>>>& state,
    std::vector<std::pair<std::string, at::Tensor>>* named) const {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < d.zero.size(); ++k) {
    const ZeroPartition& part = d.zero[k];
    const int index = static_cast<int>(
        std::find(d.optimizer_params.begin(), d.optimizer_params.end(),
                  -1 - static_cast<int>(k)) - d.optimizer_params.begin());
    // Keys every parameter of the partition has (a partition's parameters step together).
    std::map<std::string, std::vector<const at::Tensor*>> by_key;
    for (int li : part.params) {
      auto it = state.find(li);
      if (it == state.end()) continue;
      for (const auto& [key, value] : it->second) by_key[key].push_back(&value);
    }
    for (const auto& [key, values] : by_key) {
      if (values.size() != part.params.size()) continue;
      at::Tensor value;
      if (!IsScalarState(key)) {
        at::Tensor flat = at::zeros({part.len * static_cast<int64_t>(Replicas(d.stage).size())},
                                    values[0]->options());
        for (size_t i = 0; i < values.size(); ++i) {
          flat.narrow(0, part.offsets[i], values[i]->numel()).copy_(values[i]->reshape(-1));
        }
        value = flat.narrow(0, part.shard_offset, part.len).clone();
      } else {
        value = values[0]->clone();
      }
      named->emplace_back(absl::StrCat(index, ".", key), value);
    }
  }
}

}  // namespace rannc
