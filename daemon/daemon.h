// The daemon: owns every top-level object (devices, jobs, the gRPC server and its services) and
// their order of construction and teardown, as LogCabin's Globals do. main.cc only turns flags
// into DaemonOptions and calls Start.
//
//   absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
//   ... (*d)->Shutdown(std::chrono::seconds(10));
//
// Thread-safety: Start, Wait and Shutdown may be called from different threads; Shutdown is
// idempotent.
#ifndef RANNC_DAEMON_DAEMON_H_
#define RANNC_DAEMON_DAEMON_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/config/options.h"
#include "daemon/planner/profile_cache.h"

namespace grpc {
class Server;
}

namespace rannc {

class JobManager;
class JobRecords;
class JobRegistry;
namespace comm {
class Store;
class StoreServiceImpl;
}  // namespace comm
class GrpcPartChannels;
class Health;
class Periodic;
class JobPartServiceImpl;
class TrainingServiceImpl;
struct DaemonFacts;  // daemon/server/job_settings.h
namespace security {
class Authorizer;
class TlsFileMirror;
}  // namespace security
namespace metrics {
class MetricsServer;
class RpcMetrics;
struct DaemonSample;
}  // namespace metrics
namespace cluster {
class Cluster;
class ClusterServiceImpl;
class Election;
class EtcdClient;
class LeaseKeeper;
}  // namespace cluster

inline constexpr char kRanncVersion[] = "0.1.0";

// What a daemon started with `options` knows of itself: its devices (--devices resolved), and
// the links between them (--links, else measured now); no profile cache. Daemon::Start begins
// with it, and benchmarks/job_bench.cc runs a job in-process with it.
absl::StatusOr<DaemonFacts> ResolveFacts(const DaemonOptions& options);

class Daemon {
 public:
  // Resolves devices, binds the listen address (port 0 picks a free port), joins the cluster
  // (--peers; refused when this daemon is not in the list) and starts serving.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  // The address actually bound, e.g. "127.0.0.1:40213".
  const std::string& address() const { return address_; }
  // Blocks until Shutdown has completed.
  void Wait();
  // The cluster this daemon belongs to (a cluster of one without --peers).
  cluster::Cluster& cluster() const { return *cluster_; }
  // Stops heartbeating, then stops accepting RPCs; in-flight RPCs get `grace` to finish, then
  // are cancelled.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  Daemon();
  // --cluster-store: connects to etcd, takes a lease it keeps (this daemon's member key, store
  // keys and job leaderships go with it), and gives jobs over several daemons their rendezvous
  // there. A daemon whose lease is lost (cut off from etcd for its TTL) exits with code 75: its
  // jobs are others' now (job_registry.h), and its supervisor restarts it under a new lease.
  // `self`: this daemon's advertised address.
  absl::Status UseClusterStore(const DaemonOptions& options, const std::string& self);
  // What the metrics endpoint serves at a scrape: each job's measurements, jobs by state, the
  // detached queue, the cluster's members.
  metrics::DaemonSample MetricsSample() const;

  std::string address_;
  std::unique_ptr<planner::ProfileCache> profile_cache_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<JobRecords> records_;  // durable jobs (--state-dir)
  std::unique_ptr<security::Authorizer> auth_;  // tokens (--auth-token-file); the services use it
  // Checked copies of the TLS files, which the server's and the peers' credentials read
  // (--tls-*; --cluster-store-*): declared first, so that they outlive their readers.
  std::unique_ptr<security::TlsFileMirror> tls_mirror_;
  std::unique_ptr<security::TlsFileMirror> cluster_store_tls_mirror_;
  // --cluster-store: etcd, this daemon's lease there (its member key, store keys and job
  // leaderships go with it), the rendezvous store on it that replaces store_service_'s, and
  // the job registry. Before the cluster and the services, which use them, so they outlive them.
  std::unique_ptr<cluster::EtcdClient> etcd_;
  std::unique_ptr<cluster::LeaseKeeper> etcd_lease_;
  std::unique_ptr<comm::Store> etcd_store_;
  std::unique_ptr<JobRegistry> registry_;
  std::unique_ptr<cluster::Election> coordinator_;  // the cluster's coordinator election
  // Declared before the services so that it outlives the server, which calls into it.
  std::unique_ptr<cluster::Cluster> cluster_;
  std::unique_ptr<cluster::ClusterServiceImpl> cluster_service_;
  std::unique_ptr<GrpcPartChannels> part_channels_;  // before the services that use it
  std::unique_ptr<TrainingServiceImpl> training_;
  std::unique_ptr<JobPartServiceImpl> job_parts_;
  // The rendezvous of the data plane for jobs this daemon leads across the cluster.
  std::unique_ptr<comm::StoreServiceImpl> store_service_;
  // Counts the server's calls (declared first: outlives it).
  std::unique_ptr<metrics::RpcMetrics> rpc_metrics_;
  std::unique_ptr<grpc::Server> server_;
  // The metrics endpoint (--metrics-listen): serves rpc_metrics_ and MetricsSample; goes first
  // at Shutdown.
  std::unique_ptr<metrics::MetricsServer> metrics_;
  // Liveness and readiness for probes (health.h), kept by readiness_ from the cluster.
  std::unique_ptr<Health> health_;
  std::unique_ptr<Periodic> readiness_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_DAEMON_H_
