// PinnedArena without CUDA (Prepare's `lock` false: mapped and faulted in, not page-locked):
// tensors come from its memory until it is full, and it starts over only once every tensor it
// gave out is gone.
#include "daemon/runtime/pinned_arena.h"

#include <chrono>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

// Faulting a GiB in takes a second or two; under TSan (RANNC_SANITIZER, set by .bazelrc's
// sanitizer configs) a minute, its shadow memory faulted in with it.
bool WaitReady(const PinnedArena& arena, size_t bytes) {
  const auto limit = std::chrono::seconds(std::getenv("RANNC_SANITIZER") ? 300 : 30);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (arena.ready_bytes() < bytes) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST_CASE("PinnedArena hands out its memory, then starts over once its tensors are gone",
          "[runtime]") {
  PinnedArena arena;
  CHECK_FALSE(arena.prepared());
  CHECK_FALSE(arena.Begin());  // nothing ready: the caller's own allocator serves
  arena.Prepare(3 << 20, /*lock=*/false);  // rounded up to a GiB
  CHECK(arena.prepared());
  REQUIRE(WaitReady(arena, size_t{1} << 30));
  CHECK(arena.ready_bytes() == size_t{1} << 30);

  REQUIRE(arena.Begin());
  at::Tensor a = arena.Allocate({256, 1024}, at::kFloat);  // 1 MiB
  at::Tensor b = arena.Allocate({3}, at::kDouble);
  REQUIRE(a.defined());
  REQUIRE(b.defined());
  CHECK(a.sizes() == at::IntArrayRef({256, 1024}));
  CHECK(b.scalar_type() == at::kDouble);
  CHECK(a.device().is_cpu());
  a.fill_(2.0f);
  b.fill_(3.0);
  CHECK(a.sum().item<float>() == 2.0f * 256 * 1024);
  CHECK(b.sum().item<double>() == 9.0);
  // Page-aligned, one after the other.
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  CHECK(pa % 4096 == 0);
  CHECK(pb == pa + (1 << 20));
  // Over a GiB (one registration), or no room left: undefined, for the caller to allocate
  // elsewhere.
  CHECK_FALSE(arena.Allocate({int64_t{1} << 30}, at::kFloat).defined());
  CHECK_FALSE(arena.Allocate({int64_t{1} << 28}, at::kFloat).defined());  // 1 GiB - what is used

  // A tensor still alive: the next checkpoint cannot reuse the memory.
  at::Tensor view = a.view({-1});
  a = at::Tensor();
  b = at::Tensor();
  CHECK_FALSE(arena.Begin());
  CHECK_FALSE(arena.Allocate({1}, at::kFloat).defined());
  view = at::Tensor();
  REQUIRE(arena.Begin());
  at::Tensor again = arena.Allocate({4}, at::kFloat);
  REQUIRE(again.defined());
  CHECK(reinterpret_cast<uintptr_t>(again.data_ptr()) == pa);

  // SpanOf: the room these allocations took, and what a checkpoint's sizes need.
  again = at::Tensor();
  REQUIRE(arena.Begin());
  at::Tensor x = arena.Allocate({256, 1024}, at::kFloat);
  at::Tensor y = arena.Allocate({3}, at::kDouble);
  at::Tensor z = arena.Allocate({25, 1024, 1024}, at::kFloat);
  REQUIRE(z.defined());
  const size_t used = reinterpret_cast<uintptr_t>(z.data_ptr()) + z.nbytes() -
                      reinterpret_cast<uintptr_t>(x.data_ptr());
  CHECK(PinnedArena::SpanOf({1 << 20, 24, 100 << 20}) == used);
  CHECK(used == (1 << 20) + 4096 + (100 << 20));
  // A tensor that would span two GiB registrations starts the next; one over a GiB is left to
  // another allocator.
  const int64_t mib = 1 << 20;
  CHECK(PinnedArena::SpanOf({768 * mib, 512 * mib}) == size_t{1536} * mib);
  CHECK(PinnedArena::SpanOf({512 * mib, 512 * mib}) == size_t{1024} * mib);
  CHECK(PinnedArena::SpanOf({2048 * mib, 1}) == 4096);
  CHECK(PinnedArena::SpanOf({}) == 0);

  // Tensors outlive their arena.
  auto short_lived = std::make_unique<PinnedArena>();
  short_lived->Prepare(1, /*lock=*/false);
  REQUIRE(WaitReady(*short_lived, 1));
  REQUIRE(short_lived->Begin());
  at::Tensor kept = short_lived->Allocate({8}, at::kFloat);
  kept.fill_(1.5f);
  short_lived.reset();
  CHECK(kept.sum().item<float>() == 12.0f);
}

}  // namespace
}  // namespace rannc
