#include "daemon/metrics/metrics.h"

#include <algorithm>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace metrics {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

ClientMetric Labelled(std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  return m;
}

void AddValue(MetricFamily* f, std::vector<ClientMetric::Label> labels, double value) {
  ClientMetric m = Labelled(std::move(labels));
  if (f->type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f->metric.push_back(std::move(m));
}

// A histogram's series from cumulative bucket counts (per bound), then +Inf (every sample).
void AddHistogram(MetricFamily* f, std::vector<ClientMetric::Label> labels,
                  const std::vector<double>& bounds, const std::vector<uint64_t>& buckets,
                  uint64_t count, double sum) {
  ClientMetric m = Labelled(std::move(labels));
  m.histogram.sample_count = count;
  m.histogram.sample_sum = sum;
  for (size_t i = 0; i < bounds.size(); ++i) {
    m.histogram.bucket.push_back({i < buckets.size() ? buckets[i] : 0, bounds[i]});
  }
  m.histogram.bucket.push_back({count, std::numeric_limits<double>::infinity()});
  f->metric.push_back(std::move(m));
}

int64_t Sum(const std::vector<int64_t>& v) {
  int64_t total = 0;
  for (int64_t x : v) total += x;
  return total;
}

int64_t Max(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// Per-job families: name, help, type, and what each job reports.
struct JobFamily {
  const char* name;
  const char* help;
  MetricType type;
  double (*value)(const JobMetrics::Snapshot&);
};

const JobFamily kJobFamilies[] = {
    {"rannc_job_steps_total", "Optimizer steps the job has taken.", MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.steps); }},
    {"rannc_job_samples_total", "Samples of the job's training forwards here.",
     MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.samples); }},
    {"rannc_job_tokens_total",
     "Tokens of the job's training forwards here (the elements of the first integer input, "
     "else samples).",
     MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.tokens); }},
    {"rannc_job_tokens_per_second", "Tokens over the wall time of the job's last iteration.",
     MetricType::Gauge, [](const JobMetrics::Snapshot& m) { return m.tokens_per_s; }},
    {"rannc_job_step_busy_seconds",
     "Time the last iteration spent in the job's calls on this daemon (what the plan estimates).",
     MetricType::Gauge, [](const JobMetrics::Snapshot& m) { return m.busy_s; }},
    {"rannc_job_planned_step_seconds", "The plan's estimate of a step's time.", MetricType::Gauge,
     [](const JobMetrics::Snapshot& m) { return m.planned_step_s; }},
    {"rannc_job_pipeline_bubble_ratio",
     "Share of the devices' schedule time the last iteration spent outside stage compute "
     "(waiting for other stages, transfers, bookkeeping): an upper bound of the bubble.",
     MetricType::Gauge, [](const JobMetrics::Snapshot& m) { return m.bubble; }},
    {"rannc_job_planned_pipeline_bubble_ratio", "The plan's estimate of the pipeline bubble.",
     MetricType::Gauge, [](const JobMetrics::Snapshot& m) { return m.planned_bubble; }},
    {"rannc_job_device_memory_bytes",
     "Bytes the job holds on its devices of this daemon now, summed over them.",
     MetricType::Gauge,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(Sum(m.device_bytes)); }},
    {"rannc_job_device_memory_peak_bytes",
     "The most the job held at once on any one of its devices here during a step since it was "
     "last deployed.",
     MetricType::Gauge,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(Max(m.peak_device_bytes)); }},
    {"rannc_job_data_plane_bytes_total",
     "Bytes the job's devices here handed to the data plane (sends and collectives).",
     MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.data_plane_bytes); }},
    {"rannc_job_checkpoint_blocked_seconds_total",
     "Time checkpoints held the job's training (copying to host memory, waiting for a write).",
     MetricType::Counter, [](const JobMetrics::Snapshot& m) { return m.checkpoint_blocked_s; }},
    {"rannc_job_checkpoint_bytes_total", "Bytes of the checkpoints written here.",
     MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.checkpoint_bytes); }},
    {"rannc_job_checkpoints_total", "Checkpoints written here.", MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.checkpoints_written); }},
    {"rannc_job_checkpoint_failures_total", "Checkpoint writes that failed here.",
     MetricType::Counter,
     [](const JobMetrics::Snapshot& m) { return static_cast<double>(m.checkpoints_failed); }},
};

}  // namespace

std::vector<MetricFamily> Families(const DaemonSample& sample, const RpcMetrics* rpcs) {
  std::vector<MetricFamily> out;
  MetricFamily info = Family("rannc_build_info", "The daemon's version.", MetricType::Gauge);
  AddValue(&info, {{"version", sample.version}}, 1);
  out.push_back(std::move(info));

  // Two jobs of one name (one here, one resumed elsewhere and back) must not make two series
  // with equal labels, which Prometheus rejects: the second keeps its name with a suffix.
  std::vector<std::string> labels;
  std::set<std::string> seen;
  for (const DaemonSample::Job& j : sample.jobs) {
    std::string label = j.name;
    for (int n = 2; !seen.insert(label).second; ++n) label = absl::StrCat(j.name, "#", n);
    labels.push_back(label);
  }
  for (const JobFamily& jf : kJobFamilies) {
    MetricFamily f = Family(jf.name, jf.help, jf.type);
    for (size_t i = 0; i < sample.jobs.size(); ++i) {
      AddValue(&f, {{"rannc_job", labels[i]}}, jf.value(sample.jobs[i].m));
    }
    out.push_back(std::move(f));
  }
  MetricFamily by_call = Family("rannc_job_call_busy_seconds",
                                "rannc_job_step_busy_seconds by kind of call (forward, backward, "
                                "step: the optimizer's, other).",
                                MetricType::Gauge);
  for (size_t i = 0; i < sample.jobs.size(); ++i) {
    for (int c = 0; c < JobMetrics::kCalls; ++c) {
      AddValue(&by_call,
               {{"rannc_job", labels[i]},
                {"call", JobMetrics::CallName(static_cast<JobMetrics::Call>(c))}},
               sample.jobs[i].m.busy_by_call_s[c]);
    }
  }
  out.push_back(std::move(by_call));
  MetricFamily steps = Family("rannc_job_step_seconds",
                              "Wall time of the job's iterations (from one optimizer step's end "
                              "to the next's, the client's time included).",
                              MetricType::Histogram);
  for (size_t i = 0; i < sample.jobs.size(); ++i) {
    const JobMetrics::Snapshot& m = sample.jobs[i].m;
    AddHistogram(&steps, {{"rannc_job", labels[i]}}, JobMetrics::StepBuckets(), m.step_buckets,
                 m.step_count, m.step_sum_s);
  }
  out.push_back(std::move(steps));

  MetricFamily states = Family("rannc_jobs", "The daemon's jobs by state.", MetricType::Gauge);
  for (const auto& [state, count] : sample.jobs_by_state) {
    AddValue(&states, {{"state", state}}, static_cast<double>(count));
  }
  out.push_back(std::move(states));
  MetricFamily queued = Family("rannc_detached_jobs_queued",
                               "Submitted (detached) jobs waiting for devices.", MetricType::Gauge);
  AddValue(&queued, {}, static_cast<double>(sample.detached_queued));
  out.push_back(std::move(queued));
  MetricFamily members = Family("rannc_cluster_members",
                                "Members of the daemon's cluster as it sees them, by status.",
                                MetricType::Gauge);
  AddValue(&members, {{"status", "up"}}, static_cast<double>(sample.members_up));
  AddValue(&members, {{"status", "down"}}, static_cast<double>(sample.members_down));
  out.push_back(std::move(members));

  if (rpcs != nullptr) {
    const RpcMetrics::Snapshot r = rpcs->Read();
    MetricFamily handled = Family("rannc_grpc_server_handled_total",
                                  "gRPC calls the daemon answered, by method and status code.",
                                  MetricType::Counter);
    for (const auto& [key, count] : r.handled) {
      AddValue(&handled, {{"method", key.first}, {"code", key.second}},
               static_cast<double>(count));
    }
    out.push_back(std::move(handled));
    MetricFamily latency = Family("rannc_grpc_server_handling_seconds",
                                  "Time from a gRPC call's start to its status, by method.",
                                  MetricType::Histogram);
    for (const auto& [method, l] : r.latency) {
      AddHistogram(&latency, {{"method", method}}, RpcMetrics::LatencyBuckets(), l.buckets,
                   l.count, l.sum_s);
    }
    out.push_back(std::move(latency));
  }
  return out;
}

std::string Text(const std::vector<MetricFamily>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<DaemonSample()> sample, const RpcMetrics* rpcs) {
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> endpoint = HttpEndpoint::Start(
      listen, "/metrics", "text/plain; version=0.0.4; charset=utf-8",
      [sample = std::move(sample), rpcs] { return Text(Families(sample(), rpcs)); });
  if (!endpoint.ok()) {
    return absl::Status(endpoint.status().code(),
                        absl::StrCat("--metrics-listen ", endpoint.status().message(),
                                     ": pick another address or port"));
  }
  server->endpoint_ = std::move(*endpoint);
  server->address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":",
                                  server->endpoint_->port());
  spdlog::info("serving Prometheus metrics at http://{}/metrics", server->address_);
  return server;
}

MetricsServer::~MetricsServer() = default;

}  // namespace metrics
}  // namespace rannc
