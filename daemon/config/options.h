// The daemon's own options (ranncd), merged from defaults, a TOML file, RANNC_* environment
// variables and command-line flags, plus the parsers for the values they hold (byte sizes,
// device lists).
//
// Precedence, lowest to highest: defaults < TOML file < RANNC_<KEY> environment < flags.
//
// TOML file: --config FILE if given, else $RANNC_CONF_DIR/rannc.toml if RANNC_CONF_DIR is set,
// else $HOME/.rannc/rannc.toml. A missing default file is fine; a missing --config file, a
// RANNC_CONF_DIR that is not a directory, or a parse error is an error. Keys are the field
// names below (listen, devices, device_memory, log_level, log_format, max_message_size, shm_dir,
// links, profile_cache, state_dir, upload_ttl, queue_aging, peers, advertise, cluster_size,
// cluster_store, cluster_lease, cluster_store_cert, cluster_store_key, cluster_store_ca,
// heartbeat_interval, peer_timeout, tls_cert, tls_key, tls_ca, tls_refresh, auth_token_file,
// insecure, metrics_listen, health_listen, stop_timeout) at the top level; `peers` may also be
// an array of strings. The same file may hold any other key of the registry (config/keys.h: a
// job's keys, the clients', RaNNC's), which are ignored here; an unregistered key is an error
// naming the key, the file and the nearest registered key.
//
// Environment: RANNC_ + upper-case key (RANNC_DEVICE_MEMORY=2GiB). A variable that is set
// counts even when empty (RANNC_SHM_DIR= disables shared memory). Other RANNC_* variables
// (the client's, e.g. RANNC_DAEMON, RANNC_PARTITION_NUM) are ignored: an embedded daemon
// inherits its client's environment.
//
// Flags (CLI11): --listen, --devices, --device-memory, --log-level, --log-format,
// --max-message-size, --shm-dir, --links, --profile-cache, --state-dir, --upload-ttl,
// --queue-aging, --peers, --advertise, --cluster-size, --cluster-store, --cluster-lease,
// --cluster-store-cert, --cluster-store-key, --cluster-store-ca, --heartbeat-interval,
// --peer-timeout, --tls-cert, --tls-key, --tls-ca, --tls-refresh, --auth-token-file, --insecure,
// --metrics-listen, --health-listen, --stop-timeout, --config, --help, --version.
// `--flag VALUE` and `--flag=VALUE` both work; a flag given twice takes the last value; unknown
// flags and positional arguments are errors naming them.
//
// Sizes (device_memory, max_message_size) accept an integer number of bytes, or a string: a
// number, optionally fractional, and an optional unit, B, KB, MB, GB, TB (powers of 1000) or
// KiB, MiB, GiB, TiB (powers of 1024), case-insensitive ("512MiB", "2GiB", "1.5GB", "1024").
// Fractional bytes are rounded down.
//
// Durations (upload_ttl, queue_aging, cluster_lease, heartbeat_interval, peer_timeout,
// tls_refresh, stop_timeout) are a number with a unit, ms, s, m or h ("500ms", "1.5s"), at least
// 1 ms, rounded down to whole milliseconds.
//
// Thread-safety: every function here is a pure function of its arguments (it reads the TOML
// file and nothing else; the environment comes in as a map), safe from any thread.
//
// Usage (main.cc):
//   auto options = rannc::LoadDaemonOptions(argc, argv, rannc::ProcessEnvironment(), "0.1.0");
//   if (rannc::IsHelpOrVersion(options.status())) {
//     std::cout << options.status().message();  // the help or version text
//     return 0;
//   }
//   if (!options.ok()) {
//     std::cerr << "ranncd: " << options.status().message() << "\n";
//     return 2;
//   }
//   auto devices = rannc::ParseDevices(options->devices, cuda_device_count);
#ifndef RANNC_DAEMON_CONFIG_OPTIONS_H_
#define RANNC_DAEMON_CONFIG_OPTIONS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {

struct DaemonOptions {
  // gRPC address to serve on: "host:port", "[v6addr]:port" or "unix:/path".
  // Default "127.0.0.1:7411" (local clients only).
  std::string listen = "127.0.0.1:7411";

  // Devices this daemon owns: "cpu:N" (N CPU virtual devices; "cpu" = "cpu:1"), "cuda" (every
  // CUDA GPU) or "cuda:I,J" (those GPUs; "I/N" makes GPU I N devices, for tests of plans with
  // more devices than there are GPUs). Default "": every CUDA GPU if there is one, else
  // cpu:1. Only the syntax is checked when loading; ParseDevices resolves it at start.
  std::string devices = "";

  // Memory budget per device in bytes that the planner may use. Default 0: the device's real
  // size.
  uint64_t device_memory = 0;

  // spdlog level: trace, debug, info, warn or error (case-insensitive; stored lower-case).
  // Default "info".
  std::string log_level = "info";
  // "text" (spdlog's default pattern), or "json": one object per line with time, level, logger,
  // job (the job a line is about, when it names one) and message. Default "text".
  std::string log_format = "text";

  // Largest client message in bytes; larger ones get RESOURCE_EXHAUSTED. Default 64 MiB. At
  // most 2^31-1, gRPC's limit.
  uint64_t max_message_size = 64ull << 20;

  // Directory for same-host tensor transfer through shared memory. Default "/dev/shm"; ""
  // disables it.
  std::string shm_dir = "/dev/shm";

  // Link speeds for the planner's cost model, e.g. "p2p=5GB/s,allreduce=2:3GB/s;4:2GB/s"
  // (planner/links.h). Default "": measured between the devices at start.
  std::string links = "";

  // File that keeps profiling results between runs, so a model re-plans in seconds. Default "":
  // $RANNC_PROFILE_CACHE, else $XDG_CACHE_HOME/rannc/profiles.tsv, else
  // ~/.cache/rannc/profiles.tsv; "none" keeps them in memory only.
  std::string profile_cache = "";

  // Where durable jobs' records are kept (server/job_records.h): jobs that write checkpoints
  // are listed as suspended after a restart and resume from their latest checkpoint. Default
  // "": $XDG_STATE_HOME/rannc, else ~/.local/state/rannc; "none" keeps no records.
  std::string state_dir = "";

  // An uploaded file (UploadFile, `rannc submit --upload`) that no detached job names is
  // removed once it has not been written for this long: one sent for a submission that never
  // came. Must exceed the time between a client's uploads and its submission. Default 1 h.
  std::chrono::milliseconds upload_ttl{3600 * 1000};

  // A queued detached job counts one priority higher for each this long it has waited
  // (DetachedJobs::set_queue_aging), so that higher-priority submissions cannot hold it back
  // for good. Default 1 h.
  std::chrono::milliseconds queue_aging{3600 * 1000};

  // The cluster (daemon/cluster/peers.h): every daemon's address, this one included,
  // "h1:p1,h2:p2,..." (stored with spaces removed), or one NAME:PORT whose NAME resolves to
  // every daemon (with cluster_size). Default "": this daemon alone.
  std::string peers = "";

  // This daemon's address as the other members reach it, host:port; must be in `peers`.
  // Default "": the listen address (which then must not be 0.0.0.0, [::] or port 0 when
  // `peers` is set).
  std::string advertise = "";

  // How many daemons a DNS name in `peers` must resolve to before ranks are assigned. Default
  // 0: the length of a static `peers` list.
  uint64_t cluster_size = 0;

  // etcd, where the daemons of a cluster keep what they share (cluster/etcd_client.h):
  // "etcd://HOST:PORT[,HOST:PORT...]". Today membership (members' reports under leases,
  // cluster/etcd_transport.h, instead of heartbeats between daemons) and the rendezvous of jobs
  // over several daemons (comm/etcd_store.h). Default "": none.
  std::string cluster_store = "";

  // With cluster_store: the TTL of this daemon's etcd lease (whole seconds, 2 s or more). Its
  // member key, store keys and job leaderships live this long after it last renewed them, so a
  // lost daemon is DOWN, and its jobs are taken over, after at most this long. Default 10 s.
  std::chrono::milliseconds cluster_lease{10000};

  // TLS to etcd (any of them set): the client certificate and key this daemon presents (etcd's
  // --client-cert-auth), and the CA that signed etcd's certificate. Default "": plain text.
  std::string cluster_store_cert = "";
  std::string cluster_store_key = "";
  std::string cluster_store_ca = "";

  // How often this daemon heartbeats every other member. Default 1 s.
  std::chrono::milliseconds heartbeat_interval{1000};

  // A member not heard from for this long is DOWN. Default 10 s; must exceed
  // heartbeat_interval.
  std::chrono::milliseconds peer_timeout{10000};

  // TLS (security/tls.h): this daemon's PEM certificate chain and key (both, or neither: plain
  // text), and the CA that other daemons' certificates (mutual TLS), and clients' when they
  // present one, must chain to. Checked at start. Default "": none.
  std::string tls_cert = "";
  std::string tls_key = "";
  std::string tls_ca = "";
  // How often those files are read again (a rotated certificate is used without a restart).
  // Default 10 s.
  std::chrono::milliseconds tls_refresh{10000};

  // Tokens (security/auth.h): the file whose first line is the admin token. Set, every call
  // needs a token: the admin's, or a job's (CreateJob returns it). Default "": none.
  std::string auth_token_file = "";

  // Listening on an address other than loopback without TLS and tokens is refused unless this
  // is set (then a warning is logged): whoever reaches the port runs code. Default false.
  bool insecure = false;

  // Where to serve Prometheus metrics (http://HOST:PORT/metrics; metrics/metrics.h). Default
  // "": no endpoint.
  std::string metrics_listen = "";

  // A plaintext port serving only the gRPC health service (daemon/health.h), for Kubernetes'
  // gRPC probes, which do not speak TLS. Default "": health on the main port only.
  std::string health_listen = "";

  // After SIGTERM or SIGINT, the longest ranncd takes to stop (detached jobs checkpointed,
  // in-flight calls finished, the jobs' memory freed): past it, it exits with status 1 whatever
  // is still running, saying so; a second signal exits so at once (main.cc). Default 10 min.
  std::chrono::milliseconds stop_timeout{600 * 1000};

  // The TOML file the options were read from; "" when none was found. Output only: the file is
  // chosen by --config or RANNC_CONF_DIR, never by a key.
  std::string config_file;
};

// Loads the options from flags (argv[0] is the program name), the environment `env` (name ->
// value, see ProcessEnvironment) and the TOML file. Errors are INVALID_ARGUMENT (NOT_FOUND for
// a missing --config file) with a message naming where the bad value came from: the flag, the
// variable, or the file and key. For --help or --version, returns a status for which
// IsHelpOrVersion is true and whose message is the text to print (then exit with 0); `version`
// is what --version prints after "ranncd ".
absl::StatusOr<DaemonOptions> LoadDaemonOptions(int argc, char** argv,
                                                const std::map<std::string, std::string>& env,
                                                std::string_view version = "");

// The keys LoadDaemonOptions reads (each a field above): the registry's daemon keys
// (config/keys.h), which keys_test checks.
std::vector<std::string> DaemonOptionKeys();

// True for the status LoadDaemonOptions returns on --help or --version (code CANCELLED with a
// marker payload, so no other CANCELLED status is taken for it).
bool IsHelpOrVersion(const absl::Status& status);

// This process's environment, for LoadDaemonOptions. Tests pass their own map instead.
std::map<std::string, std::string> ProcessEnvironment();

// Parses a byte size as described at the top ("2GiB" -> 2147483648). INVALID_ARGUMENT for an
// empty, negative or malformed value, an unknown unit, or more than 2^64-1 bytes.
absl::StatusOr<uint64_t> ParseByteSize(std::string_view text);

// Parses a duration as described at the top ("1.5s" -> 1500 ms). INVALID_ARGUMENT for a
// missing unit, a negative, zero or malformed value.
absl::StatusOr<std::chrono::milliseconds> ParseDuration(std::string_view text);

struct DeviceSpec {
  std::string type;  // "cpu" or "cuda"
  int index = 0;     // 0-based within the type
  // Plan devices that share this GPU ("cuda:0/4": four, each with a quarter of its memory,
  // talking through host memory); 1 for a device of its own.
  int shares = 1;
  bool operator==(const DeviceSpec& other) const {
    return type == other.type && index == other.index && shares == other.shares;
  }
};

// "cpu:0", "cuda:1": the name DeviceInfo.name carries on the wire (each share of a shared GPU
// is named after the GPU).
std::string DeviceName(const DeviceSpec& device);

// Resolves a devices spec against the CUDA GPUs present (`cuda_count`): "cpu:4" -> cpu:0..3;
// "cuda" -> every GPU (error if none); "cuda:0,2" -> those, in the order given (error if one is
// absent or repeated); "cuda:0/4" -> four devices on GPU 0 (shares 4); "" -> every GPU if
// cuda_count > 0, else cpu:0. INVALID_ARGUMENT with the spec and the accepted forms, e.g.
// "unknown device type 'tpu' in devices 'tpu:2'; expected cpu:N, cuda or cuda:I,J (I/N: GPU I as
// N devices)". At most 1024 CPU devices and 64 shares of a GPU.
absl::StatusOr<std::vector<DeviceSpec>> ParseDevices(std::string_view spec, int cuda_count);

}  // namespace rannc

#endif  // RANNC_DAEMON_CONFIG_OPTIONS_H_
