#include "daemon/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>
#include <torch/version.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/cluster/cluster.h"
#include "daemon/cluster/cluster_service.h"
#include "daemon/cluster/election.h"
#include "daemon/cluster/etcd_client.h"
#include "daemon/cluster/etcd_transport.h"
#include "daemon/cluster/peers.h"
#include "daemon/comm/cuda_devices.h"
#include "daemon/comm/etcd_store.h"
#include "daemon/comm/grpc_store.h"
#include "daemon/common/periodic.h"
#include "daemon/common/status.h"
#include "daemon/health.h"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/rpc_metrics.h"
#include "daemon/planner/links.h"
#include "daemon/planner/link_probe.h"
#include "daemon/security/auth.h"
#include "daemon/security/tls.h"
#include "daemon/security/tls_mirror.h"
#include "daemon/server/grpc_part_channel.h"
#include "daemon/server/job_manager.h"
#include "daemon/server/job_part_service.h"
#include "daemon/server/job_records.h"
#include "daemon/server/job_registry.h"
#include "daemon/server/training_service.h"

namespace rannc {
namespace {

// The election of the cluster's coordinator, with --cluster-store (cluster/election.h).
constexpr char kCoordinatorElection[] = "/rannc/coordinator";

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * page_size : 0;
}

std::string Hostname() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

absl::StatusOr<std::vector<DaemonFacts::Device>> ResolveDevices(const DaemonOptions& options) {
  const int cuda_count = comm::CudaDeviceCount();
  absl::StatusOr<std::vector<DeviceSpec>> specs = ParseDevices(options.devices, cuda_count);
  if (!specs.ok()) return specs.status();
  std::vector<DaemonFacts::Device> devices;
  // CPU "devices" share the host's memory, so each gets an equal share unless told otherwise.
  const uint64_t cpu_share = PhysicalMemoryBytes() / std::max<size_t>(specs->size(), 1);
  for (const DeviceSpec& spec : *specs) {
    // A shared GPU's devices split its memory.
    uint64_t memory =
        spec.type == "cuda" ? comm::CudaDeviceMemory(spec.index) / spec.shares : cpu_share;
    if (options.device_memory != 0) memory = options.device_memory;
    devices.push_back({DeviceName(spec), spec.type, memory, spec.type == "cuda" ? spec.index : -1,
                       spec.shares > 1});
  }
  return devices;
}

// The planner's link speeds, measured at start while nothing else runs: between GPUs over the
// communicator their jobs will use (NCCL; CPU copies say nothing about NVLink), else between
// CPU devices. Small transfers keep the start fast; they still run long enough to leave the
// caches.
absl::StatusOr<planner::Links> MeasureDeviceLinks(
    const std::vector<DaemonFacts::Device>& devices) {
  if (devices.size() >= 2 && devices[0].cuda_index >= 0) {
    CommLinkProbeOptions probe;
    probe.backend = JobBackend(/*cuda=*/true, devices);
    for (const DaemonFacts::Device& d : devices) {
      probe.devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(d.cuda_index));
    }
    absl::StatusOr<planner::Links> links = MeasureCommLinks(probe);
    if (links.ok()) return links;
    spdlog::warn("measuring the links between the GPUs failed ({}); the planner gets the host's "
                 "copy speeds instead", links.status().ToString());
  }
  planner::LinkProbeOptions probe;
  probe.num_devices = static_cast<int>(devices.size());
  probe.p2p_bytes = 16 << 20;
  probe.allreduce_bytes = 4 << 20;
  probe.repeats = 2;
  probe.time_budget_s = 0.5;
  return planner::MeasureCpuLinks(probe);
}

// The links between the devices, from the host to the first GPU, and the host's memory.
absl::StatusOr<planner::Links> MeasureLinks(const std::vector<DaemonFacts::Device>& devices) {
  absl::StatusOr<planner::Links> links = MeasureDeviceLinks(devices);
  if (!links.ok() || devices.empty() || devices[0].cuda_index < 0) return links;
  // What offload's parameters and gradients cross (the planner prices streaming with it).
  absl::StatusOr<double> host = MeasureHostLink(
      c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(devices[0].cuda_index)));
  if (host.ok()) {
    links->host_bytes_per_s = *host;
  } else {
    spdlog::warn("measuring the host's link to the GPU failed ({}); the planner prices "
                 "offload's copies at the p2p speed", host.status().ToString());
  }
  // What offload's sums of streamed gradients over micro-batches run at.
  absl::StatusOr<double> memory = MeasureHostMemory();
  if (memory.ok()) {
    links->host_memory_bytes_per_s = *memory;
  } else {
    spdlog::warn("measuring the host's memory failed ({}); the planner does not price "
                 "offload's sums of gradients on the host", memory.status().ToString());
  }
  // What offload's optimizer steps on the host run at: the masters are page-locked.
  absl::StatusOr<double> step = MeasureHostStep(256 << 20, 2, /*pinned=*/true);
  if (step.ok()) {
    links->host_step_bytes_per_s = *step;
  } else {
    spdlog::warn("measuring the host's optimizer step failed ({}); the planner does not price "
                 "offload's optimizer steps on the host", step.status().ToString());
  }
  return links;
}

// How often the TLS files are read again: --tls-refresh, a second at least (as gRPC had it).
std::chrono::milliseconds TlsRefresh(const DaemonOptions& options) {
  return std::max<std::chrono::milliseconds>(options.tls_refresh, std::chrono::seconds(1));
}

// Whether `listen` can be reached from this host only: loopback, or a Unix socket.
bool LocalOnly(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "[::1]";
}

// The safe default (docs/security.md): whoever reaches ranncd's port runs code on its host, so
// an address others reach needs TLS and tokens, or --insecure said out loud.
absl::Status CheckExposure(const DaemonOptions& options, bool tls, bool tokens) {
  if (LocalOnly(options.listen) || (tls && tokens)) return absl::OkStatus();
  const std::string missing = !tls && !tokens ? "TLS (--tls-cert, --tls-key) and tokens "
                                                "(--auth-token-file)"
                              : !tls          ? "TLS (--tls-cert, --tls-key)"
                                              : "tokens (--auth-token-file)";
  if (!options.insecure) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen ", options.listen, " can be reached from other hosts, and whoever reaches "
        "ranncd runs code on this one: give it ", missing, " (docs/security.md), or --insecure "
        "to serve it so anyway"));
  }
  spdlog::warn("--insecure: serving {} without {}; whoever reaches it runs code on this host",
               options.listen, missing);
  return absl::OkStatus();
}

// The address the other members know this daemon by: --advertise, else the bound address,
// which is only usable by others when it names a concrete interface and port.
absl::StatusOr<std::string> AdvertisedAddress(const DaemonOptions& options,
                                              const std::string& bound) {
  if (!options.advertise.empty()) return options.advertise;
  if (options.peers.empty() && options.cluster_store.empty()) return bound;
  absl::StatusOr<cluster::HostPort> listen = cluster::SplitHostPort(options.listen);
  if (!listen.ok() || listen->host == "0.0.0.0" || listen->host == "::" ||
      listen->host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen ", options.listen, " is not an address the other daemons can reach; give "
        "--advertise HOST:PORT, the address the other daemons call it at"));
  }
  return bound;
}

// `transport`: how members hear each other (gRPC heartbeats, or etcd's member keys).
absl::StatusOr<std::unique_ptr<cluster::Cluster>> JoinCluster(
    const DaemonOptions& options, const DaemonFacts& facts, const std::string& advertise,
    std::unique_ptr<cluster::PeerTransport> transport) {
  cluster::ClusterOptions o;
  if (!options.peers.empty()) {
    absl::StatusOr<std::vector<std::string>> peers = cluster::ParsePeerList(options.peers);
    if (!peers.ok()) return Annotate(peers.status(), "--peers");
    o.peers = *peers;
  }
  // With etcd and no list, the members are those that write their keys there.
  o.discover = o.peers.empty() && !options.cluster_store.empty();
  o.advertise = advertise;
  o.cluster_size = static_cast<int>(options.cluster_size);
  o.heartbeat_interval = options.heartbeat_interval;
  o.peer_timeout = options.peer_timeout;
  for (const DaemonFacts::Device& d : facts.devices) {
    o.devices.push_back({d.name, d.type, d.memory_bytes});
  }
  o.hostname = facts.hostname;
  o.version = facts.version;
  return cluster::Cluster::Create(std::move(o), std::move(transport));
}

}  // namespace

absl::StatusOr<DaemonFacts> ResolveFacts(const DaemonOptions& options) {
  absl::StatusOr<std::vector<DaemonFacts::Device>> devices = ResolveDevices(options);
  if (!devices.ok()) return devices.status();
  DaemonFacts facts;
  facts.version = kRanncVersion;
  facts.torch_version = TORCH_VERSION;
  facts.hostname = Hostname();
  facts.max_message_bytes = options.max_message_size;
  facts.shm_dir = options.shm_dir;
  facts.devices = *devices;

  // The planner's link speeds: given, or measured now while nothing else runs. Small transfers
  // keep the start fast; they still run long enough to leave the caches.
  if (!options.links.empty()) {
    absl::StatusOr<planner::Links> links = planner::LinksFromString(options.links);
    if (!links.ok()) return Annotate(links.status(), "--links");
    facts.links = *links;
  } else {
    absl::StatusOr<planner::Links> links = MeasureLinks(facts.devices);
    if (!links.ok()) return Annotate(links.status(), "measuring the links between devices");
    facts.links = *links;
  }
  spdlog::info("links: {}", planner::DescribeLinks(facts.links));
  return facts;
}

Daemon::Daemon() = default;

Daemon::~Daemon() {
  Shutdown(std::chrono::milliseconds(0));
  // Their copies of the TLS files go with tls_mirror_.
  if (tls_mirror_) security::SetPeerCredentials(nullptr);
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  absl::StatusOr<DaemonFacts> resolved = ResolveFacts(options);
  if (!resolved.ok()) return resolved.status();
  DaemonFacts facts = std::move(*resolved);
  std::unique_ptr<Daemon> daemon(new Daemon());

  const std::string cache_path = options.profile_cache == "none" ? ""
                                 : options.profile_cache.empty() ? planner::DefaultProfileCachePath()
                                                                 : options.profile_cache;
  daemon->profile_cache_ = std::make_unique<planner::ProfileCache>(cache_path);
  if (absl::Status loaded = daemon->profile_cache_->Load(); !loaded.ok()) {
    spdlog::warn("{}; starting with an empty profile cache", std::string(loaded.message()));
  }
  facts.profile_cache = daemon->profile_cache_.get();

  daemon->jobs_ = std::make_unique<JobManager>();
  std::string state_dir = options.state_dir;
  if (state_dir.empty()) {
    const char* xdg = std::getenv("XDG_STATE_HOME");
    const char* home = std::getenv("HOME");
    state_dir = xdg != nullptr && *xdg ? absl::StrCat(xdg, "/rannc")
                : home != nullptr      ? absl::StrCat(home, "/.local/state/rannc")
                                       : "";
  }
  daemon->records_ = std::make_unique<JobRecords>(state_dir == "none" ? "" : state_dir);

  // TLS: the server's, and that of this daemon's calls to the others (mutual TLS).
  const security::TlsFiles tls{options.tls_cert, options.tls_key, options.tls_ca};
  if (absl::Status checked = security::CheckTlsFiles(tls, "--tls", true); !checked.ok()) {
    return checked;
  }
  absl::StatusOr<std::unique_ptr<security::Authorizer>> auth =
      security::Authorizer::FromFile(options.auth_token_file);
  if (!auth.ok()) return auth.status();
  if (absl::Status exposed = CheckExposure(options, tls.enabled(), (*auth)->enabled());
      !exposed.ok()) {
    return exposed;
  }
  daemon->auth_ = std::move(*auth);
  // The other daemons of the cluster share the admin token; this daemon's calls to them carry it.
  if (daemon->auth_->enabled()) security::SetPeerToken(daemon->auth_->admin_token());
  // gRPC reads checked copies of the files (security/tls_mirror.h): a rotation to a file that
  // does not parse is logged and the last good certificate stays in use. The mirror reads the
  // user's files every --tls-refresh; gRPC its copies every second, which costs nothing.
  std::shared_ptr<grpc::ServerCredentials> server_credentials = grpc::InsecureServerCredentials();
  if (tls.enabled()) {
    absl::StatusOr<std::unique_ptr<security::TlsFileMirror>> mirror =
        security::TlsFileMirror::Start(tls, "--tls", {TlsRefresh(options)});
    if (!mirror.ok()) return mirror.status();
    daemon->tls_mirror_ = std::move(*mirror);
    const security::TlsFiles& copies = daemon->tls_mirror_->files();
    server_credentials = security::ServerCredentials(copies, std::chrono::seconds(1));
    security::SetPeerCredentials(security::ChannelCredentials(copies, std::chrono::seconds(1)));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Without this gRPC binds with SO_REUSEPORT, and a second daemon on a busy port would
  // silently share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(options.listen, server_credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<uint64_t>(options.max_message_size, std::numeric_limits<int>::max())));
  builder.SetMaxSendMessageSize(std::numeric_limits<int>::max());

  const std::string host = options.listen.substr(0, options.listen.rfind(':'));
  daemon->part_channels_ = std::make_unique<GrpcPartChannels>();
  daemon->training_ = std::make_unique<TrainingServiceImpl>(
      facts, daemon->jobs_.get(), daemon->part_channels_.get(), daemon->records_.get());
  daemon->training_->set_authorizer(daemon->auth_.get());
  daemon->training_->set_upload_ttl(options.upload_ttl);
  daemon->training_->set_queue_aging(options.queue_aging);
  builder.RegisterService(daemon->training_.get());
  daemon->job_parts_ = std::make_unique<JobPartServiceImpl>(facts, daemon->jobs_.get());
  daemon->job_parts_->set_authorizer(daemon->auth_.get());
  builder.RegisterService(daemon->job_parts_.get());
  // Registered now, attached to the cluster once the bound port (hence this daemon's own
  // address) is known; until then peers' heartbeats get UNAVAILABLE.
  daemon->cluster_service_ = std::make_unique<cluster::ClusterServiceImpl>();
  daemon->cluster_service_->set_authorizer(daemon->auth_.get());
  builder.RegisterService(daemon->cluster_service_.get());
  daemon->store_service_ = std::make_unique<comm::StoreServiceImpl>(comm::MakeInMemoryStore());
  daemon->store_service_->set_authorizer(daemon->auth_.get());
  builder.RegisterService(daemon->store_service_.get());
  daemon->training_->set_store(daemon->store_service_->store());
  // Every call of every service is counted by method and code (the metrics endpoint's).
  daemon->rpc_metrics_ = std::make_unique<metrics::RpcMetrics>();
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counted;
  counted.push_back(daemon->rpc_metrics_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(counted));
  daemon->server_ = builder.BuildAndStart();
  if (daemon->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", options.listen, " (address in use, or not an address of this "
        "host); pick another with --listen"));
  }
  absl::StatusOr<std::unique_ptr<Health>> health =
      Health::Start(daemon->server_.get(), options.health_listen);
  if (!health.ok()) {
    daemon->server_->Shutdown(std::chrono::system_clock::now());
    return health.status();
  }
  daemon->health_ = std::move(*health);
  daemon->address_ = absl::StrCat(host, ":", port);
  absl::StatusOr<std::string> advertise = AdvertisedAddress(options, daemon->address_);
  if (advertise.ok() && !options.cluster_store.empty()) {
    absl::Status joined =
        daemon->UseClusterStore(options, *advertise);
    if (!joined.ok()) {
      daemon->server_->Shutdown(std::chrono::system_clock::now());
      return joined;
    }
  }
  // With --cluster-store, members hear each other through etcd, not by calling each other.
  std::unique_ptr<cluster::PeerTransport> transport = cluster::MakeGrpcTransport();
  if (advertise.ok() && daemon->etcd_) {
    absl::StatusOr<std::unique_ptr<cluster::PeerTransport>> on_etcd =
        cluster::MakeEtcdTransport(daemon->etcd_.get(), daemon->etcd_lease_->lease());
    if (!on_etcd.ok()) {
      daemon->server_->Shutdown(std::chrono::system_clock::now());
      return Annotate(on_etcd.status(), "--cluster-store");
    }
    transport = std::move(*on_etcd);
  }
  absl::StatusOr<std::unique_ptr<cluster::Cluster>> joined =
      advertise.ok() ? JoinCluster(options, facts, *advertise, std::move(transport))
                     : absl::StatusOr<std::unique_ptr<cluster::Cluster>>(advertise.status());
  if (!joined.ok()) {
    daemon->server_->Shutdown(std::chrono::system_clock::now());
    return joined.status();
  }
  daemon->cluster_ = std::move(*joined);
  daemon->cluster_service_->Attach(daemon->cluster_.get());
  if (!options.metrics_listen.empty()) {
    Daemon* self = daemon.get();
    absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> served = metrics::MetricsServer::Start(
        options.metrics_listen, [self] { return self->MetricsSample(); },
        daemon->rpc_metrics_.get());
    if (!served.ok()) {
      daemon->server_->Shutdown(std::chrono::system_clock::now());
      return served.status();
    }
    daemon->metrics_ = std::move(*served);
  }
  // A lost daemon fails the jobs that have a part on it at once (never a hang); others go on.
  // The parts of jobs it led are useless: they go, their devices freed.
  // A job registered on etcd that lost a part comes back from its checkpoint (Recover).
  daemon->cluster_->OnMemberDown([jobs = daemon->jobs_.get(), training = daemon->training_.get()](
                                     const cluster::MemberInfo& member, const std::string& why) {
    for (const JobManager::Listed& listed : jobs->List()) {
      Coordinator& coordinator = listed.job->coordinator();
      const std::string& id = listed.job->info().id;
      if (coordinator.MemberLost(member.address, why)) {
        spdlog::warn("deleting job {}: its leading daemon {} is lost", id, member.address);
        jobs->Remove(id).IgnoreError();
      } else if (coordinator.leads() && !coordinator.Lost().ok()) {
        training->Recover(id);
      }
    }
  });
  daemon->training_->set_cluster(daemon->cluster_.get());
  if (daemon->etcd_) {
    daemon->registry_ = std::make_unique<JobRegistry>(daemon->etcd_.get(),
                                                      daemon->etcd_lease_.get(), *advertise);
    daemon->training_->set_registry(daemon->registry_.get());
    absl::StatusOr<std::unique_ptr<cluster::Election>> coordinator = cluster::Election::Start(
        daemon->etcd_.get(), daemon->etcd_lease_->lease(), kCoordinatorElection, *advertise);
    if (!coordinator.ok()) {
      daemon->server_->Shutdown(std::chrono::system_clock::now());
      return Annotate(coordinator.status(), "--cluster-store: standing for coordinator");
    }
    daemon->coordinator_ = std::move(*coordinator);
    daemon->training_->set_coordinator_election(daemon->coordinator_.get(),
                                                options.cluster_store);
  }
  std::string device_list;
  for (const DaemonFacts::Device& d : facts.devices) {
    absl::StrAppend(&device_list, device_list.empty() ? "" : ", ", d.name, " (",
                    d.memory_bytes >> 20, " MiB)");
  }
  spdlog::info("devices: {}", device_list);
  daemon->training_->set_address(daemon->address_);
  daemon->training_->ResumeDetachedJobs();
  daemon->cluster_->Start();
  // Ready (health "rannc.ready") once the cluster's members are known and this daemon ranked.
  daemon->readiness_ = std::make_unique<Periodic>(
      std::chrono::milliseconds(500),
      [health = daemon->health_.get(), cluster = daemon->cluster_.get()] {
        health->SetReady(cluster->Joined());
      },
      Periodic::First::kNow);
  if (!daemon->health_->address().empty()) {
    spdlog::info("serving gRPC health (plain text) on {}", daemon->health_->address());
  }
  spdlog::info("ranncd listening on {} (version {}, LibTorch {}, {}, {})", daemon->address_,
               kRanncVersion, TORCH_VERSION,
               !tls.enabled()     ? "plain text"
               : tls.ca.empty()   ? "TLS"
                                  : "TLS, daemons' certificates checked against --tls-ca",
               daemon->auth_->enabled() ? "tokens required" : "no tokens");
  return daemon;
}

absl::Status Daemon::UseClusterStore(const DaemonOptions& options, const std::string& self) {
  const std::string& url = options.cluster_store;
  const std::chrono::milliseconds lease_ttl = options.cluster_lease;
  const auto ttl = std::chrono::duration_cast<std::chrono::seconds>(lease_ttl);
  if (ttl < std::chrono::seconds(2) || ttl != lease_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cluster-lease ", lease_ttl.count(), "ms: give whole seconds, 2s or more (etcd's "
        "leases count seconds, and live at least about as long as its election timeout)"));
  }
  absl::StatusOr<std::vector<std::string>> endpoints = cluster::ParseEtcdUrl(url);
  if (!endpoints.ok()) return Annotate(endpoints.status(), "--cluster-store");
  const security::TlsFiles tls{options.cluster_store_cert, options.cluster_store_key,
                               options.cluster_store_ca};
  if (absl::Status files = security::CheckTlsFiles(tls, "--cluster-store", false); !files.ok()) {
    return files;
  }
  // Checked copies, as for the server's files (Start).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (tls.enabled()) {
    absl::StatusOr<std::unique_ptr<security::TlsFileMirror>> mirror =
        security::TlsFileMirror::Start(tls, "--cluster-store", {TlsRefresh(options)});
    if (!mirror.ok()) return mirror.status();
    cluster_store_tls_mirror_ = std::move(*mirror);
    credentials = security::ChannelCredentials(cluster_store_tls_mirror_->files(),
                                               std::chrono::seconds(1));
  }
  absl::StatusOr<std::unique_ptr<cluster::EtcdClient>> etcd =
      cluster::EtcdClient::Connect(*endpoints, std::chrono::seconds(5), credentials);
  if (!etcd.ok()) return Annotate(etcd.status(), "--cluster-store");
  etcd_ = std::move(*etcd);
  // This daemon's lease: its member key (cluster/etcd_transport.h), and the store keys of the
  // groups it meets in, live as long as it does.
  const auto asked = std::chrono::steady_clock::now();
  absl::StatusOr<int64_t> lease = etcd_->GrantLease(ttl);
  if (!lease.ok()) return Annotate(lease.status(), "--cluster-store");
  etcd_lease_ = std::make_unique<cluster::LeaseKeeper>(
      etcd_.get(), *lease, ttl, [self](const absl::Status& why) {
        // Its member key, store keys and job leaderships are gone, or soon will be: other
        // daemons take its jobs over. It must drive none of them from now on, and cannot
        // rejoin under this lease: as Kubernetes' own controllers do when they lose their
        // leader lease, it exits, for its supervisor to start it again.
        spdlog::critical("this daemon ({}) lost its etcd lease ({}): its jobs are taken over "
                         "by other daemons; exiting (75) to be restarted", self, why.ToString());
        spdlog::shutdown();
        std::_Exit(75);
      }, asked);
  etcd_store_ = comm::MakeEtcdStore(etcd_.get(), "/rannc/store/", *lease);
  training_->set_store(etcd_store_.get());
  job_parts_->set_store(etcd_store_.get());
  spdlog::info("cluster store: etcd at {} (lease {:x}); jobs over several daemons meet there",
               absl::StrJoin(*endpoints, ","), *lease);
  return absl::OkStatus();
}

void Daemon::Wait() {
  if (server_) server_->Wait();
}

metrics::DaemonSample Daemon::MetricsSample() const {
  metrics::DaemonSample s;
  s.version = kRanncVersion;
  s.jobs_by_state = {{"DEPLOYED", 0}, {"UNDEPLOYED", 0}, {"SUSPENDED", 0}};
  std::set<std::string> live;
  for (const JobManager::Listed& listed : jobs_->List()) {
    const JobInfo& info = listed.job->info();
    JobMetrics::Snapshot m = listed.job->Measure();
    ++s.jobs_by_state[m.state];
    live.insert(info.id);
    s.jobs.push_back({info.name.empty() ? info.id : info.name, std::move(m)});
  }
  // Kept (--state-dir) and not running: SUSPENDED, as ListJobs has them.
  for (const v1::JobRecord& r : records_->List()) {
    if (!live.count(r.job_id())) ++s.jobs_by_state["SUSPENDED"];
  }
  s.detached_queued = static_cast<int64_t>(training_->detached_queued());
  for (const cluster::MemberInfo& m : cluster_->Members()) {
    ++(m.state == cluster::MemberState::kUp ? s.members_up : s.members_down);
  }
  return s;
}

void Daemon::Shutdown(std::chrono::milliseconds grace) {
  metrics_.reset();  // no scrape reads the jobs while they go
  // Not ready, then not live, for the probes, before anything stops.
  if (readiness_) readiness_->Stop();
  if (health_) health_->Shutdown();
  // Detached jobs stop after their step, each saved as a checkpoint there, while the cluster a
  // job spans still answers (Kubernetes' termination grace period is meant to cover this).
  if (training_) training_->StopDetachedJobs();
  // Jobs led here go to other daemons once the lease is revoked below; take over none now,
  // before the others' stopping (their leases revoked) orphans theirs.
  if (registry_) registry_->StopWatching();
  if (coordinator_) {
    training_->set_coordinator_election(nullptr, "");
    coordinator_.reset();  // resigns: another daemon coordinates at once
  }
  if (cluster_) cluster_->Stop();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
  if (etcd_lease_) {
    // Gone at once for the others, rather than when the lease would expire.
    const int64_t lease = etcd_lease_->lease();
    etcd_lease_.reset();
    etcd_->RevokeLease(lease).IgnoreError();
  }
}

}  // namespace rannc
