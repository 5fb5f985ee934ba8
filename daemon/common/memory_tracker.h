// Counts the bytes LibTorch allocates and frees on a thread. c10's CPU allocator reports every
// allocation and free to the thread's PROFILER_STATE debug info when that info says memory
// profiling is on; install a MemoryTracker there (c10::DebugInfoGuard, or
// c10::ThreadLocalDebugInfo::_push for a thread's lifetime) and it keeps the running total and
// its high-water mark. Memory freed on another thread is reported there, not here.
//
// Thread-safety: the counters are atomics: the installing thread updates them, any thread may
// read them or reset the peak.
#ifndef RANNC_DAEMON_COMMON_MEMORY_TRACKER_H_
#define RANNC_DAEMON_COMMON_MEMORY_TRACKER_H_

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

namespace rannc {

class MemoryTracker final : public c10::MemoryReportingInfoBase {
 public:
#if TORCH_VERSION_MAJOR >= 2
  using Total = size_t;  // LibTorch 2.x reports totals unsigned
#else
  using Total = int64_t;
#endif
  MemoryTracker() = default;
  // Counts only the allocations on `device` (CPU, or one CUDA device, whose caching allocator
  // reports the same way); the others (e.g. host copies on a CUDA device's thread) are ignored.
  explicit MemoryTracker(c10::Device device) : device_(device) {}

  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, Total /*total_allocated*/,
                         Total /*total_reserved*/, c10::Device device) override {
    if (device_.has_value() &&
        (device.type() != device_->type() ||
         (device_->has_index() && device.index() != device_->index()))) {
      return;
    }
    const int64_t now = current_.fetch_add(alloc_size) + alloc_size;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  bool memoryProfilingEnabled() const override { return true; }
  void ResetPeak() { peak_ = current_.load(); }
  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }

 private:
  std::optional<c10::Device> device_;  // none: every device
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_MEMORY_TRACKER_H_
