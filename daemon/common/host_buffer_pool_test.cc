#include "daemon/common/host_buffer_pool.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("HostBufferPool hands a released buffer out again", "[pool]") {
  std::shared_ptr<HostBufferPool> pool = HostBufferPool::Create(64 << 20);
  void* first = nullptr;
  {
    at::Tensor t = pool->Allocate({3, 1 << 20}, at::kFloat);  // 12 MiB -> 16 MiB bucket
    t.fill_(2.0);
    CHECK(t.sizes().equals({3, 1 << 20}));
    CHECK(t.sum().item<double>() == Approx(2.0 * 3 * (1 << 20)));
    first = t.data_ptr();
    CHECK(pool->cached_bytes() == 0);
  }
  CHECK(pool->cached_bytes() == 16 << 20);
  at::Tensor again = pool->Allocate({16 << 20}, at::kByte);
  CHECK(again.data_ptr() == first);
  CHECK(pool->cached_bytes() == 0);
}

TEST_CASE("HostBufferPool keeps at most its cap idle, and small tensors bypass it", "[pool]") {
  std::shared_ptr<HostBufferPool> pool = HostBufferPool::Create(4 << 20);
  { at::Tensor big = pool->Allocate({8 << 20}, at::kByte); }
  CHECK(pool->cached_bytes() == 0);  // 8 MiB > 4 MiB cap: freed
  { at::Tensor fits = pool->Allocate({3 << 20}, at::kByte); }
  CHECK(pool->cached_bytes() == 4 << 20);
  { at::Tensor small = pool->Allocate({16}, at::kFloat); }
  CHECK(pool->cached_bytes() == 4 << 20);
}

TEST_CASE("HostBufferPool tensors outlive a pool made by Create", "[pool]") {
  at::Tensor t;
  {
    std::shared_ptr<HostBufferPool> pool = HostBufferPool::Create(64 << 20);
    t = pool->Allocate({2 << 20}, at::kFloat);
  }
  t.fill_(1.0);  // the tensor keeps its pool alive
  CHECK(t[0].item<float>() == 1.0f);
}

}  // namespace
}  // namespace rannc
