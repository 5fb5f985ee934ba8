// Copies of many host tensors onto one device, fast: what placing a job's parameters needs.
//
// A host -> CUDA copy from pageable memory runs one tensor at a time through the driver's own
// small staging buffers (measured at ~1.4 GB/s placing a 5.37 GB model on an H200, where
// pinned memory copies at tens of GB/s). CopyToDevice instead:
//  - allocates every destination on the device up front (on the caller's current stream, so
//    the caching allocator counts them as that stream's, like any tensor made there);
//  - packs the sources' bytes into a few pinned staging buffers, filled by the intra-op thread
//    pool (at::parallel_for): a memcpy out of pageable memory is the slow part, so it runs on
//    many cores, and while one buffer fills, the buffers filled before it are copied to the
//    device asynchronously;
//  - copies each buffer on a side stream of its own, which first waits for the work already
//    queued on the caller's current stream (memory handed out by the caching allocator may
//    still be in use there). Refilling a buffer first synchronizes its stream, so exactly that
//    buffer's copies have finished (LibTorch 1.13's c10::Event cannot be waited on from the
//    host, a stream can);
//  - synchronizes those streams before returning: the results are complete and may be used on
//    any stream, as after a blocking copy.
// A pinned host source is copied directly, without staging. Anything else (a CPU destination,
// a source already on a device) takes the plain per-tensor copy, which is also all a CPU-only
// LibTorch ever does.
//
// Results match `src.detach().to(device, src.scalar_type(), /*non_blocking=*/false,
// /*copy=*/true)` bit for bit, strides included: a source whose elements are dense (contiguous,
// or a permutation of its dims) keeps its strides, any other comes out contiguous. They never
// require grad.
//
// Thread-safety: a free function; calls from several threads at once are safe (each uses its
// own staging buffers and streams). It blocks the calling thread until the copies are done.
#ifndef RANNC_DAEMON_RUNTIME_DEVICE_COPY_H_
#define RANNC_DAEMON_RUNTIME_DEVICE_COPY_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"

namespace rannc {

struct DeviceCopyOptions {
  // Bytes per pinned staging buffer (default 64 MiB); a copy smaller than that stages through
  // one buffer of its own size.
  int64_t buffer_bytes = int64_t{64} << 20;
  // Staging buffers (default 3, at least 1): one filling while the others are copied.
  int buffers = 3;
};

// `sources` copied to `device`, in order (undefined stays undefined). A LibTorch error (CUDA's
// out of memory included) comes back as kInternal, a failed host allocation as
// kResourceExhausted, each naming the copy; no tensors are returned then.
absl::StatusOr<std::vector<at::Tensor>> CopyToDevice(const std::vector<at::Tensor>& sources,
                                                     c10::Device device,
                                                     const DeviceCopyOptions& options = {});

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_DEVICE_COPY_H_
