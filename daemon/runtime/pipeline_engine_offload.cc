// Parameter offload in the pipeline engine (EngineOptions::offload). A device's parameters live
// in host memory between steps (Device::host: value, accumulated gradient, the optimizer's
// parameter and so its state; with ZeRO, the replica's host shard instead); the device holds
// them only during a step:
//  - Upload, at the start of the device's part of a step, copies them into the executor's
//    handles (ZeRO: all-gathers the replicas' shards into the flat buffer they are slices of).
//    A stage after the first uploads while the stages before it compute its first inputs, so
//    there the upload overlaps the pipeline's fill.
//  - After the step's backward and gradient reduction, its gradients go to the host masters
//    (ZeRO: the reduce-scattered shard) and Release frees the device copies.
//  - The optimizer steps the host masters, off the devices' workers.
// A forward whose graphs a later backward needs keeps the copies until that backward.
// Buffers and frozen parameters stay on the device, and so do the trainable parameters a
// streamed stage's plan keeps there (Device::kept): offloaded no more than the memory makes
// necessary, they train as without offload, stepped by the device (StartHostStep).
//
// Streaming (EngineOptions::offload_block_bytes, a stage with one replica): the stage executor
// runs the stage as blocks (StageExecutor::CreateBlocked), and a parameter that only one block
// reads is on the device only while that block computes: Fetch copies it in just before the
// block's forward and again before its backward (Prefetch has usually started the copies while
// the block before it computed: on a CUDA device, on a side stream), Evict frees it after each
// (the last block keeps its parameters from its forward to its backward), and as the block's
// backward ends its gradients go to the host (BlockGradsToHost: on a CUDA device on a second
// side stream, while the blocks before it compute), summed there over the step's backwards.
// The device then holds about three blocks' parameters (the one computing, the next, the last)
// and one to three blocks' gradients at a time (two may still be copying), besides the
// activations. A fetched parameter is the same tensor each time (what autograd saved in the
// forward is what the backward reads): Evict frees its storage's memory and Fetch allocates it
// again, neither of them a write autograd would see. A streamed parameter the forward reads
// only through a cast to bf16 or fp16 (amp_level O2) streams in that dtype (Device::low_dtype):
// half the bytes each way.
#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/StreamGuard.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/runtime/pipeline_engine_impl.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {

using pipeline_internal::Device;
using pipeline_internal::ZeroPartition;

namespace {

// /proc/meminfo's MemAvailable in bytes; -1 where it does not say.
int64_t MemAvailable() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

std::string GiB(int64_t bytes) { return absl::StrFormat("%.1f GiB", bytes / double(1 << 30)); }

// t.set_(source) on a leaf between steps (no graph uses it). Autograd then drops the leaf's
// gradient accumulator, shaped as the leaf was, so the GradReducer must Rebind.
void SwapStorage(at::Tensor& t, const at::Tensor& source) {
  at::NoGradGuard no_grad;
  t.set_(source);
}

// Frees the memory of `t`'s storage, keeping the tensor: its shape, its autograd identity and
// version (the graphs that saved it still name it).
void FreeData(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

// `t` (a leaf no graph has used yet, empty) reshaped to `shape` in `dtype`, without memory: the
// same tensor, so the executor's handle follows. set_ keeps a tensor's dtype, so the TensorImpl
// takes the new storage and dtype directly.
void Retype(const at::Tensor& t, at::IntArrayRef shape, const at::TensorOptions& options) {
  const at::Tensor shaped = at::empty(shape, options);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_storage_and_dtype(shaped.storage(), shaped.dtype());
  impl->set_sizes_contiguous(shaped.sizes());
  impl->set_storage_offset(0);
  FreeData(t);
}

// Memory for a tensor FreeData emptied (contiguous at offset 0, as SetUpStreaming makes them),
// from its device's allocator on the calling thread (the device's worker, whose allocations
// its MemoryTracker counts).
void AllocateData(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace

void PipelineEngine::Impl::SetUpStreaming(Device& d) {
  const int blocks = d.exec->num_blocks();
  std::map<int, int> readers;  // lifted index -> blocks reading it
  for (int k = 0; k < blocks; ++k) {
    for (int li : d.exec->block_lifted(k)) ++readers[li];
  }
  const std::set<int> params(stages_[d.stage].params.begin(), stages_[d.stage].params.end());
  const std::set<int> tied(tied_.begin(), tied_.end());
  d.streamed.assign(blocks, {});
  d.block_state.assign(blocks, Device::BlockState::kOff);
  d.block_ready.resize(blocks);
  if (d.place.is_cuda()) {
    const c10::impl::VirtualGuardImpl impl(d.place.type());
    d.upload_stream = impl.getStreamFromGlobalPool(d.place);
    d.download_stream = impl.getStreamFromGlobalPool(d.place);
  }
  d.is_streamed.assign(d.lifted.size(), 0);
  d.low_dtype.assign(d.lifted.size(), at::ScalarType::Undefined);
  d.host_low.assign(d.lifted.size(), at::Tensor());
  d.low_fresh.assign(d.lifted.size(), 0);
  at::NoGradGuard no_grad;
  int64_t low = 0;
  for (int k = 0; k < blocks; ++k) {
    for (int li : d.exec->block_lifted(k)) {
      if (readers[li] != 1 || !params.count(li) || tied.count(li) || d.host.empty() ||
          !d.host[li].defined()) {
        continue;
      }
      d.streamed[k].push_back(li);
      d.is_streamed[li] = 1;
      // The handle the executor holds takes the parameter's shape (and the dtype it is read
      // in), without memory.
      const std::optional<at::ScalarType> read_as =
          offload_low_precision_ ? LowPrecisionRead(*ir_, li) : std::nullopt;
      d.low_dtype[li] = read_as.value_or(at::ScalarType::Undefined);
      if (read_as) low += d.host[li].numel();
      Retype(d.lifted[li], d.host[li].sizes(), d.On(read_as.value_or(d.host[li].scalar_type())));
    }
  }
  int64_t bytes = 0, most = 0;
  for (const std::vector<int>& block : d.streamed) {
    int64_t b = 0;
    for (int li : block) b += d.lifted[li].numel() * d.lifted[li].element_size();
    bytes += b;
    most = std::max(most, b);
  }
  spdlog::info("engine {}: device {} streams its offloaded parameters in {} blocks ({:.3f} GB "
               "uploaded a pass, at most {:.3f} GB a block; {} parameters in a narrower dtype "
               "than their masters') and keeps {} parameters ({:.3f} GB) on the device",
               id_, d.index, blocks, bytes / 1e9, most / 1e9, low, d.kept.size(),
               KeptOnDeviceBytes(d.index) / 1e9);
}

StageBlockHooks PipelineEngine::Impl::StreamingHooks(Device& d) {
  StageBlockHooks hooks;
  hooks.before_forward = [this, &d](int k) {
    absl::Status fetched = Fetch(d, k);
    if (fetched.ok() && k + 1 < static_cast<int>(d.streamed.size())) Prefetch(d, k + 1);
    return fetched;
  };
  hooks.after_forward = [this, &d](int k) {
    // The last block's backward comes next (1F1B), or the step's end releases it.
    if (k + 1 < static_cast<int>(d.streamed.size())) Evict(d, k);
    return absl::OkStatus();
  };
  hooks.before_backward = [this, &d](int k) {
    absl::Status fetched = Fetch(d, k);
    if (fetched.ok() && k > 0) Prefetch(d, k - 1);
    return fetched;
  };
  hooks.after_backward = [this, &d](int k) {
    BlockGradsToHost(d, k);
    Evict(d, k);
    return absl::OkStatus();
  };
  return hooks;
}

absl::Status PipelineEngine::Impl::Fetch(Device& d, int block) {
  if (d.streamed.empty() || d.block_state[block] == Device::BlockState::kOn) {
    return absl::OkStatus();
  }
  if (d.block_state[block] == Device::BlockState::kPrefetching) {
    // Prefetched: the device's stream waits for the upload stream's copies.
    const c10::impl::VirtualGuardImpl impl(d.place.type());
    d.block_ready[block]->block(impl.getStream(d.place));
    d.block_state[block] = Device::BlockState::kOn;
    return absl::OkStatus();
  }
  // The optimizer step before this forward may still be stepping the block's masters.
  absl::Status stepped = AwaitStepped(d, block);
  if (!stepped.ok()) return stepped;
  at::NoGradGuard no_grad;
  for (int li : d.streamed[block]) {
    const at::Tensor& t = d.lifted[li];
    AllocateData(t);
    // Through an alias with a version counter of its own: the parameter's does not move, so
    // the graphs that saved it before Evict read it again.
    const at::Tensor& source = UploadSource(d, li);
    t.variable_data().copy_(source, /*non_blocking=*/source.is_pinned());
    d.streamed_bytes += static_cast<int64_t>(t.nbytes());
  }
  d.streamed_peak = std::max(d.streamed_peak, d.streamed_bytes);
  d.block_state[block] = Device::BlockState::kOn;
  return absl::OkStatus();
}

void PipelineEngine::Impl::Prefetch(Device& d, int block) {
  if (d.streamed.empty() || d.block_state[block] != Device::BlockState::kOff) return;
  // Not while the optimizer still steps the block: the block before it computes first, and
  // Fetch waits.
  if (!Stepped(d, block)) return;
  if (!d.upload_stream) {
    Fetch(d, block).IgnoreError();  // a CPU device: nothing to overlap; stepped, so no failure
    return;
  }
  const c10::impl::VirtualGuardImpl impl(d.place.type());
  const c10::Stream compute = impl.getStream(d.place);
  at::NoGradGuard no_grad;
  // The memory comes from the device's stream (the caching allocator orders its reuse there):
  // the upload stream writes it only after what that stream has queued so far.
  for (int li : d.streamed[block]) {
    UploadSource(d, li);  // cast on the host first, where the parameter streams narrower
    AllocateData(d.lifted[li]);
    d.streamed_bytes += static_cast<int64_t>(d.lifted[li].nbytes());
  }
  d.streamed_peak = std::max(d.streamed_peak, d.streamed_bytes);
  c10::Event allocated(d.place.type());
  allocated.record(compute);
  allocated.block(*d.upload_stream);
  {
    const c10::StreamGuard on_upload(*d.upload_stream);
    for (int li : d.streamed[block]) {
      d.lifted[li].variable_data().copy_(UploadSource(d, li), /*non_blocking=*/true);
    }
  }
  d.block_ready[block] = std::make_unique<c10::Event>(d.place.type());
  d.block_ready[block]->record(*d.upload_stream);
  d.block_state[block] = Device::BlockState::kPrefetching;
}

const at::Tensor& PipelineEngine::Impl::UploadSource(Device& d, int li) {
  if (!d.Low(li)) return d.host[li];
  at::Tensor& low = d.host_low[li];
  if (!d.low_fresh[li]) {
    at::NoGradGuard no_grad;
    if (!low.defined()) low = HostBuffer(d, d.host[li], d.low_dtype[li]);
    low.copy_(d.host[li].detach());
    d.low_fresh[li] = 1;
  }
  return low;
}

void PipelineEngine::Impl::Evict(Device& d, int block) {
  if (d.streamed.empty() || d.block_state[block] == Device::BlockState::kOff) return;
  // A prefetch never waited for (a failed step): its copies end before the memory is reused.
  if (d.block_state[block] == Device::BlockState::kPrefetching) Fetch(d, block).IgnoreError();
  for (int li : d.streamed[block]) {
    FreeData(d.lifted[li]);
    d.streamed_bytes -= static_cast<int64_t>(d.lifted[li].nbytes());
  }
  d.block_state[block] = Device::BlockState::kOff;
}

void PipelineEngine::Impl::BlockGradsToHost(Device& d, int block) {
  at::NoGradGuard no_grad;
  TakeDownloads(d, /*wait=*/false);
  Device::Download download;
  for (int li : d.streamed[block]) {
    at::Tensor g = d.lifted[li].grad();
    if (!g.defined()) continue;
    d.lifted[li].mutable_grad().reset();
    g = g.detach();
    // From a CUDA device into page-locked memory on the download stream, while the blocks
    // before this one compute their backwards; a CPU device's is on the host already.
    at::Tensor host = d.download_stream && !g.device().is_cpu() ? PinnedExact(g) : at::Tensor();
    if (host.defined()) {
      download.device.emplace_back(li, g);
      download.host.emplace_back(li, host);
    } else {
      // No page-locked memory to be had: a synchronous copy, after the earlier ones are
      // summed, so that every gradient adds up in the order of the backwards.
      if (!g.device().is_cpu()) TakeDownloads(d, /*wait=*/true);
      AddStreamedGrad(d, li, g.device().is_cpu() ? g : HostCopy(g));
    }
  }
  if (download.device.empty()) return;
  const c10::impl::VirtualGuardImpl impl(d.place.type());
  c10::Event computed(d.place.type());
  computed.record(impl.getStream(d.place));
  computed.block(*d.download_stream);
  {
    const c10::StreamGuard on_download(*d.download_stream);
    for (size_t i = 0; i < download.device.size(); ++i) {
      download.host[i].second.copy_(download.device[i].second, /*non_blocking=*/true);
    }
  }
  download.done = std::make_unique<c10::Event>(d.place.type());
  download.done->record(*d.download_stream);
  d.downloads.push_back(std::move(download));
  // At most two blocks' gradients held on the device for their copies, beside the next
  // block's backward (the planner counts three blocks', cost_eval_internal.h).
  while (d.downloads.size() > 2) {
    AwaitOnHost(*d.downloads.front().done);
    TakeDownloads(d, /*wait=*/false);
  }
}

void PipelineEngine::Impl::TakeDownloads(Device& d, bool wait) {
  while (!d.downloads.empty()) {
    Device::Download& oldest = d.downloads.front();
    if (wait) {
      AwaitOnHost(*oldest.done);
    } else if (!oldest.done->query()) {
      return;
    }
    for (const auto& [li, g] : oldest.host) AddStreamedGrad(d, li, g);
    d.downloads.pop_front();
  }
}

void PipelineEngine::Impl::AddStreamedGrad(Device& d, int li, const at::Tensor& g) {
  // In the master's dtype (a narrower parameter's gradient widened, as the cast's backward
  // would have on the device), summed over the step's backwards.
  at::Tensor& sum = d.streamed_grads[li];
  if (sum.defined()) {
    sum.add_(g);
    return;
  }
  const at::ScalarType dtype = d.host[li].scalar_type();
  if (g.scalar_type() == dtype) {
    sum = g;
    return;
  }
  // Widened into page-locked memory for a CUDA device, as its gradients' copies are: the
  // caching host allocator hands the same pages out again each step (fresh pageable memory
  // is faulted in page by page, seconds for a large model).
  sum = HostBuffer(d, g, dtype);
  sum.copy_(g);
}

absl::Status PipelineEngine::Impl::CheckHostMemory(int64_t bytes, const std::string& what) const {
  if (bytes <= 0) return absl::OkStatus();
  const int64_t available = host_memory_available_ ? host_memory_available_() : MemAvailable();
  if (available < 0 || bytes <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " needs ", GiB(bytes), " more of the host's memory, which has ", GiB(available),
      " available (MemAvailable); nothing was allocated. Free host memory (other jobs, other "
      "processes), or offload less: a smaller model per daemon, without offload_low_precision, "
      "or an optimizer with less state"));
}

int64_t PipelineEngine::Impl::HostStateToMake(const std::vector<HyperParams>& hypers) const {
  int64_t bytes = 0;
  for (const Device& d : devices_) {
    if (!d.local || !d.optimizer || d.host.empty()) continue;
    int per_element = 0;
    for (const HyperParams& h : hypers) {
      per_element = std::max(per_element, StateTensorsPerElement(d.optimizer->kind(), h));
    }
    int64_t stepped = 0;
    for (int li : stages_[d.stage].params) {
      const at::Tensor& master = d.host[li];
      if (master.defined() && master.grad().defined()) stepped += master.nbytes();
    }
    const int64_t held = d.optimizer->StateBytes() - KeptStateBytes(d);  // host state
    bytes += std::max<int64_t>(0, per_element * stepped - held);
  }
  return bytes;
}

int64_t PipelineEngine::Impl::HostCopiesToMake() const {
  int64_t bytes = 0;
  for (const Device& d : devices_) {
    if (!d.local || d.host_low.empty()) continue;
    for (size_t li = 0; li < d.host_low.size(); ++li) {
      if (!d.Low(static_cast<int>(li)) || d.host_low[li].defined()) continue;
      bytes += d.host[li].numel() * static_cast<int64_t>(c10::elementSize(d.low_dtype[li]));
    }
  }
  return bytes;
}

at::Tensor PipelineEngine::Impl::HostMaster(int lifted) const {
  if (!offload_ || owner_[lifted] < 0) return at::Tensor();
  const Device& d = devices_[owner_[lifted]];
  return d.host.empty() ? at::Tensor() : d.host[lifted];
}

void PipelineEngine::Impl::SetUpOffload(Device& d) {
  // Init left the stage's parameters in host memory; on a CUDA device they are pinned (Init
  // copied them into page-locked memory), so that uploads are DMA copies.
  d.host.assign(d.lifted.size(), at::Tensor());
  for (int li : stages_[d.stage].params) {
    if (d.kept.count(li)) continue;  // on the device already, for good
    d.host[li] = d.lifted[li];
    if (d.place.is_cuda() && !d.host[li].is_pinned()) {
      d.host[li] = d.host[li].detach().pin_memory().requires_grad_(d.lifted[li].requires_grad());
    }
    d.lifted[li] = at::empty({0}, d.On(d.host[li].scalar_type())).requires_grad_(true);
  }
  d.resident = false;
}

absl::Status PipelineEngine::Impl::Upload(Device& d) {
  if (d.resident) return absl::OkStatus();
  at::NoGradGuard no_grad;
  for (int li : stages_[d.stage].params) {
    // A streamed parameter comes with its block (Fetch).
    if (!d.host[li].defined() || d.Streamed(li)) continue;
    const at::Tensor& master = d.host[li];
    SwapStorage(d.lifted[li], master.detach().to(d.place, master.scalar_type(),
                                                 /*non_blocking=*/false, /*copy=*/true));
  }
  const int64_t R = static_cast<int64_t>(stages_[d.stage].devices.size());
  for (ZeroPartition& part : d.zero) {
    part.flat = at::empty({part.len * R}, d.On(part.shard.scalar_type()));
    const at::Tensor shard = d.Here(part.shard.detach());
    absl::StatusOr<comm::Buffer> mine = BufferOf(shard);
    if (!mine.ok()) return mine.status();
    absl::StatusOr<comm::Buffer> all = BufferOf(part.flat);
    if (!all.ok()) return all.status();
    absl::Status s = Wait(d, d.replicas->AllGather(*mine, *all), part.flat,
                          "all-gathering offloaded ZeRO parameters");
    if (!s.ok()) return s;
    for (size_t i = 0; i < part.params.size(); ++i) {
      const std::vector<int64_t>& shape = lifted_shapes_[part.params[i]];
      int64_t numel = 1;
      for (int64_t n : shape) numel *= n;
      SwapStorage(d.lifted[part.params[i]], part.flat.narrow(0, part.offsets[i], numel).view(shape));
    }
  }
  d.resident = true;
  for (GradReducer* r : {d.reducer.get(), d.zero_reducer.get()}) {
    if (r == nullptr) continue;
    absl::Status s = r->Rebind();
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void PipelineEngine::Impl::Release(Device& d) {
  TakeDownloads(d, /*wait=*/true);
  AwaitHostStepEnd(d);  // a failed forward may not have waited for every block's step
  if (!d.resident) return;
  at::NoGradGuard no_grad;
  for (int li : stages_[d.stage].params) {
    if (d.kept.count(li)) continue;  // on the device for good, with its gradient
    at::Tensor& t = d.lifted[li];
    t.mutable_grad().reset();
    if (!d.Streamed(li)) SwapStorage(t, at::empty({0}, t.options()));
  }
  for (size_t k = 0; k < d.streamed.size(); ++k) Evict(d, static_cast<int>(k));
  for (ZeroPartition& part : d.zero) part.flat.reset();
  // The masters may change before the device is resident again (an optimizer step).
  std::fill(d.low_fresh.begin(), d.low_fresh.end(), 0);
  d.resident = false;
}

absl::Status PipelineEngine::Impl::ReduceOffloaded(Device& d, bool keep_resident) {
  absl::Status s = Upload(d);
  if (s.ok()) {
    at::NoGradGuard no_grad;
    const std::vector<int>& params = stages_[d.stage].params;
    for (int li : params) {
      // A streamed parameter's stage has one replica: its gradient stays on the host.
      if (d.host[li].defined() && d.host[li].grad().defined() && !d.Streamed(li)) {
        const at::Tensor& g = d.host[li].grad();
        d.lifted[li].mutable_grad() =
            g.detach().to(d.place, g.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
    // Nothing runs a backward: Finish takes every gradient as it stands.
    if (d.reducer) d.reducer->BeginFinalBackward();
    s = ReduceGrads(d);
    for (int li : params) {
      if (!d.host[li].defined()) continue;
      if (s.ok() && d.lifted[li].grad().defined()) {
        d.host[li].mutable_grad() = ToHost(d.lifted[li].grad());
      } else if (s.ok() && d.Streamed(li) && !d.host[li].grad().defined()) {
        d.host[li].mutable_grad() = d.streamed_grads[li];  // ReduceGrads' zeros
      }
      d.lifted[li].mutable_grad().reset();
    }
    d.streamed_grads.clear();
  }
  if (!keep_resident || !s.ok()) Release(d);
  return s;
}

at::Tensor PipelineEngine::Impl::ToHost(const at::Tensor& t) {
  return t.device().is_cpu() ? t : t.to(at::kCPU);
}

at::Tensor PipelineEngine::Impl::HostCopy(const at::Tensor& t) {
  if (t.device().is_cpu()) return t.clone();
  // Into page-locked memory: the copy runs at the link's speed (pageable memory goes through a
  // bounce buffer and is faulted in page by page, ~1 GB/s), and LibTorch's caching host
  // allocator hands the same pages out again at the next read of the model (a checkpoint every
  // few steps), so they are pinned once.
  at::Tensor host = PinnedLike(t);
  if (!host.defined()) return t.to(at::kCPU);  // no page-locked memory to be had: pageable
  host.copy_(t);
  return host;
}

at::Tensor PipelineEngine::Impl::HostBuffer(const Device& d, const at::Tensor& t,
                                            at::ScalarType dtype) {
  at::Tensor buffer = d.place.is_cuda() ? PinnedExact(t, dtype) : at::Tensor();
  return buffer.defined() ? buffer
                          : at::empty(t.sizes(), t.options().device(at::kCPU).dtype(dtype));
}

at::Tensor PipelineEngine::Impl::PinnedExact(const at::Tensor& t,
                                             std::optional<at::ScalarType> dtype) {
  const at::ScalarType type = dtype.value_or(t.scalar_type());
  if (host_pool_ && t.numel() * static_cast<int64_t>(c10::elementSize(type)) >=
                        kExactPinnedBytes) {
    at::Tensor exact = host_pool_->Empty(t.sizes(), type);
    if (exact.defined()) return exact;
  }
  return PinnedLike(t, type);
}

void PipelineEngine::Impl::CloseHostPool() {
  if (!host_pool_) return;
  for (Device& d : devices_) {
    if (!d.local || !d.place.is_cuda()) continue;
    try {
      const c10::impl::VirtualGuardImpl impl(d.place.type());
      impl.getStream(d.place).synchronize();
      if (d.upload_stream) d.upload_stream->synchronize();
      if (d.download_stream) d.download_stream->synchronize();
    } catch (const c10::Error& e) {
      spdlog::warn("engine {}: device {} could not finish its copies: {}", id_, d.index,
                   e.what_without_backtrace());
    }
  }
  host_pool_->Close();
}

at::Tensor PipelineEngine::Impl::PinnedLike(const at::Tensor& t,
                                            std::optional<at::ScalarType> dtype) {
  try {
    return at::empty(t.sizes(), t.options()
                                    .device(at::kCPU)
                                    .dtype(dtype.value_or(t.scalar_type()))
                                    .pinned_memory(true));
  } catch (const c10::Error&) {
    return at::Tensor();
  }
}

}  // namespace rannc
