// CopyToDevice on a GPU: the staged copy gives the bits and layout of a per-tensor .to() for
// tensors smaller and larger than a staging buffer, of every common dtype, from dense, permuted,
// strided, pinned and device sources; and its speed against per-tensor copies (printed).
// Needs a CUDA LibTorch and a GPU (tag gpu; fails, not skips, without).
#include "daemon/runtime/device_copy.h"

#include <chrono>
#include <cstring>
#include <vector>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <catch2/catch.hpp>

namespace rannc {
namespace {

const c10::Device kGpu(c10::kCUDA, 0);

// Random bits in every byte (NaNs and all), except for bool, whose bytes must be 0 or 1.
at::Tensor RandomBits(at::IntArrayRef shape, at::ScalarType dtype) {
  if (dtype == at::kBool) return at::randint(0, 2, shape).to(at::kBool);
  int64_t numel = 1;
  for (int64_t n : shape) numel *= n;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return at::randint(0, 256, {bytes}, at::kByte).view(dtype).view(shape);
}

void RequireSameBits(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.defined());
  REQUIRE(got.device() == kGpu);
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(got.sizes() == want.sizes());
  CHECK(got.strides() == want.strides());
  const at::Tensor a = got.cpu().contiguous(), b = want.cpu().contiguous();
  CHECK(std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0);
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST_CASE("CopyToDevice stages tensors of any size, dtype and layout bit for bit", "[gpu]") {
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(at::hasCUDA());
  // Odd sizes around a 1 MiB + 3 byte buffer: pieces split across buffers at odd offsets,
  // several small tensors in one buffer, the buffers reused many times over.
  const at::Tensor wide = RandomBits({300, 1001}, at::kFloat);
  std::vector<at::Tensor> sources = {
      RandomBits({7}, at::kFloat),
      RandomBits({3, 1 << 19}, at::kFloat),  // 6 MiB
      RandomBits({1000, 1001}, at::kHalf),
      RandomBits({1}, at::kDouble),
      RandomBits({262145}, at::kBFloat16),
      RandomBits({12345}, at::kLong),
      RandomBits({999983}, at::kByte),
      RandomBits({5, 77}, at::kInt),
      RandomBits({4097}, at::kBool),
      wide.t(),                    // dense, permuted: keeps its strides
      wide.slice(1, 1, 1001, 2),   // not dense: comes out contiguous
      RandomBits({}, at::kFloat),  // 0-dim
      at::empty({0, 5}),
      at::Tensor(),
      RandomBits({2, 300001}, at::kFloat).pin_memory(),  // copied without staging
      RandomBits({31, 17}, at::kFloat).to(kGpu),         // already on the GPU
      RandomBits({4, 4}, at::kFloat).requires_grad_(true),
  };
  for (int buffers : {1, 2, 3}) {
    DeviceCopyOptions options;
    options.buffer_bytes = (int64_t{1} << 20) + 3;
    options.buffers = buffers;
    INFO(buffers << " staging buffer(s)");
    absl::StatusOr<std::vector<at::Tensor>> copies = CopyToDevice(sources, kGpu, options);
    INFO(copies.status().ToString());
    REQUIRE(copies.ok());
    REQUIRE(copies->size() == sources.size());
    for (size_t i = 0; i < sources.size(); ++i) {
      INFO("source " << i);
      if (!sources[i].defined()) {
        CHECK_FALSE((*copies)[i].defined());
        continue;
      }
      RequireSameBits((*copies)[i], sources[i].detach().to(kGpu, sources[i].scalar_type(),
                                                           /*non_blocking=*/false,
                                                           /*copy=*/true));
      CHECK_FALSE((*copies)[i].requires_grad());
    }
  }

  // The default buffers, and a device given without an index (the current one).
  absl::StatusOr<std::vector<at::Tensor>> copies = CopyToDevice(sources, c10::Device(c10::kCUDA));
  INFO(copies.status().ToString());
  REQUIRE(copies.ok());
  RequireSameBits((*copies)[1], sources[1].to(kGpu));
  RequireSameBits((*copies)[9], sources[9].to(kGpu));
}

TEST_CASE("CopyToDevice is faster than per-tensor copies from pageable memory", "[gpu]") {
  INFO("this test needs a CUDA build of LibTorch and a GPU");
  REQUIRE(at::hasCUDA());
  // A GPT layer's parameters, hidden size 2048 (fp32, ~201 MB), 12 times: ~2.4 GB, like a
  // sixth of workload A. Filled, so that their pages are in memory, as a job's are.
  const int64_t h = 2048;
  const std::vector<std::vector<int64_t>> layer = {
      {h}, {h}, {3 * h, h}, {3 * h}, {h, h}, {h}, {h}, {h}, {4 * h, h}, {4 * h}, {h, 4 * h}, {h}};
  std::vector<at::Tensor> sources;
  int64_t bytes = 0;
  for (int l = 0; l < 12; ++l) {
    for (const std::vector<int64_t>& shape : layer) {
      sources.push_back(at::randn(shape));
      bytes += sources.back().numel() * 4;
    }
  }
  // Warm up: the CUDA context, the caching allocators, the pinned staging buffers.
  for (int i = 0; i < 2; ++i) {
    REQUIRE(CopyToDevice({sources[2], sources[8]}, kGpu).ok());
    (void)sources[2].to(kGpu);
  }

  auto start = std::chrono::steady_clock::now();
  std::vector<at::Tensor> old_way;
  for (const at::Tensor& t : sources) {
    old_way.push_back(t.to(kGpu, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
  }
  const double old_s = Seconds(start);
  old_way.clear();

  double new_s = 0;
  for (int run = 0; run < 2; ++run) {
    start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<at::Tensor>> copies = CopyToDevice(sources, kGpu);
    new_s = Seconds(start);
    REQUIRE(copies.ok());
    if (run == 1) {
      for (size_t i = 0; i < sources.size(); i += 5) RequireSameBits((*copies)[i], sources[i]);
    }
  }
  WARN(sources.size() << " tensors, " << bytes / 1e9 << " GB: per-tensor .to() "
                      << bytes / 1e9 / old_s << " GB/s, CopyToDevice " << bytes / 1e9 / new_s
                      << " GB/s (" << at::get_num_threads() << " intra-op threads)");
  CHECK(new_s < old_s);
}

}  // namespace
}  // namespace rannc
