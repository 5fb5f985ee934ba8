// PinnedPool without page-locking (`lock` false; a CPU build has no CUDA to lock with): each
// tensor in memory of its own size rounded to a page, reused by the next tensor of that size
// once released, and unmapped once the pool is closed.
#include "daemon/runtime/pinned_pool.h"

#include <cstdint>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "daemon/comm/cuda_devices.h"

namespace rannc {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST_CASE("PinnedPool maps each tensor in its own size and reuses it once released",
          "[runtime]") {
  std::shared_ptr<PinnedPool> pool = PinnedPool::Create(/*lock=*/false);
  // A d_model 4096 GPT's qkv weight in fp32: 192 MiB, which LibTorch's pinned allocator
  // rounds up to 256.
  at::Tensor qkv = pool->Empty({12288, 4096}, at::kFloat);
  REQUIRE(qkv.defined());
  CHECK(qkv.device().is_cpu());
  CHECK(qkv.is_contiguous());
  CHECK(qkv.sizes() == at::IntArrayRef({12288, 4096}));
  CHECK(reinterpret_cast<uintptr_t>(qkv.data_ptr()) % 4096 == 0);
  PinnedPool::Stats s = pool->stats();
  CHECK(s.mapped_bytes == 192 * kMiB);
  CHECK(s.live_bytes == 192 * kMiB);
  CHECK(s.live_power_of_two_bytes == 256 * kMiB);
  CHECK(s.live_tensors == 1);
  CHECK(s.cached_bytes == 0);

  // An odd size: a page more than it asks, not a power of two.
  at::Tensor bias = pool->Empty({3 * 1000 + 1}, at::kBFloat16);  // 6,002 bytes
  REQUIRE(bias.defined());
  CHECK(PinnedPool::MappedSize(6002) == 8192);
  CHECK(pool->stats().mapped_bytes == 192 * kMiB + 8192);
  CHECK(PinnedPool::MappedSize(0) == 4096);

  // The memory is the tensor's: written and read back whole.
  qkv.fill_(0.5f);
  bias.fill_(2.0);
  CHECK(qkv.sum().item<double>() == 0.5 * 12288 * 4096);
  CHECK(bias.to(at::kFloat).sum().item<double>() == 2.0 * 3001);

  // Released: cached for the next tensor of the same mapped size, shape and dtype aside.
  void* const qkv_memory = qkv.data_ptr();
  qkv = at::Tensor();
  s = pool->stats();
  CHECK(s.cached_bytes == 192 * kMiB);
  CHECK(s.mapped_bytes == 192 * kMiB + 8192);
  CHECK(s.live_tensors == 1);
  at::Tensor other = pool->Empty({4096, 12288}, at::kFloat);
  CHECK(other.data_ptr() == qkv_memory);
  CHECK(pool->stats().cached_bytes == 0);
  at::Tensor bigger = pool->Empty({12288 + 1, 4096}, at::kFloat);  // another size: mapped anew
  CHECK(bigger.data_ptr() != qkv_memory);
  CHECK(pool->stats().mapped_bytes == 2 * 192 * kMiB + 16 * 1024 + 8192);

  // A view keeps the memory as the tensor does.
  at::Tensor row = other[7];
  other = at::Tensor();
  CHECK(pool->stats().cached_bytes == 0);
  row.fill_(1.0f);
  CHECK(row.sum().item<double>() == 12288);
  row = at::Tensor();
  CHECK(pool->stats().cached_bytes == 192 * kMiB);

  // Trimmed: the cache is unmapped, the pool still caches what is released after.
  at::Tensor again = pool->Empty({4096, 12288}, at::kFloat);
  CHECK(again.data_ptr() == qkv_memory);
  at::Tensor spare = pool->Empty({4096, 12288}, at::kFloat);
  spare = at::Tensor();
  CHECK(pool->stats().cached_bytes == 192 * kMiB);
  pool->Trim();
  s = pool->stats();
  CHECK(s.cached_bytes == 0);
  CHECK(s.mapped_bytes == 2 * 192 * kMiB + 16 * 1024 + 8192);
  again = at::Tensor();
  CHECK(pool->stats().cached_bytes == 192 * kMiB);

  // Closed: the cache is unmapped, and what is released from now on too; live tensors stay
  // valid, and the pool lives as long as they do.
  pool->Close();
  s = pool->stats();
  CHECK(s.cached_bytes == 0);
  CHECK(s.mapped_bytes == 192 * kMiB + 16 * 1024 + 8192);
  std::weak_ptr<PinnedPool> weak = pool;
  pool.reset();
  REQUIRE_FALSE(weak.expired());
  bigger.fill_(3.0f);
  CHECK(bigger.max().item<float>() == 3.0f);
  bigger = at::Tensor();
  CHECK(weak.lock()->stats().mapped_bytes == 8192);
  bias = at::Tensor();
  CHECK(weak.expired());
}

TEST_CASE("PinnedPool refuses what it cannot page-lock and keeps nothing of it", "[runtime]") {
  if (comm::CudaDeviceCount() > 0) return;  // a CUDA build on a GPU page-locks: nothing to see
  std::shared_ptr<PinnedPool> pool = PinnedPool::Create(/*lock=*/true);
  CHECK_FALSE(pool->Empty({1024, 1024}, at::kFloat).defined());
  CHECK(pool->stats().mapped_bytes == 0);
  CHECK(pool->stats().live_tensors == 0);
}

}  // namespace
}  // namespace rannc
