// The daemon's Prometheus endpoint (--metrics-listen HOST:PORT, docs/observability.md): the
// text format at http://HOST:PORT/metrics, built at each scrape from what the daemon knows then,
// so a job that is gone leaves no series behind.
//
// Per job (label `rannc_job`: its name, or its id when it has none; not `job`, which Prometheus
// gives every target; no per-step or per-rank labels): steps, samples and tokens
// trained, tokens/s and the step-time histogram, the planned against the measured step time and
// pipeline bubble, device memory in use and at peak, data-plane bytes, checkpoint blocked time
// and bytes (server/job_metrics.h says what each measures). Per daemon: jobs by state, detached
// jobs queued, cluster members up and down, gRPC calls by method and code with their latency
// (rpc_metrics.h). `rannc jobs` shows the same per-job numbers (ListJobs reads the same
// JobMetrics).
//
//   absl::StatusOr<std::unique_ptr<MetricsServer>> m =
//       MetricsServer::Start("127.0.0.1:9400", [&] { return Sample(); }, &rpcs);
//
// Thread-safe: scrapes run on the endpoint's thread and call `sample` there. prometheus-cpp's
// core gives the metric families and their text format. Its exposer (civetweb) is not used: in
// ranncd's process on the GPU machine it could not start its threads ("Cannot create threads").
#ifndef RANNC_DAEMON_METRICS_METRICS_H_
#define RANNC_DAEMON_METRICS_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/metrics/rpc_metrics.h"
#include "daemon/server/job_metrics.h"

namespace prometheus {
struct MetricFamily;
}  // namespace prometheus

namespace rannc {
namespace metrics {

// What the daemon knows at a scrape.
struct DaemonSample {
  struct Job {
    std::string name;
    JobMetrics::Snapshot m;
  };
  std::vector<Job> jobs;
  // Jobs by state ("DEPLOYED", "UNDEPLOYED", "SUSPENDED", ...), zeros included.
  std::map<std::string, int64_t> jobs_by_state;
  int64_t detached_queued = 0;  // `rannc submit`'s jobs waiting for devices
  int64_t members_up = 0;
  int64_t members_down = 0;
  std::string version;
};

// The metric families of `sample` and `rpcs` (null: none), as the endpoint serves them.
std::vector<prometheus::MetricFamily> Families(const DaemonSample& sample,
                                               const RpcMetrics* rpcs);
// Families in Prometheus's text format.
std::string Text(const std::vector<prometheus::MetricFamily>& families);

class MetricsServer {
 public:
  // Serves `sample`'s and `rpcs`'s families at http://listen/metrics (http_endpoint.h: one
  // scrape at a time, each called on the endpoint's thread). INVALID_ARGUMENT for a listen
  // address that is not HOST:PORT, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen, std::function<DaemonSample()> sample, const RpcMetrics* rpcs);
  ~MetricsServer();

  // The address bound ("127.0.0.1:9400"; port 0 in `listen` picks a free one).
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<HttpEndpoint> endpoint_;
  std::string address_;
};

}  // namespace metrics
}  // namespace rannc

#endif  // RANNC_DAEMON_METRICS_METRICS_H_
