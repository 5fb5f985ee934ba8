// CopyToDevice on the CPU, where it is the plain per-tensor copy: equal values, .to()'s layout,
// fresh memory, no autograd. device_copy_cuda_test holds the staged copy to the same on a GPU.
#include "daemon/runtime/device_copy.h"

#include <cstring>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

// Same dtype, shape, strides and bytes (NaNs included).
void RequireSameBits(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.defined());
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(got.sizes() == want.sizes());
  CHECK(got.strides() == want.strides());
  const at::Tensor a = got.cpu().contiguous(), b = want.cpu().contiguous();
  CHECK(std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0);
}

TEST_CASE("CopyToDevice on the CPU copies like .to(), into fresh memory", "[device_copy]") {
  const at::Tensor leaf = at::randn({5, 7}).requires_grad_(true);
  const at::Tensor wide = at::randn({6, 10});
  std::vector<at::Tensor> sources = {
      leaf,
      wide.t(),                 // dense, permuted: keeps its strides
      wide.slice(1, 0, 10, 3),  // not dense: becomes contiguous
      at::randint(0, 1 << 20, {33}, at::kLong),
      at::randn({4, 3}).to(at::kHalf),
      at::randn({9}).to(at::kBFloat16),
      at::full({2, 2}, std::nan(""), at::kDouble),
      at::randint(0, 2, {13}).to(at::kBool),
      at::empty({0, 3}),
      at::scalar_tensor(3.5),
      at::Tensor(),  // undefined stays undefined
  };
  absl::StatusOr<std::vector<at::Tensor>> copies = CopyToDevice(sources, at::kCPU);
  INFO(copies.status().ToString());
  REQUIRE(copies.ok());
  REQUIRE(copies->size() == sources.size());
  for (size_t i = 0; i + 1 < sources.size(); ++i) {
    INFO("source " << i);
    const at::Tensor want = sources[i].detach().to(at::kCPU, sources[i].scalar_type(),
                                                   /*non_blocking=*/false, /*copy=*/true);
    const at::Tensor& got = (*copies)[i];
    RequireSameBits(got, want);
    CHECK_FALSE(got.requires_grad());
    if (got.numel() > 0) CHECK(got.data_ptr() != sources[i].data_ptr());
  }
  CHECK_FALSE(copies->back().defined());
  CHECK((*copies)[2].is_contiguous());
  CHECK_FALSE((*copies)[1].is_contiguous());

  // A copy, not a view: writing it leaves the source alone.
  const at::Tensor before = leaf.detach().clone();
  (*copies)[0].fill_(0);
  CHECK(at::equal(leaf.detach(), before));
}

TEST_CASE("CopyToDevice with no tensors returns none", "[device_copy]") {
  absl::StatusOr<std::vector<at::Tensor>> copies = CopyToDevice({}, at::kCPU);
  REQUIRE(copies.ok());
  CHECK(copies->empty());
}

TEST_CASE("CopyToDevice to a CUDA device without CUDA is an error, not an exception",
          "[device_copy]") {
  // A CUDA build on a GPU machine copies instead (device_copy_cuda_test).
  if (at::hasCUDA()) return;
  absl::StatusOr<std::vector<at::Tensor>> copies =
      CopyToDevice({at::ones({4})}, c10::Device(c10::kCUDA, 0));
  REQUIRE_FALSE(copies.ok());
  CHECK(copies.status().code() == absl::StatusCode::kInternal);
  CHECK(copies.status().message().find("copying 1 tensors to cuda:0") != std::string::npos);
}

}  // namespace
}  // namespace rannc
