#include "daemon/common/host_buffer_pool.h"

#include <cstdlib>
#include <new>

#include <ATen/ATen.h>

namespace rannc {
namespace {

size_t BucketFor(size_t bytes) {
  size_t bucket = HostBufferPool::kMinPooledBytes;
  while (bucket < bytes) bucket <<= 1;
  return bucket;
}

}  // namespace

std::shared_ptr<HostBufferPool> HostBufferPool::Create(size_t max_cached_bytes) {
  return std::shared_ptr<HostBufferPool>(new HostBufferPool(max_cached_bytes));
}

HostBufferPool& HostBufferPool::Default() {
  // Never destroyed: tensors may outlive static destruction order.
  static HostBufferPool* pool = new HostBufferPool(size_t{1} << 30);
  return *pool;
}

HostBufferPool::~HostBufferPool() {
  for (auto& [bucket, buffers] : free_) {
    for (void* b : buffers) std::free(b);
  }
}

at::Tensor HostBufferPool::Allocate(at::IntArrayRef shape, at::ScalarType dtype) {
  const size_t bytes = c10::multiply_integers(shape) * c10::elementSize(dtype);
  if (bytes < kMinPooledBytes) return at::empty(shape, at::TensorOptions().dtype(dtype));
  const size_t bucket = BucketFor(bytes);
  void* buffer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(bucket);
    if (it != free_.end() && !it->second.empty()) {
      buffer = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= bucket;
    }
  }
  if (buffer == nullptr && posix_memalign(&buffer, 64, bucket) != 0) throw std::bad_alloc();
  // The pool outlives its tensors when it is the default one; a pool made by Create is kept
  // alive by its tensors through the shared pointer.
  std::shared_ptr<HostBufferPool> self = weak_from_this().lock();
  HostBufferPool* raw = this;
  return at::from_blob(
      buffer, shape,
      [self, raw, bucket](void* p) { raw->Release(p, bucket); },
      at::TensorOptions().dtype(dtype));
}

void HostBufferPool::Release(void* buffer, size_t bucket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_bytes_ + bucket <= max_cached_bytes_) {
      free_[bucket].push_back(buffer);
      cached_bytes_ += bucket;
      return;
    }
  }
  std::free(buffer);
}

size_t HostBufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

}  // namespace rannc
