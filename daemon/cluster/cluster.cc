#include "daemon/cluster/cluster.h"

#include <random>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {
namespace cluster {
namespace {

uint64_t RandomIncarnation() {
  std::random_device device;
  std::mt19937_64 generator((static_cast<uint64_t>(device()) << 32) ^ device() ^
                            static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  uint64_t value = 0;
  while (value == 0) value = generator();  // 0 means "not heard from" on the wire
  return value;
}

std::string Describe(const MemberInfo& m) {
  std::vector<std::string> devices;
  for (const DeviceSummary& d : m.devices) devices.push_back(d.name);
  return absl::StrCat(m.address, " (rank ", m.rank, ", host ", m.hostname, ", devices ",
                      absl::StrJoin(devices, ","), ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(
    ClusterOptions options, std::unique_ptr<PeerTransport> transport) {
  if (options.heartbeat_interval <= std::chrono::milliseconds(0) ||
      options.peer_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the peer timeout (", options.peer_timeout.count(), " ms) must be longer than the "
        "heartbeat interval (", options.heartbeat_interval.count(), " ms), which must be > 0"));
  }
  if (!options.resolve) options.resolve = SystemResolver();
  if (!options.now) options.now = [] { return Clock::now(); };
  if (options.incarnation == 0) options.incarnation = RandomIncarnation();
  std::unique_ptr<Cluster> cluster(new Cluster(std::move(options), std::move(transport)));
  const ClusterOptions& o = cluster->options_;
  if (o.peers.empty()) {
    cluster->membership_.emplace(std::vector<std::string>{o.advertise}, cluster->self_,
                                 o.peer_timeout, o.discover);
    return cluster;
  }
  if (o.discover) {
    return absl::InvalidArgumentError(
        "a cluster discovers its members or is given them (--peers), not both");
  }
  absl::StatusOr<PeerResolution> resolution = ResolvePeers(o.peers, o.cluster_size, o.resolve);
  if (!resolution.ok()) return resolution.status();
  const bool is_member = std::find(resolution->members.begin(), resolution->members.end(),
                                   o.advertise) != resolution->members.end();
  if (resolution->complete && !is_member) {
    if (resolution->from_dns) {
      return absl::InvalidArgumentError(absl::StrCat(
          "this daemon's address ", o.advertise, " is not among the addresses ", o.peers[0],
          " resolves to (", absl::StrJoin(resolution->members, ","), "); set --advertise to "
          "this daemon's IP and port"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "this daemon's address ", o.advertise, " is not in its peer list (",
        absl::StrJoin(resolution->members, ","), "); --peers must list every daemon, this one "
        "included, spelled as it advertises itself (--advertise HOST:PORT, default the --listen "
        "address)"));
  }
  if (resolution->complete) {
    cluster->membership_.emplace(resolution->members, cluster->self_, o.peer_timeout);
  }
  return cluster;
}

Cluster::Cluster(ClusterOptions options, std::unique_ptr<PeerTransport> transport)
    : options_(std::move(options)), transport_(std::move(transport)) {
  self_.address = options_.advertise;
  self_.incarnation = options_.incarnation;
  self_.devices = options_.devices;
  self_.hostname = options_.hostname;
  self_.version = options_.version;
}

Cluster::~Cluster() { Stop(); }

void Cluster::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.peers.empty() && !options_.discover) return;
    if (options_.discover) {
      spdlog::info("cluster: finding the members through the cluster store, incarnation {:016x}",
                   self_.incarnation);
    } else if (membership_) {
      spdlog::info("cluster: rank {} of {} ({}), incarnation {:016x}", membership_->self().rank,
                   membership_->self().members.size(),
                   absl::StrJoin(membership_->self().members, ","), self_.incarnation);
    }
  }
  std::lock_guard<std::mutex> lock(thread_mu_);
  if (stopped_ || heartbeat_) return;
  heartbeat_ = std::make_unique<Periodic>(options_.heartbeat_interval, [this] { Tick(); },
                                          Periodic::First::kNow);
}

void Cluster::Stop() {
  std::unique_ptr<Periodic> heartbeat;
  {
    std::lock_guard<std::mutex> lock(thread_mu_);
    stopped_ = true;
    heartbeat.swap(heartbeat_);
  }
  heartbeat.reset();  // joins, without thread_mu_ held
}

void Cluster::TryResolve() {
  absl::StatusOr<PeerResolution> resolution =
      ResolvePeers(options_.peers, options_.cluster_size, options_.resolve);
  std::string error;
  if (!resolution.ok()) {
    error = std::string(resolution.status().message());
  } else if (resolution->complete &&
             std::find(resolution->members.begin(), resolution->members.end(),
                       options_.advertise) == resolution->members.end()) {
    error = absl::StrCat("this daemon's address ", options_.advertise, " is not among the ",
                         resolution->members.size(), " addresses ", options_.peers[0],
                         " resolves to (", absl::StrJoin(resolution->members, ","),
                         "); set --advertise to this daemon's IP and port");
  } else if (!resolution->complete) {
    error = absl::StrCat(options_.peers[0], " resolves to ", resolution->members.size(), " of ",
                         options_.cluster_size, " daemons so far; resolving again");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error.empty()) {
    if (error != last_resolve_error_) spdlog::warn("cluster: {}", error);
    last_resolve_error_ = error;
    return;
  }
  membership_.emplace(resolution->members, self_, options_.peer_timeout);
  spdlog::info("cluster: rank {} of {} ({}), incarnation {:016x}", membership_->self().rank,
               resolution->members.size(), absl::StrJoin(resolution->members, ","),
               self_.incarnation);
}

void Cluster::Tick() {
  std::lock_guard<std::mutex> tick_lock(tick_mu_);
  bool resolved = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    resolved = membership_.has_value();
  }
  if (!resolved) TryResolve();

  const std::vector<std::string> found =
      options_.discover ? transport_->Discovered() : std::vector<std::string>{};
  std::vector<std::string> peers;
  PeerReport self;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!membership_) return;
    for (const std::string& address : found) {
      if (membership_->Add(address)) {
        spdlog::info("cluster: found member {}; {} members: {}", address,
                     membership_->self().members.size(),
                     absl::StrJoin(membership_->self().members, ","));
      }
    }
    peers = membership_->Peers();
    self = membership_->self();
  }
  std::vector<absl::StatusOr<PeerReport>> answers;
  // A discovering daemon alone still reports itself: that is how the others find it.
  if (!peers.empty() || options_.discover) {
    // Within the interval, so one unreachable peer never stretches the heartbeat period.
    const std::chrono::milliseconds deadline =
        std::min(options_.heartbeat_interval, std::chrono::milliseconds(1000));
    answers = transport_->HeartbeatAll(peers, self, deadline);
  }
  const std::vector<std::pair<std::string, std::string>> lost = transport_->TakeLost();

  std::vector<MemberEvent> downs;
  std::vector<MemberDownFn> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = options_.now();
    std::vector<MemberEvent> events;
    // Those known gone first: a member that is back already (a new report) is UP again below.
    for (const auto& [address, why] : lost) membership_->Lost(address, why, &events);
    for (size_t i = 0; i < answers.size() && i < peers.size(); ++i) {
      absl::Status status = answers[i].status();
      if (status.ok() && answers[i]->address != peers[i]) {
        status = absl::FailedPreconditionError(
            absl::StrCat("the daemon at ", peers[i], " calls itself ", answers[i]->address));
      }
      if (status.ok()) status = membership_->Heard(*answers[i], now, &events);
      std::string error = status.ok() ? "" : status.ToString();
      std::string& last = last_error_[peers[i]];
      if (!error.empty() && error != last) {
        spdlog::warn("cluster: heartbeat to {}: {}", peers[i], error);
      }
      last = error;
    }
    membership_->Expire(now, &events);
    Record(std::move(events));
    downs.swap(pending_downs_);
    callbacks = callbacks_;
  }
  for (const MemberEvent& event : downs) {
    for (const MemberDownFn& fn : callbacks) fn(event.member, event.reason);
  }
}

void Cluster::Record(std::vector<MemberEvent> events) {
  for (MemberEvent& event : events) {
    if (event.kind == MemberEvent::Kind::kUp) {
      spdlog::info("cluster: member {} is UP (incarnation {:016x})", Describe(event.member),
                   event.member.incarnation);
    } else {
      spdlog::warn("cluster: member {} is DOWN: {}", Describe(event.member), event.reason);
      pending_downs_.push_back(std::move(event));
    }
  }
}

absl::StatusOr<PeerReport> Cluster::HandleHeartbeat(const PeerReport& sender) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!membership_) {
    return absl::FailedPreconditionError(absl::StrCat(
        self_.address, " is still resolving ", options_.peers.empty() ? "" : options_.peers[0],
        " and has no ranks yet"));
  }
  std::vector<MemberEvent> events;
  absl::Status status = membership_->Heard(sender, options_.now(), &events);
  Record(std::move(events));
  if (!status.ok()) return status;
  return membership_->self();
}

bool Cluster::Joined() const {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_.has_value();
}

std::vector<MemberInfo> Cluster::Members() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (membership_) return membership_->Snapshot();
  MemberInfo self;
  self.address = self_.address;
  self.state = MemberState::kUp;
  self.incarnation = self_.incarnation;
  self.devices = self_.devices;
  self.hostname = self_.hostname;
  self.version = self_.version;
  self.self = true;
  return {self};
}

void Cluster::OnMemberDown(MemberDownFn fn) {
  std::lock_guard<std::mutex> lock(mu_);
  callbacks_.push_back(std::move(fn));
}

}  // namespace cluster
}  // namespace rannc
