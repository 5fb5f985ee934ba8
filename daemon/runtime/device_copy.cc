#include "daemon/runtime/device_copy.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"

namespace rannc {
namespace {

// A memcpy over the intra-op threads. One thread reading pageable memory manages a few GB/s;
// chunks of a few MiB keep small copies on the calling thread.
void ParallelMemcpy(uint8_t* dst, const uint8_t* src, int64_t n) {
  constexpr int64_t kGrain = int64_t{4} << 20;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
  });
}

int64_t NumBytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The bytes of a tensor whose elements are non-overlapping and dense: with PyTorch's
// non-negative strides they fill [data_ptr, data_ptr + NumBytes) in some order of its dims.
// A view on the same storage, so that the copy kernels see the storage's allocation (the
// pinned allocator tracks its blocks' pending copies by it).
at::Tensor Bytes(const at::Tensor& t) {
  return at::empty({0}, t.options().dtype(at::kByte))
      .set_(t.storage(), t.storage_offset() * static_cast<int64_t>(t.element_size()),
            {NumBytes(t)}, {1});
}

// Synchronizes the side streams when the copy ends, by error too: until then they may still
// write the destinations and read the staging buffers.
class SyncOnExit {
 public:
  explicit SyncOnExit(const std::vector<c10::Stream>& streams) : streams_(streams) {}
  ~SyncOnExit() {
    for (const c10::Stream& s : streams_) {
      try {
        s.synchronize();
      } catch (const std::exception&) {
        // The device failed; the error that got us here is the one to report.
      }
    }
  }

 private:
  const std::vector<c10::Stream>& streams_;
};

// The staged copy (see the header) of `sources` to a CUDA device, into `out`.
void StagedCopy(const std::vector<at::Tensor>& sources, c10::Device device,
                const DeviceCopyOptions& options, std::vector<at::Tensor>& out) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::DeviceGuard on_device(device);
  if (!device.has_index()) device = impl.getDevice();

  // Destinations up front, and the dense host sources: pinned ones to copy directly, the others
  // to stage.
  std::vector<at::Tensor> staged(sources.size()), pinned(sources.size());
  int64_t staged_bytes = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!sources[i].defined()) continue;
    at::Tensor src = sources[i].detach();
    if (!src.device().is_cpu()) {
      out[i] = src.to(device, src.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      continue;
    }
    // Like .to(): a dense layout is kept, any other becomes contiguous.
    if (!src.is_non_overlapping_and_dense()) src = src.contiguous();
    out[i] = at::empty_strided(src.sizes(), src.strides(), src.options().device(device));
    if (NumBytes(src) == 0) continue;
    if (src.is_pinned()) {
      pinned[i] = std::move(src);
    } else {
      staged_bytes += NumBytes(src);
      staged[i] = std::move(src);
    }
  }

  const int num_buffers = std::max(options.buffers, 1);
  const int64_t capacity = std::min(std::max<int64_t>(options.buffer_bytes, 1), staged_bytes);
  std::vector<c10::Stream> streams;
  c10::Event queued(device.type());
  queued.record(impl.getStream(device));
  for (int b = 0; b < num_buffers; ++b) {
    streams.push_back(impl.getStreamFromGlobalPool(device));
    queued.block(streams.back());
  }
  const SyncOnExit sync(streams);

  for (size_t i = 0; i < pinned.size(); ++i) {
    if (!pinned[i].defined()) continue;
    const c10::StreamGuard on_stream(streams[0]);
    Bytes(out[i]).copy_(Bytes(pinned[i]), /*non_blocking=*/true);
  }
  if (staged_bytes == 0) return;

  // Pieces of sources filled into the current buffer, copied to the device once it is full.
  struct Piece {
    size_t index;
    int64_t offset, at, bytes;  // source offset, buffer offset, length
  };
  std::vector<at::Tensor> buffers(num_buffers);
  std::vector<Piece> pieces;
  int current = 0;
  int64_t used = 0;
  auto flush = [&] {
    if (pieces.empty()) return;
    const c10::StreamGuard on_stream(streams[current]);
    for (const Piece& p : pieces) {
      Bytes(out[p.index])
          .narrow(0, p.offset, p.bytes)
          .copy_(buffers[current].narrow(0, p.at, p.bytes), /*non_blocking=*/true);
    }
    pieces.clear();
    used = 0;
    current = (current + 1) % num_buffers;
  };
  for (size_t i = 0; i < staged.size(); ++i) {
    if (!staged[i].defined()) continue;
    const uint8_t* src = static_cast<const uint8_t*>(staged[i].data_ptr());
    const int64_t total = NumBytes(staged[i]);
    for (int64_t offset = 0; offset < total;) {
      if (used == capacity) flush();
      if (used == 0) {
        if (buffers[current].defined()) {
          streams[current].synchronize();  // its previous copies have read it
        } else {
          buffers[current] =
              at::empty({capacity}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
        }
      }
      const int64_t n = std::min(total - offset, capacity - used);
      ParallelMemcpy(buffers[current].data_ptr<uint8_t>() + used, src + offset, n);
      pieces.push_back({i, offset, used, n});
      used += n;
      offset += n;
    }
  }
  flush();
}

}  // namespace

absl::StatusOr<std::vector<at::Tensor>> CopyToDevice(const std::vector<at::Tensor>& sources,
                                                     c10::Device device,
                                                     const DeviceCopyOptions& options) {
  std::vector<at::Tensor> out(sources.size());
  absl::Status copied =
      TorchCall(absl::StatusCode::kInternal,
                absl::StrCat("copying ", sources.size(), " tensors to ", device.str()), [&] {
                  if (device.is_cuda()) {
                    StagedCopy(sources, device, options, out);
                    return absl::OkStatus();
                  }
                  // Nothing to stage through: the plain copy.
                  for (size_t i = 0; i < sources.size(); ++i) {
                    if (!sources[i].defined()) continue;
                    out[i] = sources[i].detach().to(device, sources[i].scalar_type(),
                                                    /*non_blocking=*/false, /*copy=*/true);
                  }
                  return absl::OkStatus();
                });
  if (!copied.ok()) return copied;
  return out;
}

}  // namespace rannc
