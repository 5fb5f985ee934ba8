// Page-locked host memory in the sizes asked for, for an offloaded job's host masters and the
// gradients its devices copy back (issue 27).
//
// LibTorch's pinned allocator (its caching host allocator, behind `pinned_memory(true)`) rounds
// every allocation up to the next power of two and page-locks all of it: a 192 MiB tensor (a
// d_model 4096 GPT's qkv weight in fp32) takes 256 MiB of the host, a 75 MiB one (d_model 2560)
// 128 MiB. Over a GPT's parameters that is 8% more host memory for the masters, and as much
// again for their gradients, at d_model 4096 (workload D), 40% at d_model 2560 (workload C)
// and 39% at 5120 (the 13B shape). A PinnedPool maps each tensor by itself, rounded up to a
// page only, faults it in on LibTorch's intra-op threads (transparent huge pages where the
// kernel gives them) and page-locks it (cudaHostRegister). A tensor's memory goes back to the
// pool when its last reference goes, and the next tensor of exactly that many bytes reuses it
// (a step's gradients come back in the same sizes every step); Close unmaps what is cached and
// has every later release unmap at once. (daemon/common/host_buffer_pool.h reuses pageable
// memory for the inputs clients send, in power-of-two buckets: cheap there, as it holds a few
// batches, not the model.)
//
//   std::shared_ptr<PinnedPool> pool = PinnedPool::Create();
//   at::Tensor master = pool->Empty(param.sizes(), at::kFloat);   // undefined: refused
//   master.copy_(param);
//   pool->Close();   // the engine's end: nothing more is cached; live tensors stay valid
//
// LibTorch's allocator also keeps a block from reuse while a copy queued on a stream still
// reads or writes it; this pool does not. A tensor must not be released while such a copy is in
// flight (the engine waits for each copy into or out of the memory before it drops it).
// Thread-safe; tensors keep the pool alive.
#ifndef RANNC_DAEMON_RUNTIME_PINNED_POOL_H_
#define RANNC_DAEMON_RUNTIME_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

namespace rannc {

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  // `lock` false: mapped and faulted in, not page-locked (a build without CUDA; tests).
  static std::shared_ptr<PinnedPool> Create(bool lock = true);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // An uninitialized, contiguous CPU tensor in page-locked memory of its own size rounded up
  // to a page; undefined when the memory cannot be mapped or page-locked (nothing is kept).
  at::Tensor Empty(at::IntArrayRef shape, at::ScalarType dtype);

  // Unmaps the cached memory (what was released and is not needed again in those sizes).
  void Trim();
  // Trim, and from now on a released tensor's memory is unmapped at once.
  void Close();

  struct Stats {
    uint64_t mapped_bytes = 0;  // held now: by live tensors and the cache
    uint64_t cached_bytes = 0;  // released, kept for the next tensor of the same size
    uint64_t live_tensors = 0;
    // Of the live tensors: what they asked for, and what LibTorch's pinned allocator would
    // have taken for them (each rounded up to a power of two).
    uint64_t live_bytes = 0;
    uint64_t live_power_of_two_bytes = 0;
  };
  Stats stats() const;

  // The bytes a mapping of `bytes` takes (a whole number of pages, at least one).
  static uint64_t MappedSize(uint64_t bytes);

 private:
  explicit PinnedPool(bool lock);
  void* Map(uint64_t size);              // faulted in and page-locked; nullptr when refused
  void Unmap(void* ptr, uint64_t size);
  void Release(void* ptr, uint64_t size, uint64_t bytes);

  const bool lock_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<uint64_t, std::vector<void*>> cached_;  // by mapped size
  Stats stats_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PINNED_POOL_H_
