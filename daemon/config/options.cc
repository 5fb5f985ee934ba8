#include "daemon/config/options.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <climits>
#include <optional>
#include <set>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "daemon/cluster/peers.h"
#include "daemon/common/files.h"
#include "daemon/config/keys.h"
#include "daemon/config/toml_file.h"

extern char** environ;

namespace rannc {
namespace {


// Debian's abseil is built with its own string_view, not std's; the public API takes std's.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr char kHelpOrVersionPayload[] = "rannc.dev/HelpOrVersion";
constexpr char kEnvPrefix[] = "RANNC_";
constexpr char kConfFileName[] = "rannc.toml";
constexpr char kDevicesHint[] = "expected cpu:N, cuda or cuda:I,J (I/N: GPU I as N devices)";
constexpr int kMaxCpuDevices = 1024;
constexpr int kMaxGpuShares = 64;

// ---- Per-key checks. Each takes the value as given and may normalise it. -------------------

absl::Status CheckListen(std::string& value) {
  const std::string hint = "; expected host:port, [v6addr]:port or unix:/path";
  if (absl::StartsWith(value, "unix:")) {
    if (value.size() == 5) return absl::InvalidArgumentError("empty unix socket path" + hint);
    return absl::OkStatus();
  }
  const size_t colon = value.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("invalid address '", value, "'", hint));
  }
  const std::string host = value.substr(0, colon);
  if (host.front() == '[' && host.back() != ']') {
    return absl::InvalidArgumentError(absl::StrCat("invalid address '", value, "'", hint));
  }
  const std::string port = value.substr(colon + 1);
  uint32_t port_number = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), ::isdigit) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid port '", port, "' in address '", value, "'", hint));
  }
  return absl::OkStatus();
}

absl::Status CheckLogFormat(std::string& value) {
  std::string lower = absl::AsciiStrToLower(value);
  if (lower != "text" && lower != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log format '", value, "'; expected text or json"));
  }
  value = lower;
  return absl::OkStatus();
}

absl::Status CheckLogLevel(std::string& value) {
  std::string lower = absl::AsciiStrToLower(value);
  static const std::set<std::string, std::less<>> kLevels = {"trace", "debug", "info", "warn",
                                                             "error"};
  if (!kLevels.count(lower)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown log level '", value, "'; expected trace, debug, info, warn or error"));
  }
  value = lower;
  return absl::OkStatus();
}

absl::Status CheckShmDir(std::string& value) {
  if (!value.empty() && value.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_dir must be an absolute path, or empty to disable it, got '", value, "'"));
  }
  return absl::OkStatus();
}

absl::Status CheckDevicesSyntax(std::string& value);  // below, next to ParseDevices

absl::Status CheckMaxMessageSize(uint64_t value) {
  // gRPC takes the limit as an int.
  if (value == 0 || value > static_cast<uint64_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_size must be between 1 and ",
                                                   INT_MAX, " bytes (gRPC's limit), got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckPeers(std::string& value) {
  if (value.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> peers = cluster::ParsePeerList(value);
  if (!peers.ok()) return peers.status();
  value = absl::StrJoin(*peers, ",");
  return absl::OkStatus();
}

absl::Status CheckClusterStore(std::string& value) {
  if (value.empty() || value == "none") {
    value.clear();
    return absl::OkStatus();
  }
  if (!absl::StartsWith(value, "etcd://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster_store '", value, "' is not etcd://HOST:PORT[,HOST:PORT...]"));
  }
  absl::Status parsed = cluster::ParseEtcdUrl(value).status();
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat("cluster_store: ",
                                                                   parsed.message()));
  return absl::OkStatus();
}

absl::Status CheckAdvertise(std::string& value) {
  if (value.empty()) return absl::OkStatus();
  return cluster::SplitHostPort(value).status();
}

absl::Status CheckClusterSize(uint64_t value) {
  if (value > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster_size must be at most 65536 (0: the length of peers), got ", value));
  }
  return absl::OkStatus();
}

// One daemon key: its name and where it lives in DaemonOptions. Exactly one of the member
// pointers is set; Text/Size/Count/Duration below build them.
struct Key {
  const char* name;  // TOML key; RANNC_<upper> and --<name with '-'> derive from it
  std::string DaemonOptions::*text = nullptr;
  uint64_t DaemonOptions::*size = nullptr;   // a byte size ("2GiB")
  uint64_t DaemonOptions::*count = nullptr;  // a plain non-negative integer
  std::chrono::milliseconds DaemonOptions::*duration = nullptr;
  bool DaemonOptions::*flag = nullptr;  // true/false, 1/0, yes/no; a bare --flag is true
  absl::Status (*check_text)(std::string&) = nullptr;
  absl::Status (*check_number)(uint64_t) = nullptr;  // for size and count
};

Key Text(const char* name, std::string DaemonOptions::*field,
         absl::Status (*check)(std::string&) = nullptr) {
  Key key{name};
  key.text = field;
  key.check_text = check;
  return key;
}

Key Size(const char* name, uint64_t DaemonOptions::*field,
         absl::Status (*check)(uint64_t) = nullptr) {
  Key key{name};
  key.size = field;
  key.check_number = check;
  return key;
}

Key Count(const char* name, uint64_t DaemonOptions::*field, absl::Status (*check)(uint64_t)) {
  Key key{name};
  key.count = field;
  key.check_number = check;
  return key;
}

Key Duration(const char* name, std::chrono::milliseconds DaemonOptions::*field) {
  Key key{name};
  key.duration = field;
  return key;
}

Key Bool(const char* name, bool DaemonOptions::*field) {
  Key key{name};
  key.flag = field;
  return key;
}

const std::vector<Key>& Keys() {
  static const auto* keys = new std::vector<Key>{
      Text("listen", &DaemonOptions::listen, &CheckListen),
      Text("devices", &DaemonOptions::devices, &CheckDevicesSyntax),
      Size("device_memory", &DaemonOptions::device_memory),
      Text("log_level", &DaemonOptions::log_level, &CheckLogLevel),
      Text("log_format", &DaemonOptions::log_format, &CheckLogFormat),
      Size("max_message_size", &DaemonOptions::max_message_size, &CheckMaxMessageSize),
      Text("shm_dir", &DaemonOptions::shm_dir, &CheckShmDir),
      Text("links", &DaemonOptions::links),
      Text("profile_cache", &DaemonOptions::profile_cache),
      Text("state_dir", &DaemonOptions::state_dir),
      Duration("upload_ttl", &DaemonOptions::upload_ttl),
      Duration("queue_aging", &DaemonOptions::queue_aging),
      Text("peers", &DaemonOptions::peers, &CheckPeers),
      Text("advertise", &DaemonOptions::advertise, &CheckAdvertise),
      Count("cluster_size", &DaemonOptions::cluster_size, &CheckClusterSize),
      Text("cluster_store", &DaemonOptions::cluster_store, &CheckClusterStore),
      Duration("cluster_lease", &DaemonOptions::cluster_lease),
      Text("cluster_store_cert", &DaemonOptions::cluster_store_cert),
      Text("cluster_store_key", &DaemonOptions::cluster_store_key),
      Text("cluster_store_ca", &DaemonOptions::cluster_store_ca),
      Duration("heartbeat_interval", &DaemonOptions::heartbeat_interval),
      Duration("peer_timeout", &DaemonOptions::peer_timeout),
      Text("tls_cert", &DaemonOptions::tls_cert),
      Text("tls_key", &DaemonOptions::tls_key),
      Text("tls_ca", &DaemonOptions::tls_ca),
      Duration("tls_refresh", &DaemonOptions::tls_refresh),
      Text("auth_token_file", &DaemonOptions::auth_token_file),
      Bool("insecure", &DaemonOptions::insecure),
      Text("metrics_listen", &DaemonOptions::metrics_listen),
      Text("health_listen", &DaemonOptions::health_listen),
      Duration("stop_timeout", &DaemonOptions::stop_timeout),
  };
  return *keys;
}

std::string FlagName(const Key& key) {
  std::string flag = absl::StrCat("--", key.name);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::string EnvName(const Key& key) {
  return absl::StrCat(kEnvPrefix, absl::AsciiStrToUpper(key.name));
}

// Sets `key` from a string value; `source` (the flag, variable, or key and file) prefixes
// errors so the user knows which layer to fix.
absl::Status ApplyText(const Key& key, std::string value, const std::string& source,
                       DaemonOptions& options) {
  auto fail = [&](const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", status.message()));
  };
  if (key.size != nullptr || key.count != nullptr) {
    uint64_t number = 0;
    if (key.size != nullptr) {
      absl::StatusOr<uint64_t> size = ParseByteSize(value);
      if (!size.ok()) return fail(size.status());
      number = *size;
    } else if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(value), &number)) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("'", value, "' is not a whole number >= 0")));
    }
    if (key.check_number != nullptr) {
      if (absl::Status status = key.check_number(number); !status.ok()) return fail(status);
    }
    options.*(key.size != nullptr ? key.size : key.count) = number;
    return absl::OkStatus();
  }
  if (key.flag != nullptr) {
    const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(value));
    if (lower == "true" || lower == "1" || lower == "yes" || lower == "on") {
      options.*key.flag = true;
    } else if (lower == "false" || lower == "0" || lower == "no" || lower == "off") {
      options.*key.flag = false;
    } else {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("'", value, "' is not true or false (1 or 0)")));
    }
    return absl::OkStatus();
  }
  if (key.duration != nullptr) {
    absl::StatusOr<std::chrono::milliseconds> duration = ParseDuration(value);
    if (!duration.ok()) return fail(duration.status());
    options.*key.duration = *duration;
    return absl::OkStatus();
  }
  if (key.check_text != nullptr) {
    if (absl::Status status = key.check_text(value); !status.ok()) return fail(status);
  }
  options.*key.text = std::move(value);
  return absl::OkStatus();
}

const char* TomlTypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a floating-point number";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time:
      return "a date/time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

// ---- Layers. -------------------------------------------------------------------------------

// The TOML file to read, or "" for none. NOT_FOUND for a missing --config file.
absl::StatusOr<std::string> FindConfigFile(const std::optional<std::string>& flag,
                                           const std::map<std::string, std::string>& env) {
  if (flag.has_value()) {
    if (!IsRegularFile(*flag)) {
      return absl::NotFoundError(absl::StrCat("--config: file '", *flag, "' not found"));
    }
    return *flag;
  }
  auto conf_dir = env.find("RANNC_CONF_DIR");
  if (conf_dir != env.end() && !conf_dir->second.empty()) {
    if (!IsDirectory(conf_dir->second)) {
      return absl::InvalidArgumentError(
          absl::StrCat("RANNC_CONF_DIR: '", conf_dir->second, "' is not a directory"));
    }
    const std::string file = JoinPath(conf_dir->second, kConfFileName);
    return PathExists(file) ? file : std::string();
  }
  auto home = env.find("HOME");
  if (home != env.end() && !home->second.empty()) {
    const std::string file = JoinPath(JoinPath(home->second, ".rannc"), kConfFileName);
    return PathExists(file) ? file : std::string();
  }
  return std::string();
}

absl::Status ApplyTomlFile(const std::string& path, DaemonOptions& options) {
  absl::StatusOr<toml::table> parsed = ReadTomlFile(path);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat("config file ", parsed.status().message()));
  }
  const toml::table& table = *parsed;
  for (auto&& [toml_key, node] : table) {
    const std::string name(toml_key.str());
    const std::string source =
        absl::StrCat("'", name, "' in ", path, " (line ", node.source().begin.line, ")");
    if (node.is_table()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, " is a section; rannc.toml's keys are at the top level (docs/config.md)"));
    }
    auto key =
        std::find_if(Keys().begin(), Keys().end(), [&](const Key& k) { return name == k.name; });
    if (key == Keys().end()) {
      // One file serves the daemon and its clients: their keys (config/keys.h) are theirs.
      const ConfigKey* registered = FindConfigKey(name);
      if (registered != nullptr && registered->scope != KeyScope::kDaemon) continue;
      return CheckRegisteredKey(
          name, absl::StrCat(path, " (line ", node.source().begin.line, ")"));
    }
    const bool number_key = key->size != nullptr || key->count != nullptr;
    if (node.is_string()) {
      absl::Status status = ApplyText(*key, node.as_string()->get(), source, options);
      if (!status.ok()) return status;
    } else if (number_key && node.is_integer()) {
      const int64_t value = node.as_integer()->get();
      if (value < 0) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": negative value ", value));
      }
      absl::Status status = ApplyText(*key, absl::StrCat(value), source, options);
      if (!status.ok()) return status;
    } else if (key->flag != nullptr && node.is_boolean()) {
      absl::Status status =
          ApplyText(*key, node.as_boolean()->get() ? "true" : "false", source, options);
      if (!status.ok()) return status;
    } else if (key->text == &DaemonOptions::peers && node.is_array()) {
      // peers = ["h1:7411", "h2:7411"] reads better in a file than one long string.
      std::vector<std::string> entries;
      for (const toml::node& entry : *node.as_array()) {
        if (!entry.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              source, ": expected an array of \"host:port\" strings, got ", TomlTypeName(entry),
              " in it"));
        }
        entries.push_back(entry.as_string()->get());
      }
      absl::Status status = ApplyText(*key, absl::StrJoin(entries, ","), source, options);
      if (!status.ok()) return status;
    } else {
      const char* expected =
          key->size != nullptr       ? "an integer number of bytes or a size string such as \"2GiB\""
          : key->count != nullptr    ? "an integer"
          : key->duration != nullptr ? "a duration string such as \"1s\" or \"500ms\""
          : key->flag != nullptr     ? "true or false"
          : key->text == &DaemonOptions::peers ? "a string or an array of strings"
                                               : "a string";
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": expected ", expected, ", got ", TomlTypeName(node)));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyEnvironment(const std::map<std::string, std::string>& env,
                              DaemonOptions& options) {
  for (const Key& key : Keys()) {
    const std::string name = EnvName(key);
    auto it = env.find(name);
    if (it == env.end()) continue;
    absl::Status status = ApplyText(key, it->second, name, options);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status HelpOrVersion(std::string text) {
  absl::Status status(absl::StatusCode::kCancelled, text);
  status.SetPayload(kHelpOrVersionPayload, absl::Cord("1"));
  return status;
}

// ---- Devices. ------------------------------------------------------------------------------

// A devices spec, parsed but not yet checked against the GPUs present.
struct DevicesSyntax {
  enum class Form { kAuto, kCpu, kAllCuda, kCudaList } form = Form::kAuto;
  int cpu_count = 0;
  std::vector<int> cuda_indices;
  std::vector<int> cuda_shares;  // per index: the plan devices sharing that GPU ("I/N")
};

// Errors name the problem only; callers add the spec and where it came from.
absl::StatusOr<DevicesSyntax> ParseDevicesSyntax(absl::string_view spec) {
  DevicesSyntax syntax;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(spec);
  if (trimmed.empty()) return syntax;
  const size_t colon = trimmed.find(':');
  const std::string type =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(trimmed.substr(0, colon)));
  const absl::string_view rest =
      colon == absl::string_view::npos ? absl::string_view() : trimmed.substr(colon + 1);
  if (type == "cpu") {
    syntax.form = DevicesSyntax::Form::kCpu;
    if (colon == absl::string_view::npos) {
      syntax.cpu_count = 1;
      return syntax;
    }
    const absl::string_view count = absl::StripAsciiWhitespace(rest);
    if (!absl::SimpleAtoi(count, &syntax.cpu_count) || syntax.cpu_count < 1 ||
        syntax.cpu_count > kMaxCpuDevices) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CPU device count '", count, "' is not a number from 1 to ", kMaxCpuDevices));
    }
    return syntax;
  }
  if (type == "cuda") {
    if (colon == absl::string_view::npos) {
      syntax.form = DevicesSyntax::Form::kAllCuda;
      return syntax;
    }
    syntax.form = DevicesSyntax::Form::kCudaList;
    for (absl::string_view item : absl::StrSplit(rest, ',')) {
      item = absl::StripAsciiWhitespace(item);
      // "I/N": GPU I as N plan devices (tests of multi-device plans on fewer GPUs).
      int shares = 1;
      const size_t slash = item.find('/');
      if (slash != absl::string_view::npos) {
        const absl::string_view count = absl::StripAsciiWhitespace(item.substr(slash + 1));
        if (!absl::SimpleAtoi(count, &shares) || shares < 1 || shares > kMaxGpuShares) {
          return absl::InvalidArgumentError(absl::StrCat(
              "CUDA device share count '", count, "' is not a number from 1 to ",
              kMaxGpuShares));
        }
        item = absl::StripAsciiWhitespace(item.substr(0, slash));
      }
      int index = -1;
      if (!absl::SimpleAtoi(item, &index) || index < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("CUDA device index '", item, "' is not a number >= 0"));
      }
      if (std::find(syntax.cuda_indices.begin(), syntax.cuda_indices.end(), index) !=
          syntax.cuda_indices.end()) {
        return absl::InvalidArgumentError(absl::StrCat("CUDA device ", index, " given twice"));
      }
      syntax.cuda_indices.push_back(index);
      syntax.cuda_shares.push_back(shares);
    }
    return syntax;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown device type '", type, "'"));
}

absl::Status CheckDevicesSyntax(std::string& value) {
  absl::StatusOr<DevicesSyntax> syntax = ParseDevicesSyntax(value);
  if (!syntax.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(syntax.status().message(), " in devices '", value, "'; ", kDevicesHint));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Public functions. ---------------------------------------------------------------------

std::vector<std::string> DaemonOptionKeys() {
  std::vector<std::string> names;
  for (const Key& k : Keys()) names.push_back(k.name);
  return names;
}

bool IsHelpOrVersion(const absl::Status& status) {
  return status.code() == absl::StatusCode::kCancelled &&
         status.GetPayload(kHelpOrVersionPayload).has_value();
}

std::map<std::string, std::string> ProcessEnvironment() {
  std::map<std::string, std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
  }
  return env;
}

absl::StatusOr<DaemonOptions> LoadDaemonOptions(int argc, char** argv,
                                                const std::map<std::string, std::string>& env,
                                                std::string_view version) {
  CLI::App app(
      "ranncd: the rannc training daemon. Takes TorchScript models from clients and "
      "trains them over the devices it owns.",
      "ranncd");
  // Unix convention (and what scripts that append flags expect): the last value wins.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  struct FlagValue {
    const Key* key;
    std::string value;
    CLI::Option* option;
  };
  const std::map<std::string, std::string> descriptions = {
      {"listen", "gRPC address: host:port, [v6addr]:port or unix:/path (default 127.0.0.1:7411)"},
      {"devices", "devices to own: cpu:N, cuda or cuda:I,J (I/N: GPU I as N devices; default: "
                  "every CUDA GPU, else cpu:1)"},
      {"device_memory", "memory budget per device, e.g. 2GiB (default: the device's size)"},
      {"log_level", "trace, debug, info, warn or error (default info)"},
      {"log_format", "text, or json: a JSON object per line, with the job (default text)"},
      {"max_message_size", "largest client message, e.g. 64MiB (default 64MiB)"},
      {"shm_dir", "directory for same-host tensor transfer, \"\" disables (default /dev/shm)"},
      {"links", "link speeds for the planner, e.g. p2p=5GB/s,allreduce=2:3GB/s (default: "
                "measured at start)"},
      {"profile_cache", "file keeping profiles between runs; none disables (default "
                        "~/.cache/rannc/profiles.tsv)"},
      {"state_dir", "directory keeping durable jobs' records; none disables (default "
                    "~/.local/state/rannc)"},
      {"upload_ttl", "remove an uploaded file no submitted job names once unwritten for this "
                     "long (default 1h)"},
      {"queue_aging", "a queued detached job counts one priority higher for each such time it "
                      "has waited (default 1h)"},
      {"peers", "every daemon of the cluster, this one included: h1:p1,h2:p2,... or one "
                "NAME:PORT resolving to all (with --cluster-size) (default: this daemon alone)"},
      {"advertise", "this daemon's address in --peers (default the --listen address)"},
      {"cluster_size", "daemons a --peers name must resolve to (default: the length of --peers)"},
      {"cluster_store", "etcd://HOST:PORT[,...]: etcd keeps members' liveness, jobs' "
                        "rendezvous and the registry of jobs that fail over (default: none)"},
      {"cluster_lease", "with --cluster-store: this daemon's etcd lease; lost for this long, its "
                        "jobs are taken over (default 10s)"},
      {"cluster_store_cert", "TLS to etcd: the PEM client certificate to present (with "
                             "--cluster-store-key)"},
      {"cluster_store_key", "TLS to etcd: the PEM private key of --cluster-store-cert"},
      {"cluster_store_ca", "TLS to etcd: the PEM CA that signed etcd's certificate"},
      {"heartbeat_interval", "how often to heartbeat each peer (default 1s)"},
      {"peer_timeout", "silence after which a peer is DOWN (default 10s)"},
      {"tls_cert", "PEM certificate chain: serve TLS (with --tls-key; default: plain text)"},
      {"tls_key", "PEM private key of --tls-cert"},
      {"tls_ca", "PEM CA certificate(s): the other daemons' certificates (mutual TLS) and "
                 "clients' that present one must chain to it"},
      {"tls_refresh", "how often the TLS files are read again, for rotation (default 10s)"},
      {"auth_token_file", "file whose first line is the admin token; calls then need a token "
                          "(docs/security.md; default: none)"},
      {"insecure", "allow a --listen address other than loopback without TLS and tokens (logs "
                   "a warning)"},
      {"metrics_listen", "serve Prometheus metrics at http://HOST:PORT/metrics (default: none)"},
      {"health_listen", "serve the gRPC health service alone, in plain text, on HOST:PORT (for "
                        "Kubernetes' probes; default: none)"},
      {"stop_timeout", "after SIGTERM or SIGINT, exit by then whatever is still running; a second "
                       "signal exits at once (default 10m)"},
  };
  const std::map<std::string, std::string> type_names = {
      {"listen", "ADDRESS"},  {"devices", "SPEC"},          {"device_memory", "SIZE"},
      {"log_level", "LEVEL"}, {"max_message_size", "SIZE"}, {"shm_dir", "DIR"},
      {"links", "SPEEDS"},    {"profile_cache", "FILE"},       {"peers", "LIST"},
      {"state_dir", "DIR"},     {"upload_ttl", "DURATION"},   {"queue_aging", "DURATION"},
      {"advertise", "HOST:PORT"}, {"cluster_size", "N"},       {"heartbeat_interval", "DURATION"},
      {"cluster_store", "URL"},      {"cluster_lease", "DURATION"},
      {"peer_timeout", "DURATION"},
      {"tls_cert", "FILE"}, {"tls_key", "FILE"}, {"tls_ca", "FILE"}, {"tls_refresh", "DURATION"},
      {"cluster_store_cert", "FILE"}, {"cluster_store_key", "FILE"}, {"cluster_store_ca", "FILE"},
      {"auth_token_file", "FILE"}, {"insecure", "BOOL"},
      {"log_format", "FORMAT"}, {"metrics_listen", "HOST:PORT"}, {"health_listen", "HOST:PORT"},
      {"stop_timeout", "DURATION"},
  };
  std::vector<FlagValue> flags;
  flags.reserve(Keys().size());
  for (const Key& key : Keys()) {
    flags.push_back({&key, "", nullptr});
    FlagValue& flag = flags.back();
    flag.option = app.add_option(FlagName(key), flag.value, descriptions.at(key.name))
                      ->type_name(type_names.at(key.name));
    // "" is a meaningful value for these (disable, automatic); CLI11 would otherwise reject
    // the `--shm-dir=` spelling of it.
    if (key.text == &DaemonOptions::shm_dir || key.text == &DaemonOptions::devices ||
        key.text == &DaemonOptions::links || key.text == &DaemonOptions::profile_cache ||
        key.text == &DaemonOptions::state_dir ||
        key.text == &DaemonOptions::peers || key.text == &DaemonOptions::advertise ||
        key.text == &DaemonOptions::cluster_store || key.text == &DaemonOptions::tls_cert ||
        key.text == &DaemonOptions::tls_key || key.text == &DaemonOptions::tls_ca ||
        key.text == &DaemonOptions::auth_token_file ||
        key.text == &DaemonOptions::metrics_listen ||
        key.text == &DaemonOptions::health_listen || key.flag != nullptr) {
      flag.option->expected(0, 1);
    }
  }
  std::string config_flag;
  CLI::Option* config_option =
      app.add_option(
             "--config", config_flag,
             "TOML file to read (default $RANNC_CONF_DIR/rannc.toml, else ~/.rannc/rannc.toml)")
          ->type_name("FILE");
  app.set_version_flag(
      "--version", absl::StrCat("ranncd ", version.empty() ? "(unversioned)" : ToAbsl(version)));
  app.footer(
      "Every option can also be set in the TOML file by its key (listen, devices, device_memory, "
      "log_level, log_format, max_message_size, shm_dir, links, profile_cache, state_dir, "
      "upload_ttl, queue_aging, peers, "
      "advertise, "
      "cluster_size, cluster_store, cluster_lease, cluster_store_cert, cluster_store_key, "
      "cluster_store_ca, heartbeat_interval, peer_timeout, tls_cert, tls_key, tls_ca, "
      "tls_refresh, auth_token_file, insecure, metrics_listen, health_listen, stop_timeout) and in "
      "the "
      "environment as "
      "RANNC_<KEY> (e.g. "
      "RANNC_DEVICE_MEMORY=2GiB). Flags win over the environment, which wins over the file.");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return HelpOrVersion(app.help());
  } catch (const CLI::CallForAllHelp&) {
    return HelpOrVersion(app.help("", CLI::AppFormatMode::All));
  } catch (const CLI::CallForVersion& e) {
    return HelpOrVersion(absl::StrCat(e.what(), "\n"));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat(e.what(), " (see ranncd --help)"));
  }

  DaemonOptions options;
  std::optional<std::string> config_path;
  if (config_option->count() > 0) config_path = config_flag;
  absl::StatusOr<std::string> file = FindConfigFile(config_path, env);
  if (!file.ok()) return file.status();
  if (!file->empty()) {
    absl::Status status = ApplyTomlFile(*file, options);
    if (!status.ok()) return status;
    options.config_file = *file;
  }
  absl::Status status = ApplyEnvironment(env, options);
  if (!status.ok()) return status;
  for (FlagValue& flag : flags) {
    if (flag.option->count() == 0) continue;
    // A bare --insecure means true.
    if (flag.key->flag != nullptr && flag.value.empty()) flag.value = "true";
    status = ApplyText(*flag.key, flag.value, FlagName(*flag.key), options);
    if (!status.ok()) return status;
  }
  return options;
}

absl::StatusOr<uint64_t> ParseByteSize(std::string_view std_text) {
  const absl::string_view text = ToAbsl(std_text);
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid size '", text, "': ", why,
        "; expected bytes, or a number with a unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB "
        "(e.g. 512MiB, 1.5GB)"));
  };
  if (trimmed.empty()) return invalid("empty");
  if (trimmed.front() == '-') return invalid("negative");

  size_t pos = 0;
  unsigned __int128 whole = 0;
  size_t whole_digits = 0;
  for (; pos < trimmed.size() && absl::ascii_isdigit(trimmed[pos]); ++pos, ++whole_digits) {
    whole = whole * 10 + static_cast<unsigned>(trimmed[pos] - '0');
    if (whole > UINT64_MAX) return invalid("larger than 2^64-1 bytes");
  }
  // Digits past the 18th cannot change the result by a whole byte for any unit here (< 2^41).
  uint64_t fraction = 0;
  uint64_t fraction_scale = 1;
  size_t fraction_digits = 0;
  if (pos < trimmed.size() && trimmed[pos] == '.') {
    for (++pos; pos < trimmed.size() && absl::ascii_isdigit(trimmed[pos]); ++pos) {
      if (++fraction_digits <= 18) {
        fraction = fraction * 10 + static_cast<uint64_t>(trimmed[pos] - '0');
        fraction_scale *= 10;
      }
    }
  }
  if (whole_digits == 0 && fraction_digits == 0) return invalid("no number");

  const absl::string_view unit_text = absl::StripLeadingAsciiWhitespace(trimmed.substr(pos));
  const std::string unit = absl::AsciiStrToLower(unit_text);
  static const std::map<std::string, uint64_t>* kUnits = new std::map<std::string, uint64_t>{
      {"", 1},
      {"b", 1},
      {"kb", 1000ull},
      {"mb", 1000ull * 1000},
      {"gb", 1000ull * 1000 * 1000},
      {"tb", 1000ull * 1000 * 1000 * 1000},
      {"kib", 1ull << 10},
      {"mib", 1ull << 20},
      {"gib", 1ull << 30},
      {"tib", 1ull << 40},
  };
  auto multiplier = kUnits->find(unit);
  if (multiplier == kUnits->end()) {
    return invalid(absl::StrCat("unknown unit '", unit_text, "'"));
  }
  const unsigned __int128 bytes =
      whole * multiplier->second +
      static_cast<unsigned __int128>(fraction) * multiplier->second / fraction_scale;
  if (bytes > UINT64_MAX) return invalid("larger than 2^64-1 bytes");
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<std::chrono::milliseconds> ParseDuration(std::string_view std_text) {
  const absl::string_view text = absl::StripAsciiWhitespace(ToAbsl(std_text));
  absl::Duration duration;
  // absl accepts a bare "0" and units down to ns; a duration here needs a unit and >= 1 ms.
  if (!absl::ParseDuration(text, &duration) || text == "0" ||
      duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid duration '", text, "'; expected a number with a unit ms, s, m or h (e.g. 500ms, "
        "1.5s)"));
  }
  if (duration < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration '", text, "' must be at least 1ms"));
  }
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(duration));
}

std::string DeviceName(const DeviceSpec& device) {
  return absl::StrCat(device.type, ":", device.index);
}

absl::StatusOr<std::vector<DeviceSpec>> ParseDevices(std::string_view std_spec, int cuda_count) {
  const absl::string_view spec = ToAbsl(std_spec);
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(why, " in devices '", spec, "'; ", kDevicesHint));
  };
  absl::StatusOr<DevicesSyntax> syntax = ParseDevicesSyntax(spec);
  if (!syntax.ok()) return invalid(syntax.status().message());

  std::vector<DeviceSpec> devices;
  switch (syntax->form) {
    case DevicesSyntax::Form::kAuto:
      if (cuda_count <= 0) return std::vector<DeviceSpec>{{"cpu", 0}};
      for (int i = 0; i < cuda_count; ++i) devices.push_back({"cuda", i});
      return devices;
    case DevicesSyntax::Form::kCpu:
      for (int i = 0; i < syntax->cpu_count; ++i) devices.push_back({"cpu", i});
      return devices;
    case DevicesSyntax::Form::kAllCuda:
      if (cuda_count <= 0) return invalid("no CUDA devices are present");
      for (int i = 0; i < cuda_count; ++i) devices.push_back({"cuda", i});
      return devices;
    case DevicesSyntax::Form::kCudaList:
      for (size_t k = 0; k < syntax->cuda_indices.size(); ++k) {
        const int index = syntax->cuda_indices[k];
        if (index >= cuda_count) {
          return invalid(absl::StrCat("CUDA device ", index, " is not present (",
                                      std::max(cuda_count, 0), " found)"));
        }
        const int shares = syntax->cuda_shares[k];
        for (int i = 0; i < shares; ++i) devices.push_back({"cuda", index, shares});
      }
      return devices;
  }
  return invalid("unhandled form");
}

}  // namespace rannc
