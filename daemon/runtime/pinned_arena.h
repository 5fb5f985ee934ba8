// Page-locked host memory for the copies a checkpoint reads from CUDA devices, made ready
// before the first checkpoint without holding the GPUs up (issue 21).
//
// benchmarks/pin_bench.py on an H200 (16 GiB): LibTorch's pinned allocation (cudaHostAlloc)
// took 9.2 s and held a device stream up for as long as 4.6 s; memory mapped with huge pages and
// faulted in by 8 host threads took 0.6 s and held nothing; registering that memory
// (cudaHostRegister) took 0.39 s, 1 GiB at a time holding the streams ~25 ms each. So Prepare
// maps and faults the memory in on a thread of its own, then registers it a GiB at a time; a
// checkpoint's reads (PipelineEngine::BeginAsyncReads) take their host tensors from it, and
// LibTorch's pinned allocator serves what does not fit or is not ready.
//
//   auto arena = std::make_shared<PinnedArena>();
//   arena->Prepare(bytes);                 // after the first step: the state's size is known
//   if (arena->Begin()) t = arena->Allocate(shape, dtype);   // undefined: full
//
// The memory is handed out from its start again at the next Begin once every tensor given out
// is gone (a checkpoint's are, once written); tensors keep it alive past the arena.
// Thread-safe.
#ifndef RANNC_DAEMON_RUNTIME_PINNED_ARENA_H_
#define RANNC_DAEMON_RUNTIME_PINNED_ARENA_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

namespace rannc {

class PinnedArena {
 public:
  PinnedArena() = default;
  ~PinnedArena();  // waits for Prepare's thread
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // Starts making `bytes` ready (the first call only). `lock` false: mapped and faulted in,
  // not registered (a build without CUDA; tests).
  void Prepare(size_t bytes, bool lock = true);
  // The bytes prepared so far (mapped and faulted in; registered too with `lock`).
  size_t ready_bytes() const;
  bool prepared() const;

  // Begins a checkpoint's allocations: true when the arena has ready memory and every tensor it
  // gave out before is gone (it starts from the beginning again).
  bool Begin();
  // An uninitialized CPU tensor in ready arena memory (after Begin returned true), within one
  // GiB registration (CUDA refuses a copy whose host range spans two); undefined when there is
  // no room left, or for a tensor over a GiB.
  at::Tensor Allocate(at::IntArrayRef shape, at::ScalarType dtype);

  // The bytes an arena needs to hold tensors of these sizes, allocated in this order (each
  // starts on a page; none spans two registrations; those over a GiB go elsewhere).
  static size_t SpanOf(const std::vector<int64_t>& sizes);

 private:
  // Where a tensor of `bytes` goes when the next free byte is `offset`; its end is the new
  // next free byte. SIZE_MAX: over a GiB.
  static size_t Place(size_t offset, size_t bytes, size_t* end);
  struct Region;
  void Run(size_t bytes, bool lock);

  mutable std::mutex mu_;
  std::shared_ptr<Region> region_;  // set by Prepare
  size_t offset_ = 0;               // next free byte, under mu_
  bool open_ = false;               // Begin returned true, under mu_
  std::thread thread_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PINNED_ARENA_H_
