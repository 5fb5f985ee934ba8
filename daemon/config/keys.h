// The one registry of configuration keys: every key a rannc.toml file or a RANNC_<KEY>
// environment variable may hold, with its type, default, scope and a line of documentation.
//
// Readers follow it by scope:
//   - kDaemon: ranncd's own options (config/options.h: flags, its TOML file, RANNC_<KEY>).
//   - kJob: read by the client from its TOML file and environment and sent with every job
//     (JobOptions.config); the daemon's job parsers read them (server/, planner/, runtime/).
//   - kClient: the clients' own settings (pyrannc, the C++ SDK, the CLI): where the daemon is,
//     client ranks, tracing, leases.
//   - kRaNNC: RaNNC's keys that rannc has no use for; accepted and ignored, so that a RaNNC
//     user's rannc.toml keeps working.
// A file or a job may hold any registered key; each reader takes its scope and ignores the
// others'. An unregistered key in a TOML file or a job's config is an error that names the
// nearest registered key (DidYouMean). Environment variables are only read for the keys a
// reader knows: RANNC_* variables of other programs (tests, launchers) are not errors.
//
// pyrannc reads a table generated from this registry (python_client/pyrannc/_keys.py, written
// by `rannc keys --python`; a test checks it is current), and docs/config.md is generated from
// it too (`rannc keys --markdown`).
//
//   const ConfigKey* key = FindConfigKey("pipeline_num");  // scope kJob, type kInt
//   absl::Status s = CheckJobKey("pipline_num");  // INVALID_ARGUMENT: ... did you mean ...
//
// Immutable static data; every function is safe from any thread.
#ifndef RANNC_DAEMON_CONFIG_KEYS_H_
#define RANNC_DAEMON_CONFIG_KEYS_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace rannc {

enum class KeyScope { kDaemon, kJob, kClient, kRaNNC };
enum class KeyType { kString, kBool, kInt, kFloat, kBytes, kDuration, kList };

struct ConfigKey {
  const char* name;  // lower-case; RANNC_<NAME upper-case> in the environment
  KeyType type;
  KeyScope scope;
  const char* default_value;  // as documentation: "64MiB", "1f1b", "(the planner's choice)"
  const char* doc;            // one line, for people
};

// Every registered key, in the order docs/config.md lists them (by scope, then name).
const std::vector<ConfigKey>& ConfigKeys();

// The key named `name` (lower-case), or nullptr.
const ConfigKey* FindConfigKey(std::string_view name);

// " (did you mean 'pipeline_num'?)" naming the registered key nearest to `name` in edit
// distance, when one is near enough to be a slip; "" otherwise.
std::string DidYouMean(std::string_view name);

// INVALID_ARGUMENT unless `name` is a registered key (any scope), naming `where` it was found
// and the nearest registered key.
absl::Status CheckRegisteredKey(std::string_view name, std::string_view where);

// For a job's config keys: INVALID_ARGUMENT unless `name` is a job key (or one of RaNNC's,
// ignored); a daemon's or a client's key sent as a job key is refused saying where it belongs.
absl::Status CheckJobKey(std::string_view name);

const char* KeyScopeName(KeyScope scope);  // "daemon", "job", "client", "rannc"
const char* KeyTypeName(KeyType type);     // "string", "bool", "int", "float", "bytes", ...

// The registry as a Markdown table (docs/config.md) and as the Python module pyrannc reads.
std::string ConfigKeysMarkdown();
std::string ConfigKeysPython();

}  // namespace rannc

#endif  // RANNC_DAEMON_CONFIG_KEYS_H_
