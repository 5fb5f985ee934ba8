#include "daemon/runtime/pinned_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>
#include <c10/util/llvmMathExtras.h>
#include <spdlog/spdlog.h>

#include "daemon/comm/cuda_devices.h"

namespace rannc {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kFaultGrain = uint64_t{16} << 20;  // bytes a thread faults in at a time

}  // namespace

std::shared_ptr<PinnedPool> PinnedPool::Create(bool lock) {
  return std::shared_ptr<PinnedPool>(new PinnedPool(lock));
}

PinnedPool::PinnedPool(bool lock) : lock_(lock) {}

PinnedPool::~PinnedPool() { Close(); }

uint64_t PinnedPool::MappedSize(uint64_t bytes) {
  return std::max<uint64_t>(1, (bytes + kPage - 1) / kPage) * kPage;
}

void* PinnedPool::Map(uint64_t size) {
  void* ptr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    spdlog::warn("page-locked host memory: mapping {:.3f} GB failed ({})", size / 1e9,
                 std::strerror(errno));
    return nullptr;
  }
  if (size >= kHugePage) ::madvise(ptr, size, MADV_HUGEPAGE);  // fewer pages to fault and lock
  // Faulted in by LibTorch's intra-op threads: the registration below (or, without it, the
  // caller's first write) would fault it in page by page on one thread.
  char* base = static_cast<char*>(ptr);
  const int64_t grains = static_cast<int64_t>((size + kFaultGrain - 1) / kFaultGrain);
  at::parallel_for(0, grains, 1, [&](int64_t begin, int64_t end) {
    for (const int64_t g : c10::irange(begin, end)) {
      const uint64_t off = static_cast<uint64_t>(g) * kFaultGrain;
      std::memset(base + off, 0, std::min(kFaultGrain, size - off));
    }
  });
  if (lock_ && !comm::CudaHostRegister(ptr, size)) {
    ::munmap(ptr, size);
    spdlog::warn("page-locked host memory: the driver refused to page-lock {:.3f} GB",
                 size / 1e9);
    return nullptr;
  }
  return ptr;
}

void PinnedPool::Unmap(void* ptr, uint64_t size) {
  if (lock_) comm::CudaHostUnregister(ptr);
  ::munmap(ptr, size);
}

at::Tensor PinnedPool::Empty(at::IntArrayRef shape, at::ScalarType dtype) {
  const uint64_t bytes = c10::multiply_integers(shape) * c10::elementSize(dtype);
  const uint64_t size = MappedSize(bytes);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = cached_.find(size);
    if (it != cached_.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= size;
    }
  }
  const bool mapped = ptr == nullptr;
  if (mapped) {
    ptr = Map(size);  // outside the lock: faulting in and page-locking take a while
    if (ptr == nullptr) return at::Tensor();
  }
  {
    std::lock_guard<std::mutex> guard(mu_);
    if (mapped) stats_.mapped_bytes += size;
    stats_.live_tensors += 1;
    stats_.live_bytes += bytes;
    stats_.live_power_of_two_bytes += c10::llvm::PowerOf2Ceil(bytes);
  }
  std::shared_ptr<PinnedPool> self = shared_from_this();
  return at::from_blob(
      ptr, shape, [self, size, bytes](void* p) { self->Release(p, size, bytes); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void PinnedPool::Release(void* ptr, uint64_t size, uint64_t bytes) {
  bool unmap = false;
  {
    std::lock_guard<std::mutex> guard(mu_);
    stats_.live_tensors -= 1;
    stats_.live_bytes -= bytes;
    stats_.live_power_of_two_bytes -= c10::llvm::PowerOf2Ceil(bytes);
    if (closed_) {
      stats_.mapped_bytes -= size;
      unmap = true;
    } else {
      cached_[size].push_back(ptr);
      stats_.cached_bytes += size;
    }
  }
  if (unmap) Unmap(ptr, size);
}

void PinnedPool::Close() {
  {
    std::lock_guard<std::mutex> guard(mu_);
    closed_ = true;
  }
  Trim();
}

void PinnedPool::Trim() {
  std::map<uint64_t, std::vector<void*>> cached;
  {
    std::lock_guard<std::mutex> guard(mu_);
    cached.swap(cached_);
    stats_.mapped_bytes -= stats_.cached_bytes;
    stats_.cached_bytes = 0;
  }
  for (const auto& [size, ptrs] : cached) {
    for (void* ptr : ptrs) Unmap(ptr, size);
  }
}

PinnedPool::Stats PinnedPool::stats() const {
  std::lock_guard<std::mutex> guard(mu_);
  return stats_;
}

}  // namespace rannc
