// A job's measurements as it trains, for the daemon's Prometheus endpoint (--metrics-listen,
// docs/observability.md) and for ListJobs (`rannc jobs`): both read a Snapshot, so they show the
// same numbers. The job records as its calls end (under its own lock); a reader takes a Snapshot
// at any time without that lock, so a scrape never waits for a step.
//
// An iteration is what happens between two optimizer steps: the training forwards, backwards,
// all-reduces and the step itself. Its wall time (from the previous step's end to this one's) is
// what a training loop sees per step, client time included; its busy time is the part spent in
// the job's calls here, which is what the planner's estimate (planned_step_s) predicts. Its
// bubble is the share of the devices' schedule time spent outside their stages' forwards and
// backwards (waiting for other stages, transfers, bookkeeping): an upper bound of the pipeline's.
//
//   JobMetrics m;
//   m.SetPlan(/*planned_step_s=*/0.12, /*planned_bubble=*/0.2);
//   m.AddForward(/*samples=*/8, /*tokens=*/8 * 512);
//   m.AddBusy(0.05, JobMetrics::Call::kForward);                            // each call
//   m.SetMemory(device_bytes, peak);  m.EndStep(steps, compute_ns, schedule_ns);  // each step
//   JobMetrics::Snapshot s = m.Read();
//
// Thread-safe.
#ifndef RANNC_DAEMON_SERVER_JOB_METRICS_H_
#define RANNC_DAEMON_SERVER_JOB_METRICS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace rannc {

class JobMetrics {
 public:
  using Clock = std::chrono::steady_clock;
  explicit JobMetrics(std::function<Clock::time_point()> now = Clock::now);

  // Upper bounds (seconds) of the step-time histogram's buckets; +Inf follows the last.
  static const std::vector<double>& StepBuckets();

  // The plan's estimates: a step's time and the share of it the stages wait (0..1).
  void SetPlan(double planned_step_s, double planned_bubble);
  // The job's state name (JobStateName) and the optimizer steps it has taken (a job resumed
  // from a checkpoint starts at the checkpoint's step).
  void SetState(const char* state);
  void SetSteps(int64_t steps);
  // The kinds of calls whose busy time is told apart: where an iteration's time goes (the
  // devices' forwards and backwards, the optimizer's step, which runs on the host with
  // offload_params); the rest (all-reduce, clip, zero_grad, state reads) is kOther.
  enum class Call { kForward, kBackward, kStep, kOther };
  static constexpr int kCalls = 4;
  static const char* CallName(Call call);  // "forward", "backward", "step", "other"
  // A call of the job took `seconds` here.
  void AddBusy(double seconds, Call call);
  // A training forward (one with gradients) over `samples` samples holding `tokens` tokens.
  void AddForward(int64_t samples, int64_t tokens);
  // Optimizer step `steps` ended: closes the iteration. `compute_ns` and `schedule_ns` are the
  // engine's counters now (EngineCounters); their growth over the iteration gives its bubble.
  void EndStep(int64_t steps, int64_t compute_ns, int64_t schedule_ns);
  // What the job holds on each of its devices now, and the most it held during a step since it
  // was last deployed (undeployed: zeros).
  void SetMemory(std::vector<int64_t> device_bytes, std::vector<int64_t> peak_device_bytes);
  // A checkpoint held training for `seconds` (copying to host memory, waiting for the previous
  // write).
  void AddCheckpointBlocked(double seconds);

  struct Snapshot {
    std::string state;
    int64_t steps = 0;
    int64_t samples = 0;  // of training forwards, since the job was made here
    int64_t tokens = 0;
    // The histogram of iterations' wall time: per StepBuckets() bound, the iterations that
    // took at most that long (cumulative, as Prometheus has them), then their count and sum.
    std::vector<uint64_t> step_buckets;
    uint64_t step_count = 0;
    double step_sum_s = 0;
    // The last iteration (0 before the second step: the first has no start).
    double step_s = 0;          // wall time
    double busy_s = 0;          // in the job's calls here
    double busy_by_call_s[kCalls] = {};  // busy_s by Call
    double tokens_per_s = 0;    // its tokens over its wall time
    double bubble = 0;          // 1 - compute / schedule over its engine time
    double planned_step_s = 0;
    double planned_bubble = 0;
    std::vector<int64_t> device_bytes;
    std::vector<int64_t> peak_device_bytes;
    double checkpoint_blocked_s = 0;  // in total
    // Filled by the job from elsewhere (Job::Measure): the data plane's bytes
    // (EngineCounters) and the checkpoint writer's totals.
    uint64_t data_plane_bytes = 0;
    uint64_t checkpoints_written = 0;
    uint64_t checkpoints_failed = 0;
    uint64_t checkpoint_bytes = 0;
  };
  Snapshot Read() const;

 private:
  const std::function<Clock::time_point()> now_;
  mutable std::mutex mu_;
  Snapshot s_;
  // The iteration in progress.
  std::optional<Clock::time_point> last_step_end_;
  double busy_s_ = 0;
  double busy_by_call_s_[kCalls] = {};
  int64_t tokens_ = 0;
  int64_t compute_ns_ = 0, schedule_ns_ = 0;  // the engine's counters at the last step
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_JOB_METRICS_H_
