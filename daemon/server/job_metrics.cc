#include "daemon/server/job_metrics.h"

#include <algorithm>
#include <utility>

namespace rannc {

JobMetrics::JobMetrics(std::function<Clock::time_point()> now) : now_(std::move(now)) {
  s_.step_buckets.assign(StepBuckets().size(), 0);
}

const std::vector<double>& JobMetrics::StepBuckets() {
  // From a small model's CPU step to a large model's pipeline step.
  static const std::vector<double> buckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                              1,     2.5,  5,     10,   30,  60,   300};
  return buckets;
}

void JobMetrics::SetPlan(double planned_step_s, double planned_bubble) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.planned_step_s = planned_step_s;
  s_.planned_bubble = planned_bubble;
}

void JobMetrics::SetState(const char* state) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.state = state;
}

void JobMetrics::SetSteps(int64_t steps) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.steps = steps;
}

const char* JobMetrics::CallName(Call call) {
  switch (call) {
    case Call::kForward:
      return "forward";
    case Call::kBackward:
      return "backward";
    case Call::kStep:
      return "step";
    case Call::kOther:
      break;
  }
  return "other";
}

void JobMetrics::AddBusy(double seconds, Call call) {
  std::lock_guard<std::mutex> lock(mu_);
  busy_s_ += seconds;
  busy_by_call_s_[static_cast<int>(call)] += seconds;
}

void JobMetrics::AddForward(int64_t samples, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.samples += samples;
  s_.tokens += tokens;
  tokens_ += tokens;
}

void JobMetrics::EndStep(int64_t steps, int64_t compute_ns, int64_t schedule_ns) {
  const Clock::time_point now = now_();
  std::lock_guard<std::mutex> lock(mu_);
  s_.steps = steps;
  const int64_t compute = compute_ns - compute_ns_;
  const int64_t schedule = schedule_ns - schedule_ns_;
  compute_ns_ = compute_ns;
  schedule_ns_ = schedule_ns;
  if (last_step_end_) {
    const double wall = std::chrono::duration<double>(now - *last_step_end_).count();
    s_.step_s = wall;
    s_.busy_s = busy_s_;
    std::copy(std::begin(busy_by_call_s_), std::end(busy_by_call_s_), s_.busy_by_call_s);
    s_.tokens_per_s = wall > 0 ? tokens_ / wall : 0;
    s_.bubble = schedule > 0 ? std::max(0.0, 1.0 - static_cast<double>(compute) / schedule) : 0;
    const std::vector<double>& bounds = StepBuckets();
    for (size_t i = 0; i < bounds.size(); ++i) {
      if (wall <= bounds[i]) ++s_.step_buckets[i];
    }
    ++s_.step_count;
    s_.step_sum_s += wall;
  }
  last_step_end_ = now;
  busy_s_ = 0;
  std::fill(std::begin(busy_by_call_s_), std::end(busy_by_call_s_), 0.0);
  tokens_ = 0;
}

void JobMetrics::SetMemory(std::vector<int64_t> device_bytes,
                           std::vector<int64_t> peak_device_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.device_bytes = std::move(device_bytes);
  s_.peak_device_bytes = std::move(peak_device_bytes);
}

void JobMetrics::AddCheckpointBlocked(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.checkpoint_blocked_s += seconds;
}

JobMetrics::Snapshot JobMetrics::Read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}

}  // namespace rannc
