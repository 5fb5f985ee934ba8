#include "daemon/planner/links.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/common/elapsed.h"

namespace rannc {
namespace planner {
namespace {

using Clock = std::chrono::steady_clock;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spinning keeps a handoff in the sub-microsecond range when both threads have a core. A few
// microseconds without progress mean the other thread is not running (more threads than cores
// is the normal case for virtual devices, and the host may be busy), so the core is given away
// instead of burning the rest of the timeslice. Bounded by time, not iterations: the cost of a
// pause instruction differs tenfold between CPU generations.
constexpr std::chrono::microseconds kMaxSpin(5);

template <typename Ready>
bool SpinBriefly(Ready ready) {
  const Clock::time_point start = Clock::now();
  for (int i = 1;; ++i) {
    if (ready()) return true;
    CpuRelax();
    if (i % 32 == 0 && Clock::now() - start > kMaxSpin) return false;
  }
}

template <typename Ready>
void SpinThenYield(Ready ready) {
  if (SpinBriefly(ready)) return;
  while (!ready()) std::this_thread::yield();
}

// Reusable barrier for a fixed number of threads (std::barrier is C++20). Spins briefly, then
// sleeps: the all-reduce runs k threads on however many cores there are, and a pure spin
// barrier would make each step wait for a full scheduler timeslice.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}

  void Wait() {
    const uint64_t generation = generation_.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++waiting_ == count_) {
        waiting_ = 0;
        generation_.store(generation + 1, std::memory_order_release);
        cv_.notify_all();
        return;
      }
    }
    if (SpinBriefly([&] { return generation_.load(std::memory_order_acquire) != generation; })) {
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != generation; });
  }

 private:
  const int count_;
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0;  // guarded by mu_
  std::atomic<uint64_t> generation_{0};
};

// Runs fn(0..k-1) on k threads, one per device, and joins them. The threads start only once
// all exist, so a failed thread creation cannot leave the others blocked in a Barrier.
absl::Status RunOnDeviceThreads(int k, const std::function<void(int)>& fn) {
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  bool abort = false;
  std::vector<std::thread> threads;
  threads.reserve(k);
  auto release = [&](bool aborting) {
    {
      std::lock_guard<std::mutex> lock(mu);
      go = true;
      abort = aborting;
    }
    cv.notify_all();
    for (std::thread& t : threads) t.join();
  };
  for (int r = 0; r < k; ++r) {
    try {
      threads.emplace_back([&, r] {
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return go; });
          if (abort) return;
        }
        fn(r);
      });
    } catch (const std::system_error& e) {
      release(/*aborting=*/true);
      return absl::ResourceExhaustedError(absl::StrCat(
          "link probe: cannot start the thread of device ", r, " of ", k, ": ", e.what()));
    }
  }
  release(/*aborting=*/false);
  return absl::OkStatus();
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char[], FreeDeleter>;

// One buffer per device, each first touched by a thread of its own: page faults are paid here,
// not inside a timed copy, and on a NUMA host first touch places each buffer near its device.
absl::StatusOr<std::vector<Buffer>> AllocateDeviceBuffers(const std::vector<uint64_t>& sizes) {
  constexpr size_t kAlign = 4096;
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t rounded = (sizes[i] + kAlign - 1) / kAlign * kAlign;
    buffers.emplace_back(static_cast<char*>(std::aligned_alloc(kAlign, rounded)));
    if (buffers.back() == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("link probe: cannot allocate %d bytes for device %d; lower "
                          "LinkProbeOptions::p2p_bytes or allreduce_bytes",
                          sizes[i], i));
    }
  }
  absl::Status started = RunOnDeviceThreads(static_cast<int>(sizes.size()), [&](int r) {
    std::memset(buffers[r].get(), 0, sizes[r]);
  });
  if (!started.ok()) return started;
  return buffers;
}

// Best time of copying `bytes` from src to dst, on a thread of its own like a device's.
absl::StatusOr<double> BestCopySeconds(const char* src, char* dst, uint64_t bytes, int repeats) {
  double best = std::numeric_limits<double>::infinity();
  absl::Status status = RunOnDeviceThreads(1, [&](int) {
    for (int i = 0; i < repeats; ++i) {
      const Clock::time_point start = Clock::now();
      std::memcpy(dst, src, bytes);
      best = std::min(best, SecondsSince(start));
    }
  });
  if (!status.ok()) return status;
  return best;
}

// One-way latency of handing `bytes` from one device thread to another: device 0 copies into
// device 1's buffer and raises a flag, device 1 copies back and lowers it; half the round trip,
// averaged over a batch, fastest batch of `repeats` (batches are cheap, so MeasureCpuLinks asks
// for at least 5: one batch rarely has both threads on a core throughout).
absl::StatusOr<double> BestHandoffSeconds(char* a, char* b, uint64_t bytes, int repeats) {
  constexpr int kRoundTrips = 256;
  std::atomic<int> turn{0};
  double best = std::numeric_limits<double>::infinity();
  absl::Status status = RunOnDeviceThreads(2, [&](int r) {
    for (int rep = 0; rep < repeats; ++rep) {
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < kRoundTrips; ++i) {
        if (r == 0) {
          std::memcpy(b, a, bytes);
          turn.store(1, std::memory_order_release);
          SpinThenYield([&] { return turn.load(std::memory_order_acquire) == 0; });
        } else {
          SpinThenYield([&] { return turn.load(std::memory_order_acquire) == 1; });
          std::memcpy(a, b, bytes);
          turn.store(0, std::memory_order_release);
        }
      }
      if (r == 0) best = std::min(best, SecondsSince(start) / kRoundTrips / 2);
    }
  });
  if (!status.ok()) return status;
  return best;
}

// Device r's input: small integers, so every partial sum is exact in float32 and the result can
// be compared with ==.
inline float InputValue(int r, size_t j) { return static_cast<float>(r + 1 + j % 7); }
inline float ReducedValue(int k, size_t j) {
  return static_cast<float>(k * (k + 1) / 2 + k * static_cast<int>(j % 7));
}

// Ring all-reduce (sum) of the first n floats of bufs[0..k-1], in place: k-1 reduce-scatter
// steps, then k-1 all-gather steps, a barrier after each. The address space is shared, so a
// device reads its ring predecessor's chunk directly instead of receiving a copy. Returns the
// fastest of `repeats` runs; the first run's result is checked element by element.
absl::StatusOr<double> BestRingAllReduceSeconds(const std::vector<float*>& bufs, size_t n,
                                                int repeats) {
  const int k = static_cast<int>(bufs.size());
  auto chunk_begin = [&](int c) { return n * c / k; };
  Barrier barrier(k);
  double best = std::numeric_limits<double>::infinity();
  std::mutex error_mu;
  std::string error;  // the first wrong element seen, guarded by error_mu

  absl::Status status = RunOnDeviceThreads(k, [&](int r) {
    float* const mine = bufs[r];
    const float* const prev = bufs[(r + k - 1) % k];
    for (int rep = 0; rep < repeats; ++rep) {
      // Refilled every run so sums stay small and exact; untimed.
      for (size_t j = 0; j < n; ++j) mine[j] = InputValue(r, j);
      barrier.Wait();
      const Clock::time_point start = Clock::now();
      for (int s = 0; s < k - 1; ++s) {
        // Step s: the predecessor's chunk (r-1-s) holds s+1 contributions; add ours.
        const int c = ((r - 1 - s) % k + k) % k;
        float* __restrict dst = mine + chunk_begin(c);
        const float* __restrict src = prev + chunk_begin(c);
        const size_t len = chunk_begin(c + 1) - chunk_begin(c);
        for (size_t j = 0; j < len; ++j) dst[j] += src[j];
        barrier.Wait();
      }
      // Device r now owns the finished chunk (r+1); pass finished chunks around the ring.
      for (int s = 0; s < k - 1; ++s) {
        const int c = ((r - s) % k + k) % k;
        std::memcpy(mine + chunk_begin(c), prev + chunk_begin(c),
                    (chunk_begin(c + 1) - chunk_begin(c)) * sizeof(float));
        barrier.Wait();
      }
      if (r == 0) best = std::min(best, SecondsSince(start));
      if (rep == 0) {
        for (size_t j = 0; j < n; ++j) {
          if (mine[j] != ReducedValue(k, j)) {
            std::lock_guard<std::mutex> lock(error_mu);
            if (error.empty()) {
              error = absl::StrFormat(
                  "link probe: ring all-reduce over %d devices is wrong: device %d element %d "
                  "of %d is %g, expected %g; the planner's all-reduce costs would be meaningless",
                  k, r, j, n, mine[j], ReducedValue(k, j));
            }
            break;
          }
        }
      }
    }
  });
  if (!status.ok()) return status;
  if (!error.empty()) return absl::InternalError(error);
  return best;
}

// The k other than 2 and num_devices in the order they are worth measuring: powers of two first
// (the usual data-parallel degrees), then the rest.
std::vector<int> OptionalDeviceCounts(int num_devices) {
  std::vector<int> counts;
  for (int k = 4; k < num_devices; k *= 2) counts.push_back(k);
  for (int k = 3; k < num_devices; ++k) {
    if ((k & (k - 1)) != 0) counts.push_back(k);
  }
  return counts;
}

absl::Status CheckOptions(const LinkProbeOptions& o) {
  if (o.num_devices < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: num_devices is ", o.num_devices, "; need at least 1"));
  }
  if (o.p2p_bytes == 0) {
    return absl::InvalidArgumentError("link probe: p2p_bytes is 0; need a positive size");
  }
  if (o.num_devices >= 2 && o.allreduce_bytes / sizeof(float) < static_cast<uint64_t>(
                                                                     o.num_devices)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "link probe: allreduce_bytes is ", o.allreduce_bytes, "; need at least ",
        sizeof(float) * o.num_devices, " (one float32 per device) for ", o.num_devices,
        " devices"));
  }
  if (o.repeats < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: repeats is ", o.repeats, "; need at least 1"));
  }
  if (!(o.time_budget_s >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: time_budget_s is ", o.time_budget_s, "; need >= 0"));
  }
  return absl::OkStatus();
}

// ---- Text form ----

struct Unit {
  absl::string_view suffix;
  int exp10;   // value = number * 10^exp10 * 1024^exp1024
  int exp1024;
};

// Longer suffixes first: every suffix ends like the last one.
constexpr Unit kBandwidthUnits[] = {
    {"TiB/s", 0, 4}, {"GiB/s", 0, 3}, {"MiB/s", 0, 2}, {"KiB/s", 0, 1}, {"TB/s", 12, 0},
    {"GB/s", 9, 0},  {"MB/s", 6, 0},  {"KB/s", 3, 0},  {"kB/s", 3, 0},  {"B/s", 0, 0},
};
constexpr Unit kTimeUnits[] = {{"ns", -9, 0}, {"us", -6, 0}, {"ms", -3, 0}, {"s", 0, 0}};

// number * 10^exp10, correctly rounded like the literal "<number>e<exp10>" would be, so that
// "5.2GB/s" is exactly 5.2e9 and LinksToString can find a short exact form.
bool ParseScaled(absl::string_view number, int exp10, double* out) {
  if (number.empty()) return false;
  const bool plain = number.find_first_not_of("0123456789.+-") == absl::string_view::npos;
  if (plain) return absl::SimpleAtod(absl::StrCat(number, "e", exp10), out);
  if (!absl::SimpleAtod(number, out)) return false;
  *out *= std::pow(10.0, exp10);
  return true;
}

template <size_t N>
bool ParseQuantity(absl::string_view text, const Unit (&units)[N], double* out) {
  for (const Unit& unit : units) {
    if (!absl::EndsWith(text, unit.suffix)) continue;
    absl::string_view number =
        absl::StripTrailingAsciiWhitespace(text.substr(0, text.size() - unit.suffix.size()));
    if (!ParseScaled(number, unit.exp10, out)) return false;
    for (int i = 0; i < unit.exp1024; ++i) *out *= 1024;
    return std::isfinite(*out);
  }
  return false;
}

absl::Status BadToken(absl::string_view token, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("links: bad field \"", token, "\": ", why));
}

absl::StatusOr<double> ParseBandwidth(absl::string_view token, absl::string_view value) {
  double v;
  if (!ParseQuantity(value, kBandwidthUnits, &v)) {
    return BadToken(token, "expected a bandwidth such as 10GB/s (units B/s, KB/s, MB/s, GB/s, "
                           "TB/s, KiB/s, MiB/s, GiB/s, TiB/s)");
  }
  if (!(v > 0)) return BadToken(token, "bandwidth must be positive");
  return v;
}

absl::StatusOr<double> ParseLatency(absl::string_view token, absl::string_view value) {
  double v;
  if (!ParseQuantity(value, kTimeUnits, &v)) {
    return BadToken(token, "expected a time such as 10us (units s, ms, us, ns)");
  }
  if (!(v >= 0)) return BadToken(token, "latency must be >= 0");
  return v;
}

// `value` / 10^exp10 in plain decimal notation, with the fewest significant digits that parse
// back (by ParseScaled) to exactly `value`. A double is a finite decimal, so scaling by a power
// of ten is only a shift of its decimal point: done on the digits, not by a rounding division.
std::string FormatExact(double value, int exp10) {
  if (value == 0 || !std::isfinite(value)) return absl::StrFormat("%g", value);
  std::string sci;
  for (int precision = 1; precision <= 17; ++precision) {
    sci = absl::StrFormat("%.*e", precision - 1, value);
    double back;
    if (absl::SimpleAtod(sci, &back) && back == value) break;
  }
  // sci is "[-]d.ddde[+-]xx": value = digits * 10^(x - (digits.size() - 1)).
  const size_t e = sci.find('e');
  std::string sign = sci[0] == '-' ? "-" : "";
  std::string digits;
  for (char c : sci.substr(sign.size(), e - sign.size())) {
    if (c != '.') digits.push_back(c);
  }
  int x = 0;
  absl::SimpleAtoi(sci.substr(e + 1), &x);
  const int shift = x - static_cast<int>(digits.size() - 1) - exp10;  // digits * 10^shift
  if (shift >= 0) return sign + digits + std::string(shift, '0');
  const int point = static_cast<int>(digits.size()) + shift;  // digits before the point
  if (point > 0) return absl::StrCat(sign, digits.substr(0, point), ".", digits.substr(point));
  return absl::StrCat(sign, "0.", std::string(-point, '0'), digits);
}

std::string FormatBandwidth(double v) { return FormatExact(v, 9) + "GB/s"; }
std::string FormatLatency(double v) { return FormatExact(v, -6) + "us"; }

}  // namespace

absl::StatusOr<Links> MeasureCpuLinks(const LinkProbeOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  const Clock::time_point start = Clock::now();
  const int n = options.num_devices;
  const uint64_t floats = n >= 2 ? options.allreduce_bytes / sizeof(float) : 0;
  const uint64_t allreduce_bytes = floats * sizeof(float);
  constexpr uint64_t kHandoffBytes = 4096;

  // Devices 0 and 1 also serve the p2p measurements, so they hold the larger of both sizes.
  std::vector<uint64_t> sizes(std::max(n, 2), allreduce_bytes);
  for (int i = 0; i < 2; ++i) {
    sizes[i] = std::max({options.p2p_bytes, allreduce_bytes, kHandoffBytes});
  }
  absl::StatusOr<std::vector<Buffer>> buffers = AllocateDeviceBuffers(sizes);
  if (!buffers.ok()) return buffers.status();
  std::vector<float*> floats_of(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    floats_of[i] = reinterpret_cast<float*>((*buffers)[i].get());
  }

  Links links;
  absl::StatusOr<double> copy_s = BestCopySeconds((*buffers)[0].get(), (*buffers)[1].get(),
                                                  options.p2p_bytes, options.repeats);
  if (!copy_s.ok()) return copy_s.status();
  links.p2p_bytes_per_s = options.p2p_bytes / *copy_s;
  absl::StatusOr<double> handoff_s = BestHandoffSeconds(
      (*buffers)[0].get(), (*buffers)[1].get(), kHandoffBytes, std::max(options.repeats, 5));
  if (!handoff_s.ok()) return handoff_s.status();
  links.p2p_latency_s = *handoff_s;
  if (n < 2) return links;

  // Returns the wall time of measuring k, setup and checks included, for the budget estimate.
  auto measure = [&](int k) -> absl::StatusOr<double> {
    const Clock::time_point k_start = Clock::now();
    std::vector<float*> bufs(floats_of.begin(), floats_of.begin() + k);
    absl::StatusOr<double> s = BestRingAllReduceSeconds(bufs, floats, options.repeats);
    if (!s.ok()) return s.status();
    links.allreduce_bytes_per_s[k] = allreduce_bytes / *s;
    return SecondsSince(k_start);
  };
  absl::StatusOr<double> wall_2 = measure(2);
  if (!wall_2.ok()) return wall_2.status();
  absl::StatusOr<double> wall_n = wall_2;
  if (n > 2) {
    wall_n = measure(n);
    if (!wall_n.ok()) return wall_n.status();
  }

  // Latency: a tiny all-reduce over every device is nearly all barrier handoffs. (Devices 2..n-1
  // have only `floats` elements.)
  const size_t tiny = std::min<size_t>(std::max<size_t>(kHandoffBytes / sizeof(float), n), floats);
  absl::StatusOr<double> tiny_s = BestRingAllReduceSeconds(
      std::vector<float*>(floats_of.begin(), floats_of.begin() + n), tiny,
      std::max(options.repeats, 5));
  if (!tiny_s.ok()) return tiny_s.status();
  links.allreduce_latency_s = *tiny_s;

  for (int k : OptionalDeviceCounts(n)) {
    // Time grows about linearly in k: k threads share the cores and move k buffers.
    const double estimate = *wall_2 + (*wall_n - *wall_2) * (k - 2) / (n - 2);
    if (SecondsSince(start) + estimate > options.time_budget_s) continue;
    absl::StatusOr<double> wall = measure(k);
    if (!wall.ok()) return wall.status();
  }
  return links;
}

std::string DescribeLinks(const Links& links) {
  std::string out = absl::StrFormat("p2p %.3g GB/s (%.3g us), all-reduce",
                                    links.p2p_bytes_per_s / 1e9, links.p2p_latency_s * 1e6);
  if (links.allreduce_bytes_per_s.empty()) absl::StrAppend(&out, " none");
  for (const auto& [k, bw] : links.allreduce_bytes_per_s) {
    absl::StrAppendFormat(&out, " %d:%.3g GB/s", k, bw / 1e9);
  }
  absl::StrAppendFormat(&out, " (%.3g us)", links.allreduce_latency_s * 1e6);
  if (links.host_bytes_per_s > 0) {
    absl::StrAppendFormat(&out, ", host %.3g GB/s", links.host_bytes_per_s / 1e9);
  }
  if (links.host_memory_bytes_per_s > 0) {
    absl::StrAppendFormat(&out, ", host memory %.3g GB/s", links.host_memory_bytes_per_s / 1e9);
  }
  if (links.host_step_bytes_per_s > 0) {
    absl::StrAppendFormat(&out, ", host step %.3g GB/s", links.host_step_bytes_per_s / 1e9);
  }
  return out;
}

std::string LinksToString(const Links& links) {
  std::string out = absl::StrCat("p2p=", FormatBandwidth(links.p2p_bytes_per_s),
                                 ",p2p_latency=", FormatLatency(links.p2p_latency_s));
  if (!links.allreduce_bytes_per_s.empty()) {
    absl::StrAppend(&out, ",allreduce=",
                    absl::StrJoin(links.allreduce_bytes_per_s, ";",
                                  [](std::string* s, const std::pair<const int, double>& e) {
                                    absl::StrAppend(s, e.first, ":", FormatBandwidth(e.second));
                                  }));
  }
  absl::StrAppend(&out, ",allreduce_latency=", FormatLatency(links.allreduce_latency_s));
  if (links.host_bytes_per_s > 0) {
    absl::StrAppend(&out, ",host=", FormatBandwidth(links.host_bytes_per_s));
  }
  if (links.host_memory_bytes_per_s > 0) {
    absl::StrAppend(&out, ",host_memory=", FormatBandwidth(links.host_memory_bytes_per_s));
  }
  if (links.host_step_bytes_per_s > 0) {
    absl::StrAppend(&out, ",host_step=", FormatBandwidth(links.host_step_bytes_per_s));
  }
  return out;
}

absl::StatusOr<Links> LinksFromString(const std::string& text) {
  Links links;
  if (absl::StripAsciiWhitespace(text).empty()) return links;
  std::vector<std::string> seen;
  for (absl::string_view field : absl::StrSplit(text, ',')) {
    field = absl::StripAsciiWhitespace(field);
    const size_t eq = field.find('=');
    if (eq == absl::string_view::npos) {
      return BadToken(field, "expected key=value (keys p2p, p2p_latency, allreduce, "
                             "allreduce_latency, host, host_memory, host_step)");
    }
    const std::string key(absl::StripAsciiWhitespace(field.substr(0, eq)));
    const absl::string_view value = absl::StripAsciiWhitespace(field.substr(eq + 1));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      return BadToken(field, absl::StrCat("\"", key, "\" is given twice"));
    }
    seen.push_back(key);
    if (key == "p2p") {
      absl::StatusOr<double> v = ParseBandwidth(field, value);
      if (!v.ok()) return v.status();
      links.p2p_bytes_per_s = *v;
    } else if (key == "p2p_latency") {
      absl::StatusOr<double> v = ParseLatency(field, value);
      if (!v.ok()) return v.status();
      links.p2p_latency_s = *v;
    } else if (key == "host") {
      absl::StatusOr<double> v = ParseBandwidth(field, value);
      if (!v.ok()) return v.status();
      links.host_bytes_per_s = *v;
    } else if (key == "host_memory") {
      absl::StatusOr<double> v = ParseBandwidth(field, value);
      if (!v.ok()) return v.status();
      links.host_memory_bytes_per_s = *v;
    } else if (key == "host_step") {
      absl::StatusOr<double> v = ParseBandwidth(field, value);
      if (!v.ok()) return v.status();
      links.host_step_bytes_per_s = *v;
    } else if (key == "allreduce_latency") {
      absl::StatusOr<double> v = ParseLatency(field, value);
      if (!v.ok()) return v.status();
      links.allreduce_latency_s = *v;
    } else if (key == "allreduce") {
      for (absl::string_view entry : absl::StrSplit(value, ';')) {
        entry = absl::StripAsciiWhitespace(entry);
        const size_t colon = entry.find(':');
        int k;
        if (colon == absl::string_view::npos ||
            !absl::SimpleAtoi(entry.substr(0, colon), &k)) {
          return BadToken(entry, "expected k:bandwidth such as 4:6GB/s");
        }
        if (k < 2) return BadToken(entry, "an all-reduce needs k >= 2 devices");
        if (links.allreduce_bytes_per_s.count(k) != 0) {
          return BadToken(entry, absl::StrCat("k=", k, " is given twice"));
        }
        absl::StatusOr<double> v =
            ParseBandwidth(entry, absl::StripAsciiWhitespace(entry.substr(colon + 1)));
        if (!v.ok()) return v.status();
        links.allreduce_bytes_per_s[k] = *v;
      }
    } else {
      return BadToken(field, "unknown key; expected p2p, p2p_latency, allreduce, "
                             "allreduce_latency, host, host_memory or host_step");
    }
  }
  return links;
}

}  // namespace planner
}  // namespace rannc
