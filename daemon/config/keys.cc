#include "daemon/config/keys.h"

#include <algorithm>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace rannc {
namespace {

using S = KeyScope;
using T = KeyType;

// The registry. Defaults here are what a reader does without the key; each reader keeps the
// value in its own typed field (DaemonOptions, planner::PlannerConfig, ...), documented there
// with this key's name.
std::vector<ConfigKey>* MakeRegistry() {
  auto* keys = new std::vector<ConfigKey>{
      // ---- ranncd (config/options.h) ----
      {"listen", T::kString, S::kDaemon, "127.0.0.1:7411",
       "gRPC address ranncd serves on: host:port, [v6addr]:port or unix:/path (port 0 picks one)"},
      {"devices", T::kString, S::kDaemon,
       "every GPU, else cpu:1 (pyrannc's embedded ranncd: cpu:2)",
       "devices ranncd owns: cpu:N, cuda, cuda:I,J, or cuda:I/N (GPU I as N devices, for tests)"},
      {"device_memory", T::kBytes, S::kDaemon, "the device's size",
       "memory per device the planner may use (\"2GiB\")"},
      {"log_level", T::kString, S::kDaemon, "info", "trace, debug, info, warn or error"},
      {"log_format", T::kString, S::kDaemon, "text",
       "text, or json: one JSON object per line with time, level, logger, job and message, for "
       "log collectors"},
      {"max_message_size", T::kBytes, S::kDaemon, "64MiB",
       "largest client message; larger ones get RESOURCE_EXHAUSTED"},
      {"shm_dir", T::kString, S::kDaemon, "/dev/shm",
       "directory for same-host tensor transfer through shared memory; empty disables it"},
      {"links", T::kString, S::kDaemon, "measured at start",
       "link speeds for the planner's cost model, e.g. \"p2p=5GB/s,allreduce=2:3GB/s;4:2GB/s\""},
      {"profile_cache", T::kString, S::kDaemon, "~/.cache/rannc/profiles.tsv",
       "file that keeps profiling results between runs; \"none\" keeps them in memory"},
      {"state_dir", T::kString, S::kDaemon, "~/.local/state/rannc",
       "directory keeping durable jobs' records (those writing checkpoints); none disables"},
      {"upload_ttl", T::kDuration, S::kDaemon, "1h",
       "an uploaded file no submitted job names is removed once unwritten for this long"},
      {"queue_aging", T::kDuration, S::kDaemon, "1h",
       "a queued detached job counts one priority higher for each such time it has waited"},
      {"peers", T::kList, S::kDaemon, "this daemon alone",
       "every daemon of the cluster, this one included (h1:p1,h2:p2), or one NAME:PORT that "
       "resolves to them all"},
      {"advertise", T::kString, S::kDaemon, "the listen address",
       "this daemon's address as the other members reach it; must be in peers"},
      {"cluster_size", T::kInt, S::kDaemon, "0 (the length of peers)",
       "how many daemons a DNS name in peers must resolve to"},
      {"cluster_store", T::kString, S::kDaemon, "none (no shared store)",
       "etcd://HOST:PORT[,HOST:PORT...]: etcd holds the members' liveness, the rendezvous of "
       "jobs over several daemons and the registry of jobs that fail over (docs/cluster.md)"},
      {"cluster_lease", T::kDuration, S::kDaemon, "10s",
       "with cluster_store: each daemon's etcd lease (whole seconds, at least 2s); a daemon "
       "lost for this long is DOWN and its jobs are taken over by the others"},
      {"cluster_store_cert", T::kString, S::kDaemon, "none (plain text to etcd)",
       "TLS to etcd: the PEM client certificate ranncd presents (with cluster_store_key)"},
      {"cluster_store_key", T::kString, S::kDaemon, "none",
       "TLS to etcd: the PEM private key of cluster_store_cert"},
      {"cluster_store_ca", T::kString, S::kDaemon, "none",
       "TLS to etcd: the PEM CA that signed etcd's certificate"},
      {"heartbeat_interval", T::kDuration, S::kDaemon, "1s",
       "how often each daemon heartbeats the others"},
      {"peer_timeout", T::kDuration, S::kDaemon, "10s",
       "a member not heard from for this long is DOWN; must exceed heartbeat_interval"},
      {"tls_cert", T::kString, S::kDaemon, "none (plain text)",
       "PEM certificate chain ranncd serves TLS with (with tls_key); clients (pyrannc, the SDK, "
       "the CLI) given one present it (mutual TLS)"},
      {"tls_key", T::kString, S::kDaemon, "none", "PEM private key of tls_cert"},
      {"tls_ca", T::kString, S::kDaemon, "none",
       "PEM CA certificate(s): clients verify ranncd with it; ranncd verifies the other "
       "daemons' certificates (mutual TLS), and clients' when they present one"},
      {"tls_refresh", T::kDuration, S::kDaemon, "10s",
       "how often ranncd reads its TLS files again (a rotated certificate needs no restart)"},
      {"auth_token_file", T::kString, S::kDaemon, "none (no tokens)",
       "file whose first line is the admin token; every call then needs a token: the admin's, "
       "or the job's that CreateJob returns (docs/security.md)"},
      {"insecure", T::kBool, S::kDaemon, "false",
       "allow listening on an address other than loopback without TLS and tokens (a warning "
       "is logged): whoever reaches the port runs code"},
      {"metrics_listen", T::kString, S::kDaemon, "none (no metrics endpoint)",
       "HOST:PORT where ranncd serves Prometheus metrics at /metrics (docs/observability.md)"},
      {"health_listen", T::kString, S::kDaemon, "none (health on the main port only)",
       "HOST:PORT of a plaintext port serving only the gRPC health service (\"\": live; "
       "\"rannc.ready\": joined its cluster), for Kubernetes' gRPC probes, which cannot do TLS"},
      {"stop_timeout", T::kDuration, S::kDaemon, "10m",
       "after SIGTERM or SIGINT, ranncd exits (status 1) by then whatever is still running; a "
       "second signal exits at once"},
      // ---- a job (sent with CreateJob; planner/planner.h, runtime/loss_scale.h, server/) ----
      {"partition_num", T::kInt, S::kJob, "0 (the planner's choice)", "pipeline stages"},
      {"pipeline_num", T::kInt, S::kJob, "0 (the planner's choice)", "micro-batches per step"},
      {"replica_num", T::kInt, S::kJob, "0 (the planner's choice)",
       "data-parallel replicas of every stage"},
      {"max_pipeline", T::kInt, S::kJob, "32", "the most micro-batches the planner searches"},
      {"mem_margin", T::kFloat, S::kJob, "0.1", "fraction of each device's memory kept free"},
      {"schedule", T::kString, S::kJob, "1f1b", "pipeline schedule: 1f1b or gpipe"},
      {"coarsen_blocks", T::kInt, S::kJob, "32",
       "blocks the planner's search splits the model into"},
      {"use_all_devices", T::kBool, S::kJob, "true when the model can use them all",
       "plans use every device; false lets the planner leave devices idle when fewer are faster"},
      {"verify_partitioning", T::kBool, S::kJob, "false",
       "check at job creation that the stages compute what the whole model does"},
      {"profile_repeats", T::kInt, S::kJob, "3", "timed runs per profiling measurement"},
      {"profile_all_sizes", T::kBool, S::kJob, "false",
       "profile every micro-batch size instead of interpolating between the extremes"},
      {"batch_size", T::kInt, S::kJob, "0 (the example's batch)",
       "the global batch to plan for (pyrannc sets it with trace_batch)"},
      {"auto_memory", T::kBool, S::kJob, "true",
       "when nothing fits, plan again with ZeRO, then offload, then both"},
      {"offload_block_bytes", T::kBytes, S::kJob, "1GiB",
       "with offload_params, a stage without replicas streams its parameters to the device in "
       "blocks of at most this many bytes, each there only while it computes (0: the stage's "
       "at once)"},
      {"offload_keep_on_device", T::kBool, S::kJob, "true",
       "with offload_params streaming on devices of known memory, the planner keeps as many "
       "parameters on the device as its memory estimate leaves room for (their masters, "
       "gradients and optimizer state there, stepped by the device); false: all in host memory"},
      {"offload_low_precision", T::kBool, S::kJob, "false",
       "with offload_params streaming at amp_level O2, parameters cross the host link in "
       "amp_dtype, from a copy of the masters the host casts each step (2 more bytes a "
       "parameter of host memory): half the bytes and device memory, the same results; slower "
       "where the link is fast (docs/benchmarks.md, workload D)"},
      {"amp_dtype", T::kString, S::kJob, "bf16",
       "mixed precision's dtype with enable_apex_amp: bf16, or fp16 (CUDA devices)"},
      {"amp_level", T::kString, S::kJob, "O1",
       "O1 (autocast) or O2 (the whole forward in amp_dtype, fp32 master parameters)"},
      {"amp_cast_group_bytes", T::kBytes, S::kJob, "256MiB",
       "at amp_level O2, a stage that keeps its activations casts its parameters to amp_dtype "
       "before its ops run, in groups of at most this many bytes of masters, one multi-tensor "
       "copy each way a group (their gradients widened back likewise); the same results. 0: "
       "each cast where the graph has it"},
      {"outputs_before_backward", T::kBool, S::kJob, "true",
       "on CUDA devices, a forward that also runs the backward (a scalar loss: the fused pass) "
       "returns its outputs once they are computed, copied behind them, without waiting for "
       "the backward it queued after them; false: once everything queued has run"},
      {"loss_scale", T::kString, S::kJob, "dynamic for fp16, none otherwise",
       "dynamic, none, or a number (a static scale)"},
      {"loss_scale_init", T::kFloat, S::kJob, "65536", "the dynamic loss scale's first value"},
      {"loss_scale_window", T::kInt, S::kJob, "2000",
       "steps without overflow before the dynamic loss scale grows"},
      {"checkpoint_dir", T::kString, S::kJob, "(none)",
       "where the daemons write the job's checkpoints: under DIR/<job name>/"},
      {"checkpoint_every", T::kInt, S::kJob, "0 (only when asked)",
       "write a checkpoint every N optimizer steps"},
      {"checkpoint_keep", T::kInt, S::kJob, "3", "checkpoints kept, the newest (0: all)"},
      {"resume", T::kString, S::kJob, "(start afresh)",
       "latest or a step: the job starts from that checkpoint of checkpoint_dir/<job name>"},
      {"admission_wait", T::kFloat, S::kJob, "30",
       "seconds a job waits for the daemon's other jobs to leave its plan the memory it needs"},
      // ---- clients (pyrannc, the C++ SDK, the CLI) ----
      {"daemon", T::kString, S::kClient, "an embedded ranncd",
       "host:port of the ranncd to use; unset, pyrannc starts its own on loopback. pyrannc "
       "takes several, comma-separated (daemons of one cluster): the first that answers, and "
       "where a job is looked for when its daemon is lost"},
      {"daemon_bin", T::kString, S::kClient, "bazel-bin/daemon/ranncd, else ranncd on PATH",
       "the ranncd binary pyrannc's embedded daemon runs"},
      {"cli_bin", T::kString, S::kClient, "bazel-bin/client/rannc, else rannc on PATH",
       "the rannc CLI binary pyrannc's show_deployment prints deployments with"},
      {"daemon_args", T::kString, S::kClient, "",
       "extra flags for the embedded ranncd, split as a shell splits them"},
      {"daemon_log", T::kString, S::kClient, "",
       "file the embedded ranncd's output is appended to"},
      {"daemon_start_timeout", T::kFloat, S::kClient, "120",
       "seconds the embedded ranncd gets to start"},
      {"daemon_connect_timeout", T::kFloat, S::kClient, "30",
       "seconds pyrannc waits for a ranncd named by daemon"},
      {"call_retry_timeout", T::kFloat, S::kClient, "30",
       "seconds a call is retried while the daemon is unreachable (0: never); it is applied "
       "once"},
      {"daemon_stop_timeout", T::kFloat, S::kClient, "10",
       "seconds the embedded ranncd gets to stop at exit before SIGKILL (also its "
       "--stop-timeout, which bounds its stop when the client dies)"},
      {"conf_dir", T::kString, S::kClient, "~/.rannc",
       "where rannc.toml is read from (environment only)"},
      {"client_rank", T::kInt, S::kClient, "0 (or torchrun's / MPI's rank)",
       "this client process's rank in a job that several processes train"},
      {"client_world", T::kInt, S::kClient, "1 (or torchrun's / MPI's world size)",
       "client processes in the job"},
      {"job", T::kString, S::kClient, "",
       "the job's name: client ranks with one name join one job"},
      {"job_name", T::kString, S::kClient, "", "the same as job"},
      {"client_timeout", T::kFloat, S::kClient, "300",
       "seconds the daemon waits for every client rank of a step"},
      {"token", T::kString, S::kClient, "none",
       "the token sent with every call (a ranncd with --auth-token-file): the admin's, or a "
       "job's"},
      {"token_file", T::kString, S::kClient, "none", "a file whose first line is the token"},
      {"job_lease", T::kFloat, S::kClient, "300",
       "seconds without a word from the client after which its job is deleted; 0: never"},
      {"trace_batch", T::kInt, S::kClient, "0 (the whole batch)",
       "trace the model on this many samples of the first batch"},
      {"reuse_trace", T::kBool, S::kClient, "true",
       "reuse a saved deployment's trace when the model is the same"},
      {"keep_local_model", T::kBool, S::kClient, "false",
       "with offload_params, keep the local model's copy of the tensors sent to the daemon "
       "(false: their memory is freed until a read such as named_parameters() or state_dict() "
       "fetches them back)"},
      {"save_job", T::kString, S::kClient, "",
       "folder to write each created job to, for benchmarks/job_bench"},
      {"shm", T::kBool, S::kClient, "true when the daemon is on this host",
       "send large tensors through shared memory; true also when pyrannc cannot tell the "
       "daemon is on this host"},
      {"defer_ops", T::kBool, S::kClient, "true",
       "send backward, step and zero_grad with the next forward (one round trip a step)"},
  };
  // RaNNC's keys with no meaning here: accepted, ignored.
  for (const char* name :
       {"alloc_repl_flat", "auto_parallel", "checkpointing", "checkpointing_no_last",
        "coarsen_by_time", "consolidate_grads", "decomposer", "deployment_file",
        "disable_balancing", "display_comm_value", "do_coarsening", "do_uncoarsening",
        "dp_search_all", "dump_dp_node_profiles", "dump_graph", "dump_graph_prefix",
        "event_trace_file", "graph_profile_file", "graph_profiling", "limit_dev_num_more_than_bs",
        "limit_dev_num_pot", "load_deployment", "load_graph_profile", "max_mp_num",
        "max_partition_num", "mem_limit_gb", "min_partition_num", "min_pipeline",
        "min_pipeline_bs", "opt_param_factor", "p2p_comm", "profile_by_acc", "profile_dump_path",
        "profiling", "profiling_iter", "save_deployment", "save_graph_profile",
        "show_config_items", "skip_grad_scaling", "sync_allreduce", "trace_events",
        "use_amp_master_param", "validate_comm", "verify_recomp"}) {
    keys->push_back({name, T::kString, S::kRaNNC, "", "RaNNC's; accepted and ignored"});
  }
  return keys;
}

const std::vector<ConfigKey>& Registry() {
  static const std::vector<ConfigKey>* keys = MakeRegistry();
  return *keys;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string PythonString(std::string_view s) {
  const absl::string_view text(s.data(), s.size());
  return absl::StrCat("\"", absl::StrReplaceAll(text, {{"\\", "\\\\"}, {"\"", "\\\""}}),
                      "\"");
}

}  // namespace

const std::vector<ConfigKey>& ConfigKeys() { return Registry(); }

const ConfigKey* FindConfigKey(std::string_view name) {
  static const auto* index = [] {
    auto* map = new std::unordered_map<std::string_view, const ConfigKey*>;
    for (const ConfigKey& k : Registry()) map->emplace(k.name, &k);
    return map;
  }();
  auto it = index->find(name);
  return it == index->end() ? nullptr : it->second;
}

std::string DidYouMean(std::string_view name) {
  const ConfigKey* best = nullptr;
  size_t best_distance = 0;
  for (const ConfigKey& k : Registry()) {
    const size_t d = EditDistance(name, k.name);
    if (best == nullptr || d < best_distance) {
      best = &k;
      best_distance = d;
    }
  }
  // A slip, not another word: at most a third of the name's letters changed.
  if (best == nullptr || best_distance == 0 ||
      best_distance * 3 > std::max<size_t>(name.size(), 3)) {
    return "";
  }
  return absl::StrCat(" (did you mean '", best->name, "'?)");
}

absl::Status CheckRegisteredKey(std::string_view name, std::string_view where) {
  if (FindConfigKey(name) != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown key '", std::string(name), "' in ", std::string(where), DidYouMean(name),
      "; the keys are listed in docs/config.md and by `rannc keys`"));
}

absl::Status CheckJobKey(std::string_view name) {
  const ConfigKey* key = FindConfigKey(name);
  if (key == nullptr) return CheckRegisteredKey(name, "the job's config");
  if (key->scope == KeyScope::kJob || key->scope == KeyScope::kRaNNC) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "key '", std::string(name), "' in the job's config is a ", KeyScopeName(key->scope),
      " setting, not a job's: ",
      key->scope == KeyScope::kDaemon
          ? "set it where ranncd starts (its flags, rannc.toml or environment)"
          : "the client reads it; do not send it"));
}

const char* KeyScopeName(KeyScope scope) {
  switch (scope) {
    case KeyScope::kDaemon: return "daemon";
    case KeyScope::kJob: return "job";
    case KeyScope::kClient: return "client";
    case KeyScope::kRaNNC: return "rannc";
  }
  return "?";
}

const char* KeyTypeName(KeyType type) {
  switch (type) {
    case KeyType::kString: return "string";
    case KeyType::kBool: return "bool";
    case KeyType::kInt: return "int";
    case KeyType::kFloat: return "float";
    case KeyType::kBytes: return "bytes";
    case KeyType::kDuration: return "duration";
    case KeyType::kList: return "list";
  }
  return "?";
}

std::string ConfigKeysMarkdown() {
  std::string out =
      "| key | scope | type | default | what it does |\n|---|---|---|---|---|\n";
  for (const ConfigKey& k : Registry()) {
    if (k.scope == KeyScope::kRaNNC) continue;
    absl::StrAppend(&out, "| `", k.name, "` | ", KeyScopeName(k.scope), " | ",
                    KeyTypeName(k.type), " | ", *k.default_value ? k.default_value : "(none)",
                    " | ", absl::StrReplaceAll(k.doc, {{"|", "\\|"}}), " |\n");
  }
  std::vector<std::string> rannc;
  for (const ConfigKey& k : Registry()) {
    if (k.scope == KeyScope::kRaNNC) rannc.push_back(absl::StrCat("`", k.name, "`"));
  }
  absl::StrAppend(&out, "\nRaNNC's keys accepted and ignored: ", absl::StrJoin(rannc, ", "), ".\n");
  return out;
}

std::string ConfigKeysPython() {
  std::string out =
      "\"\"\"The registry of configuration keys (daemon/config/keys.cc), generated by "
      "`rannc keys --python`:\ndo not edit; tools/gen_config_keys.sh writes it again.\"\"\"\n\n"
      "# name -> (scope, type, default, doc)\nKEYS = {\n";
  for (const ConfigKey& k : Registry()) {
    absl::StrAppend(&out, "    ", PythonString(k.name), ": (", PythonString(KeyScopeName(k.scope)),
                    ", ", PythonString(KeyTypeName(k.type)), ", ", PythonString(k.default_value),
                    ",\n        ", PythonString(k.doc), "),\n");
  }
  absl::StrAppend(&out, "}\n");
  return out;
}

}  // namespace rannc
