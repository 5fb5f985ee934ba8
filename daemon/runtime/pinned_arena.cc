#include "daemon/runtime/pinned_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "daemon/comm/cuda_devices.h"

namespace rannc {
namespace {

constexpr size_t kChunk = size_t{1} << 30;   // registered a GiB at a time
constexpr size_t kAlign = 4096;              // each tensor starts on its own page

}  // namespace

struct PinnedArena::Region {
  ~Region() {
    for (size_t off = 0; off < registered_chunks * kChunk && off < size; off += kChunk) {
      comm::CudaHostUnregister(static_cast<char*>(base) + off);
    }
    if (base != nullptr) ::munmap(base, size);
  }
  void* base = nullptr;
  size_t size = 0;
  size_t registered_chunks = 0;         // written by the thread only
  std::atomic<size_t> ready{0};         // bytes ready from base
  std::atomic<int64_t> live{0};         // tensors given out and not yet gone
};

PinnedArena::~PinnedArena() {
  if (thread_.joinable()) thread_.join();
}

void PinnedArena::Prepare(size_t bytes, bool lock) {
  std::lock_guard<std::mutex> guard(mu_);
  if (region_ || bytes == 0) return;
  region_ = std::make_shared<Region>();
  thread_ = std::thread([this, bytes, lock] { Run(bytes, lock); });
}

void PinnedArena::Run(size_t bytes, bool lock) {
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> guard(mu_);
    region = region_;
  }
  const auto start = std::chrono::steady_clock::now();
  const size_t size = (bytes + kChunk - 1) / kChunk * kChunk;
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    spdlog::warn("checkpoint host memory: mapping {:.2f} GB failed ({}); checkpoints page-lock "
                 "their copies as they go", size / 1e9, std::strerror(errno));
    return;
  }
  ::madvise(base, size, MADV_HUGEPAGE);  // fewer pages to fault in and to lock
  {
    std::lock_guard<std::mutex> guard(mu_);
    region->base = base;
    region->size = size;
  }
  // Faulted in by host threads, a GiB each at a time: no CUDA call, so nothing on the devices
  // waits.
  const size_t chunks = size / kChunk;
  const size_t threads = std::min<size_t>(8, std::max<size_t>(1, chunks));
  std::vector<std::thread> faulting;
  std::atomic<size_t> next{0};
  for (size_t t = 0; t < threads; ++t) {
    faulting.emplace_back([&] {
      for (size_t c = next++; c < chunks; c = next++) {
        std::memset(static_cast<char*>(base) + c * kChunk, 0, kChunk);
      }
    });
  }
  for (std::thread& t : faulting) t.join();
  const double faulted_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!lock) {
    region->ready = size;
    return;
  }
  // Registered a GiB at a time: each holds the devices' streams for a moment (~25 ms a GiB on
  // an H200), instead of once for as long as all of it.
  for (size_t c = 0; c < chunks; ++c) {
    if (!comm::CudaHostRegister(static_cast<char*>(base) + c * kChunk, kChunk)) {
      spdlog::warn("checkpoint host memory: page-locking stopped after {:.2f} of {:.2f} GB; "
                   "checkpoints page-lock the rest of their copies as they go",
                   c * kChunk / 1e9, size / 1e9);
      break;
    }
    region->registered_chunks = c + 1;
    region->ready = (c + 1) * kChunk;
  }
  spdlog::info("checkpoint host memory: {:.2f} GB ready in {:.2f} s (faulted in {:.2f} s by {} "
               "threads, then page-locked a GiB at a time)", region->ready.load() / 1e9,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
               faulted_s, threads);
}

size_t PinnedArena::ready_bytes() const {
  std::lock_guard<std::mutex> guard(mu_);
  return region_ ? region_->ready.load() : 0;
}

bool PinnedArena::prepared() const {
  std::lock_guard<std::mutex> guard(mu_);
  return region_ != nullptr;
}

size_t PinnedArena::Place(size_t offset, size_t bytes, size_t* end) {
  const size_t need = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  // Within one registration: a copy whose host range spans two is refused by CUDA ("invalid
  // argument"). Larger tensors go to the caller's allocator.
  if (need > kChunk) return SIZE_MAX;
  if (offset / kChunk != (offset + need - 1) / kChunk) offset = (offset / kChunk + 1) * kChunk;
  *end = offset + need;
  return offset;
}

size_t PinnedArena::SpanOf(const std::vector<int64_t>& sizes) {
  size_t offset = 0;
  for (int64_t bytes : sizes) {
    size_t end = 0;
    if (bytes >= 0 && Place(offset, static_cast<size_t>(bytes), &end) != SIZE_MAX) offset = end;
  }
  return offset;
}

bool PinnedArena::Begin() {
  std::lock_guard<std::mutex> guard(mu_);
  open_ = region_ && region_->ready.load() > 0 && region_->live.load() == 0;
  if (open_) offset_ = 0;
  return open_;
}

at::Tensor PinnedArena::Allocate(at::IntArrayRef shape, at::ScalarType dtype) {
  std::shared_ptr<Region> region;
  char* ptr = nullptr;
  {
    std::lock_guard<std::mutex> guard(mu_);
    if (!open_ || !region_) return at::Tensor();
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    size_t end = 0;
    const size_t at = Place(offset_, static_cast<size_t>(numel) * c10::elementSize(dtype), &end);
    if (at == SIZE_MAX || end > region_->ready.load()) return at::Tensor();
    ptr = static_cast<char*>(region_->base) + at;
    offset_ = end;
    region = region_;
    region->live.fetch_add(1);
  }
  return at::from_blob(
      ptr, shape, [region](void*) { region->live.fetch_sub(1); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace rannc
