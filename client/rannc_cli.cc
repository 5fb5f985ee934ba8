// `rannc`: the command-line client of ranncd.
//
//   rannc info   [--daemon HOST:PORT]     the daemon's version, LibTorch, devices, job count
//   rannc jobs                            a table of the daemon's jobs
//   rannc queue                           a table of its detached jobs (docs/detached.md)
//   rannc locate NAME                     where a registered job runs (ranncd --cluster-store)
//   rannc train  MODEL.pt --tokens FILE --batch B --seq T --steps N [...]
//   rannc delete JOB_ID
//   rannc checkpoint  JOB [--no-wait]          write a checkpoint of a live job now
//   rannc checkpoints JOB [--dir DIR]          list a job's checkpoints
//   rannc export      JOB[@STEP] OUT.pt [--dir DIR]
//                                              write one checkpoint (default: the newest) as
//                                              one file plain torch.load opens
//   rannc plan   MODEL.pt --devices N [--device-memory 80GiB] [--batch B] --input DTYPE:SHAPE
//                [--input ...] [--config KEY=VALUE ...] [--links SPEC] [--schedule 1f1b|gpipe]
//                [--save FILE]                 plan only (a dry run): no job is created
//   rannc plan   --show FILE|- [--batch B]    print a saved deployment (- reads it from standard
//                                              input); no daemon involved. pyrannc's
//                                              show_deployment prints through this.
//
// The daemon address comes from --daemon, else $RANNC_DAEMON, else 127.0.0.1:7411. A list
// ("a:7411,b:7411": daemons of one cluster) means the first of them that answers (within 5 s).
// --wait-for-daemon SECONDS (or $RANNC_WAIT_FOR_DAEMON) waits that long for an answer before
// the command, for a daemon that is starting or restarting; without it a daemon that cannot be
// reached fails the command at once. Errors print the daemon's message and exit non-zero.
//
// JOB is a live job's id, or the name of exactly one live job (`rannc jobs` lists both). For
// `checkpoints` and `export`, a JOB that is no live job is looked up by name under --dir (else
// $RANNC_CHECKPOINT_DIR, the job key checkpoint_dir): the daemon reads DIR/JOB/, so the
// checkpoints of a finished job, or of one another daemon ran, can be listed and exported.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/optim/lr_schedule.h"
#include "client/detached_cli.h"
#include "client/planning.h"
#include "client/rannc_client.h"
#include "client/token_data.h"
#include "daemon/config/keys.h"
#include "daemon/common/files.h"
#include "daemon/security/auth.h"
#include "daemon/security/tls.h"

namespace rannc {
namespace {

// Set by the handler, read by the main thread and by the threads that follow a job's log (a
// volatile sig_atomic_t is only for the thread the signal interrupts): a lock-free atomic, which
// a signal handler may write.
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void OnSigint(int) { g_interrupted.store(true, std::memory_order_relaxed); }
bool Interrupted() { return g_interrupted.load(std::memory_order_relaxed); }

// The first Ctrl-C asks the loop to stop after the RPC in flight and delete the job; a second
// one (SA_RESETHAND restored the default) kills the process at once.
void InstallSigintHandler() {
  struct sigaction action = {};
  action.sa_handler = OnSigint;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int Fail(const absl::Status& status) {
  std::cerr << "rannc: " << status.message() << "\n";
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    std::cerr << "rannc: this ranncd wants a token: RANNC_TOKEN, or --token-file FILE.\n";
  }
  if (status.code() == absl::StatusCode::kUnavailable) {
    std::cerr << "rannc: is ranncd running there? Point at it with --daemon HOST:PORT or "
                 "RANNC_DAEMON. A ranncd started with --tls-cert speaks TLS only: give the CA "
                 "that signed its certificate (--tls-ca or RANNC_TLS_CA).\n";
  }
  return 1;
}

int Fail(const std::string& message) {
  std::cerr << "rannc: " << message << "\n";
  return 1;
}

std::string HumanCount(uint64_t n) {
  if (n >= 1000000000) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1000000) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1000) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrFormat("%d", n);
}

const char* StateName(v1::JobState state) {
  switch (state) {
    case v1::DEPLOYED: return "deployed";
    case v1::UNDEPLOYED: return "undeployed";
    case v1::FAILED: return "failed";
    case v1::SUSPENDED: return "suspended";
    default: return "unknown";
  }
}

// Prints rows with each column padded to its widest cell.
void PrintTable(const std::vector<std::vector<std::string>>& rows, const std::string& indent) {
  std::vector<size_t> widths(rows.empty() ? 0 : rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

const char* MemberStateName(v1::MemberState state) {
  switch (state) {
    case v1::MEMBER_UP: return "UP";
    case v1::MEMBER_DOWN: return "DOWN";
    default: return "UNKNOWN";
  }
}

// The members table: rank 0 coordinates; "*" marks the daemon that answered.
void PrintCluster(const v1::DaemonInfo& info) {
  if (info.cluster_size() == 0) return;
  int up = 0;
  for (const v1::ClusterMember& m : info.cluster()) up += m.state() == v1::MEMBER_UP;
  std::cout << "cluster: " << info.cluster_size() << " daemon"
            << (info.cluster_size() == 1 ? "" : "s") << ", " << up << " up";
  if (!info.coordinator().empty()) {
    std::cout << "; coordinator " << info.coordinator()
              << (info.cluster_store().empty() ? " (rank 0)" : " (elected in etcd)");
  }
  std::cout << "\n";
  if (!info.cluster_store().empty()) std::cout << "cluster store: " << info.cluster_store() << "\n";
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "ADDRESS", "STATE", "HOST", "DEVICES", "LAST SEEN", "INCARNATION"}};
  for (const v1::ClusterMember& m : info.cluster()) {
    std::vector<std::string> devices;
    for (const v1::DeviceInfo& d : m.devices()) devices.push_back(d.name());
    std::string seen = m.self()                   ? "-"
                       : m.last_seen_ms_ago() < 0 ? "never"
                       : absl::StrFormat("%.1fs ago", m.last_seen_ms_ago() / 1000.0);
    rows.push_back({m.rank() < 0 ? "?" : absl::StrCat(m.rank(), m.self() ? "*" : ""),
                    m.address(), MemberStateName(m.state()),
                    m.hostname().empty() ? "-" : m.hostname(),
                    devices.empty() ? "-" : absl::StrJoin(devices, ","), seen,
                    m.incarnation() == 0 ? "-" : absl::StrFormat("%016x", m.incarnation())});
  }
  PrintTable(rows, "  ");
}

int RunInfo(const Client& client) {
  absl::StatusOr<v1::DaemonInfo> info = client.GetInfo();
  if (!info.ok()) return Fail(info.status());
  std::cout << "ranncd " << info->version() << " at " << client.address();
  if (!info->hostname().empty()) std::cout << " (host " << info->hostname() << ")";
  std::cout << "\n";
  std::cout << "LibTorch " << info->torch_version() << "\n";
  std::cout << "devices: " << info->devices_size() << "\n";
  for (const v1::DeviceInfo& device : info->devices()) {
    std::cout << absl::StrFormat("  %-10s %-5s %s\n", device.name(), device.type(),
                                 HumanBytes(device.memory_bytes()));
  }
  std::cout << "jobs: " << info->num_jobs() << "\n";
  PrintCluster(*info);
  if (info->max_message_bytes() > 0) {
    std::cout << "max message size: " << HumanBytes(info->max_message_bytes()) << "\n";
  }
  std::cout << "shared memory: " << (info->shm_dir().empty() ? "not offered" : info->shm_dir())
            << "\n";
  return 0;
}

int RunJobs(const Client& client) {
  absl::StatusOr<std::vector<v1::JobSummary>> jobs = client.ListJobs();
  if (!jobs.ok()) return Fail(jobs.status());
  // STEP: the last iteration's wall time / the plan's estimate; the metrics endpoint's numbers.
  std::vector<std::vector<std::string>> rows = {{"JOB ID", "NAME", "STATE", "PARAMS", "STEPS",
                                                 "STEP (PLAN)", "TOK/S", "BUBBLE", "MEMORY",
                                                 "IDLE", "LEASE", "DEVICES"}};
  auto seconds = [](uint64_t ms) { return absl::StrFormat("%ds", ms / 1000); };
  for (const v1::JobSummary& job : *jobs) {
    uint64_t memory = 0;
    for (uint64_t b : job.device_bytes()) memory += b;
    const bool stepped = job.step_seconds() > 0;
    rows.push_back(
        {job.job_id(), job.name().empty() ? "-" : job.name(), StateName(job.state()),
         HumanCount(job.num_params()), std::to_string(job.steps()),
         stepped ? absl::StrFormat("%.3fs (%.3fs)", job.step_seconds(),
                                   job.planned_step_seconds())
                 : "-",
         stepped ? absl::StrFormat("%.0f", job.tokens_per_second()) : "-",
         stepped ? absl::StrFormat("%.0f%%", 100 * job.bubble()) : "-",
         memory > 0 ? HumanBytes(memory) : "-", seconds(job.idle_ms()),
         job.lease_ms() == 0 ? "-" : seconds(job.lease_ms()), absl::StrJoin(job.devices(), ",")});
  }
  PrintTable(rows, "");
  for (const v1::JobSummary& job : *jobs) {
    if (!job.error().empty()) std::cout << job.job_id() << " failed: " << job.error() << "\n";
  }
  if (jobs->empty()) std::cout << "(no jobs)\n";
  return 0;
}

int RunQueue(const Client& client) {
  absl::StatusOr<std::vector<v1::DetachedStatus>> jobs = client.ListDetachedJobs();
  if (!jobs.ok()) return Fail(jobs.status());
  if (jobs->empty()) {
    std::cout << "(no detached jobs)\n";
    return 0;
  }
  PrintTable(QueueTable(*jobs), "");
  return 0;
}

int RunLocate(const Client& client, const std::string& name) {
  absl::StatusOr<v1::RegisteredJob> job = client.LocateJob(name);
  if (!job.ok()) return Fail(job.status());
  std::cout << "job " << job->name() << " (" << job->job_id() << ") runs on ranncd at "
            << job->leader() << "\n";
  std::cout << "devices: " << absl::StrJoin(job->devices(), ",") << "\n";
  std::cout << "taken over: " << job->generation() << " time"
            << (job->generation() == 1 ? "" : "s");
  if (job->resumed_step() >= 0) std::cout << ", last resumed from step " << job->resumed_step();
  std::cout << "\n";
  std::cout << "record and checkpoints: " << job->record_dir() << "\n";
  return 0;
}

int RunDelete(const Client& client, const std::string& job_id) {
  if (absl::Status s = client.DeleteJob(job_id); !s.ok()) return Fail(s);
  std::cout << "deleted job " << job_id << "\n";
  return 0;
}

int RunResume(const Client& client, const std::string& job) {
  absl::StatusOr<v1::CreateJobResponse> resumed = client.ResumeJob(job);
  if (!resumed.ok()) return Fail(resumed.status());
  std::cout << "resumed job " << resumed->job_id() << " at step " << resumed->resumed_step()
            << " on " << absl::StrJoin(resumed->devices(), ", ") << "\n";
  return 0;
}

// JOB on the command line: a live job's id, or the name of exactly one live job. NOT_FOUND when
// no live job has that id or name; INVALID_ARGUMENT naming the ids when several share the name.
absl::StatusOr<std::string> ResolveJob(const Client& client, const std::string& job) {
  absl::StatusOr<std::vector<v1::JobSummary>> jobs = client.ListJobs();
  if (!jobs.ok()) return jobs.status();
  std::vector<std::string> named;
  for (const v1::JobSummary& j : *jobs) {
    if (j.job_id() == job) return j.job_id();  // an id wins over a name
    if (j.name() == job) named.push_back(j.job_id());
  }
  if (named.size() == 1) return named[0];
  if (named.empty()) {
    // A registered job of that name may run on another daemon of the cluster.
    absl::StatusOr<v1::RegisteredJob> located = client.LocateJob(job);
    if (located.ok() && located->leader() != client.address()) {
      return absl::NotFoundError(absl::StrCat(
          "job '", job, "' (", located->job_id(), ") runs on ranncd at ", located->leader(),
          ", not at ", client.address(), ": ask there (--daemon ", located->leader(), ")"));
    }
    return absl::NotFoundError(absl::StrCat("no job with id or name '", job, "' on ranncd at ",
                                            client.address(), " (`rannc jobs` lists them)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(named.size(), " jobs are named '", job, "' (",
                                                 absl::StrJoin(named, ", "),
                                                 "): name one by its id"));
}

// The environment variable of a job key ("checkpoint_dir" -> "RANNC_CHECKPOINT_DIR"), or "" when
// the registry has no such key.
std::string JobKeyEnv(const char* key) {
  const ConfigKey* found = FindConfigKey(key);
  if (found == nullptr || found->scope != KeyScope::kJob) return "";
  return absl::StrCat("RANNC_", absl::AsciiStrToUpper(found->name));
}

// Which checkpoints `job` names: a live job's, else, with `dir`, those of the job of that name
// under dir (made absolute here: the daemon resolves paths from its own working directory).
absl::StatusOr<v1::CheckpointsRef> CheckpointsOf(const Client& client, const std::string& job,
                                                 const std::string& dir) {
  v1::CheckpointsRef ref;
  absl::StatusOr<std::string> id = ResolveJob(client, job);
  if (id.ok()) {
    ref.set_job_id(*id);
    return ref;
  }
  const absl::StatusCode code = id.status().code();
  if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kInvalidArgument) {
    return id.status();
  }
  if (dir.empty()) {
    if (code != absl::StatusCode::kNotFound) return id.status();
    const std::string env = JobKeyEnv("checkpoint_dir");
    return absl::NotFoundError(absl::StrCat(
        id.status().message(), "; for the checkpoints of a job that is gone, name their "
        "directory (the job's checkpoint_dir) with --dir DIR", env.empty() ? "" : " or " + env));
  }
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(dir, error);
  ref.set_job_name(job);
  ref.set_checkpoint_dir(error ? dir : absolute.string());
  return ref;
}

// "2026-12-02 14:03:59" in the local time zone (localtime_r: absl's time zones are not linked).
std::string LocalTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const time_t seconds = static_cast<time_t>(unix_ms / 1000);
  struct tm local = {};
  char text[32];
  if (localtime_r(&seconds, &local) == nullptr ||
      std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local) == 0) {
    return "-";
  }
  return text;
}

int RunCheckpoint(const Client& client, const std::string& job, bool no_wait) {
  absl::StatusOr<std::string> id = ResolveJob(client, job);
  if (!id.ok()) return Fail(id.status());
  absl::StatusOr<v1::CheckpointInfo> info = client.Checkpoint(*id, /*wait=*/!no_wait);
  if (!info.ok()) return Fail(info.status());
  std::cout << absl::StrFormat(
                   "checkpoint step=%d path=%s bytes=%d blocked_s=%.3f write_s=%.3f "
                   "committed=%s\n",
                   info->step(), info->path(), info->bytes(), info->blocked_s(),
                   info->write_s(), info->committed() ? "true" : "false")
            << std::flush;
  return 0;
}

int RunCheckpoints(const Client& client, const std::string& job, const std::string& dir) {
  absl::StatusOr<v1::CheckpointsRef> ref = CheckpointsOf(client, job, dir);
  if (!ref.ok()) return Fail(ref.status());
  absl::StatusOr<v1::ListCheckpointsResponse> list = client.ListCheckpoints(*ref);
  if (!list.ok()) return Fail(list.status());
  if (!list->error().empty()) std::cerr << "rannc: last write failed: " << list->error() << "\n";
  if (list->checkpoints().empty()) {
    std::cout << "(no checkpoints)\n";
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"STEP", "CREATED", "SIZE", "PATH"}};
  for (const v1::CheckpointInfo& c : list->checkpoints()) {
    rows.push_back({std::to_string(c.step()), LocalTime(c.created_unix_ms()),
                    HumanBytes(c.bytes()),
                    c.committed() ? c.path() : c.path() + " (not committed)"});
  }
  PrintTable(rows, "");
  return 0;
}

int RunExport(const Client& client, const std::string& job_at_step, const std::string& out,
              const std::string& dir) {
  std::string job = job_at_step;
  int64_t step = 0;  // the newest
  if (const size_t at = job_at_step.rfind('@'); at != std::string::npos) {
    job = job_at_step.substr(0, at);
    const std::string text = job_at_step.substr(at + 1);
    if (job.empty() || !absl::SimpleAtoi(text, &step) || step < 0) {
      return Fail("rannc export takes JOB or JOB@STEP, STEP a checkpoint's step (e.g. gpt@1000; "
                  "`rannc checkpoints JOB` lists them), got '" + job_at_step + "'");
    }
  }
  absl::StatusOr<v1::CheckpointsRef> ref = CheckpointsOf(client, job, dir);
  if (!ref.ok()) return Fail(ref.status());
  ref->set_step(step);
  absl::StatusOr<int64_t> exported = client.ExportCheckpoint(*ref, out);
  if (!exported.ok()) return Fail(exported.status());
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(out, error);
  std::cout << absl::StrFormat("exported step %d of %s to %s (%s)\n", *exported, job, out,
                               error ? std::string("?") : HumanBytes(size))
            << std::flush;
  return 0;
}

struct TrainFlags {
  std::string model;
  std::string tokens;
  std::string token_dtype = "uint16";
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t steps = 0;
  double lr = 1e-3;
  std::string schedule = "constant";
  int64_t warmup = 0;
  double min_lr = 0;
  std::string optimizer = "adamw";
  double weight_decay = -1;  // < 0: the optimizer's PyTorch default
  double momentum = 0;
  uint64_t seed = 0;
  int64_t log_every = 10;
  std::string name;
  double lease_s = 300;  // the job's lease (JobOptions.lease_ms); 0: none
};

// "[#######.............]", `width` cells filled in proportion to done/total.
std::string Bar(int64_t done, int64_t total, int width) {
  const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}

int RunTrain(const Client& client, const TrainFlags& flags) {
  if (flags.batch <= 0 || flags.seq <= 0 || flags.steps <= 0) {
    return Fail("--batch, --seq and --steps must be positive");
  }
  if (flags.lease_s != 0 && !(flags.lease_s >= 1 && flags.lease_s <= 4e6)) {
    return Fail("--lease is 0 (no lease) or 1 to 4,000,000 seconds");
  }
  absl::StatusOr<LrSchedule::Kind> kind = ParseLrScheduleKind(flags.schedule);
  if (!kind.ok()) return Fail(kind.status());
  const LrSchedule schedule{*kind, flags.lr, flags.warmup, flags.min_lr, flags.steps};
  if (absl::Status valid = schedule.Validate(); !valid.ok()) return Fail(valid);
  absl::StatusOr<std::string> model = ReadFile(flags.model);
  if (!model.ok()) return Fail(model.status());
  absl::StatusOr<TokenFile> tokens = TokenFile::Open(flags.tokens, flags.token_dtype);
  if (!tokens.ok()) return Fail(tokens.status());
  if (tokens->size() < static_cast<size_t>(flags.seq) + 1) {
    return Fail(absl::StrFormat("%s holds %d tokens; --seq %d needs at least %d", flags.tokens,
                                tokens->size(), flags.seq, flags.seq + 1));
  }

  v1::HyperParams hyper;
  hyper.set_lr(flags.lr);
  JobConfig config;
  config.name = flags.name.empty() ? "rannc-train" : flags.name;
  // If this process dies (SIGKILL, a lost machine), the daemon deletes the job once the lease
  // runs out; the keeper below renews it while we live.
  config.options.set_lease_ms(static_cast<uint32_t>(flags.lease_s * 1000));
  config.mode.set_training(true);
  config.mode.set_dropout(true);
  if (flags.optimizer == "sgd") {
    config.optimizer.set_type(v1::SGD);
    hyper.set_momentum(flags.momentum);
    hyper.set_weight_decay(flags.weight_decay < 0 ? 0.0 : flags.weight_decay);
  } else {
    config.optimizer.set_type(flags.optimizer == "adam" ? v1::ADAM : v1::ADAMW);
    hyper.set_beta1(0.9);
    hyper.set_beta2(0.999);
    hyper.set_eps(1e-8);
    const double default_decay = flags.optimizer == "adam" ? 0.0 : 0.01;
    hyper.set_weight_decay(flags.weight_decay < 0 ? default_decay : flags.weight_decay);
  }
  // The job's one param group is given by hyper-parameters alone: no group list means one
  // group of every parameter, whose names the daemon knows only after loading the model.

  std::mt19937_64 rng(flags.seed);
  TokenBatch batch = SampleTokenBatch(*tokens, rng, flags.batch, flags.seq);
  config.example_inputs = {batch.input_ids, batch.targets};
  config.input_names = {"input_ids", "targets"};

  InstallSigintHandler();
  absl::StatusOr<v1::CreateJobResponse> job = client.CreateJob(*model, config);
  if (!job.ok()) return Fail(job.status());
  const std::string job_id = job->job_id();
  std::optional<LeaseKeeper> lease;
  if (flags.lease_s > 0) lease.emplace(client, job_id, absl::Seconds(flags.lease_s));

  // From here on every exit path deletes the job.
  auto finish = [&](int code, const absl::Status& error) {
    if (!error.ok()) std::cerr << "rannc: " << error.message() << "\n";
    if (absl::Status s = client.DeleteJob(job_id); !s.ok()) {
      std::cerr << "rannc: could not delete job " << job_id << ": " << s.message() << "\n";
      return code == 0 ? 1 : code;
    }
    return code;
  };

  if (job->outputs_size() != 1 ||
      HostTensor{job->outputs(0).dtype(),
                 {job->outputs(0).shape().begin(), job->outputs(0).shape().end()},
                 {}}
              .NumElements() != 1) {
    return finish(1, absl::InvalidArgumentError(absl::StrFormat(
                         "the model must return one scalar loss from (input_ids, targets); it "
                         "returned %d outputs",
                         job->outputs_size())));
  }
  uint64_t num_params = 0;
  for (const v1::ParamInfo& p : job->params()) {
    HostTensor shape_only{p.spec().dtype(), {p.spec().shape().begin(), p.spec().shape().end()}, {}};
    num_params += static_cast<uint64_t>(shape_only.NumElements());
  }
  std::cout << absl::StrFormat("job %s: %s parameters in %d tensors on %s; %s %s tokens\n",
                               job_id, HumanCount(num_params), job->params_size(),
                               absl::StrJoin(job->devices(), ","), flags.tokens,
                               HumanCount(tokens->size()))
            << std::flush;

  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  const int64_t tokens_per_step = flags.batch * flags.seq;
  double first_loss = NAN;
  double last_loss = NAN;
  int64_t done = 0;
  const auto start = std::chrono::steady_clock::now();
  auto rate = [&](int64_t steps) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return seconds > 0 ? static_cast<double>(steps * tokens_per_step) / seconds : 0.0;
  };

  for (int64_t step = 1; step <= flags.steps && !Interrupted(); ++step) {
    if (step > 1) batch = SampleTokenBatch(*tokens, rng, flags.batch, flags.seq);
    if (absl::Status s = client.ZeroGrad(job_id); !s.ok()) return finish(1, s);
    absl::StatusOr<ForwardResult> out = client.Forward(job_id, {batch.input_ids, batch.targets});
    if (!out.ok()) return finish(1, out.status());
    if (out->outputs.size() != 1) {
      return finish(1, absl::InternalError(absl::StrFormat(
                           "Forward returned %d outputs, expected one loss", out->outputs.size())));
    }
    const HostTensor& loss_tensor = out->outputs[0];
    absl::StatusOr<std::vector<double>> loss = loss_tensor.ToDoubles();
    if (!loss.ok()) return finish(1, loss.status());
    if (loss->size() != 1) {
      return finish(1, absl::InvalidArgumentError("the loss must be a scalar, got " +
                                                  loss_tensor.DebugString()));
    }
    last_loss = (*loss)[0];
    if (step == 1) first_loss = last_loss;
    absl::Status s = client.Backward(
        job_id, {{0, HostTensor::Full(loss_tensor.dtype, loss_tensor.shape, 1.0)}});
    if (!s.ok()) return finish(1, s);
    hyper.set_lr(schedule.At(step));
    if (s = client.Step(job_id, {hyper}); !s.ok()) return finish(1, s);
    done = step;

    if (tty) {
      std::cout << absl::StrFormat("\r%s %d/%d  loss %.4f  %.0f tokens/s ",
                                   Bar(step, flags.steps, 30), step, flags.steps, last_loss,
                                   rate(step))
                << std::flush;
      if (step == flags.steps) std::cout << "\n";
    } else if (step % std::max<int64_t>(flags.log_every, 1) == 0 || step == flags.steps) {
      std::cout << absl::StrFormat("step %d/%d loss %.6f tokens/s %.1f lr %.6g\n", step,
                                   flags.steps, last_loss, rate(step), hyper.lr())
                << std::flush;
    }
  }
  if (tty && Interrupted()) std::cout << "\n";
  std::cout << absl::StrFormat("summary: steps=%d first_loss=%.6f last_loss=%.6f tokens/s=%.1f\n",
                               done, first_loss, last_loss, rate(done))
            << std::flush;
  if (Interrupted()) {
    std::cerr << "rannc: interrupted after " << done << " steps; deleting job " << job_id << "\n";
    return finish(130, absl::OkStatus());
  }
  return finish(0, absl::OkStatus());
}

struct PlanFlags {
  std::string model;
  std::string show;          // a deployment file to print instead of planning; "-": stdin
  uint32_t devices = 0;
  std::string device_memory;  // empty: the daemon's own devices' budget
  int64_t batch = 0;          // 0: the inputs' dim 0 (or, with --show, the planned batch)
  std::vector<std::string> inputs;
  std::vector<std::string> config;
  std::string links;
  std::string schedule;
  std::string optimizer = "adamw";
  std::string save;
  uint64_t seed = 0;
};

int RunShow(const PlanFlags& flags) {
  const bool from_stdin = flags.show == "-";
  absl::StatusOr<std::string> bytes =
      from_stdin ? std::string(std::istreambuf_iterator<char>(std::cin), {})
                 : ReadFile(flags.show);
  if (!bytes.ok()) return Fail(bytes.status());
  absl::StatusOr<v1::Deployment> deployment =
      ParseDeployment(*bytes, from_stdin ? "standard input" : flags.show);
  if (!deployment.ok()) return Fail(deployment.status());
  const int64_t batch = flags.batch > 0 ? flags.batch : deployment->batch_size();
  absl::StatusOr<std::string> text = FormatDeployment(*deployment, batch);
  if (!text.ok()) return Fail(text.status());
  std::cout << *text;
  return 0;
}

int RunPlan(const Client& client, const PlanFlags& flags) {
  if (flags.model.empty()) return Fail("rannc plan needs MODEL.pt (or --show FILE)");
  if (flags.devices == 0) return Fail("--devices must be at least 1");
  if (flags.inputs.empty()) {
    return Fail("rannc plan needs the model's inputs: --input DTYPE:SHAPE for each, in order "
                "(e.g. --input int64:64x1024)");
  }
  absl::StatusOr<std::string> model = ReadFile(flags.model);
  if (!model.ok()) return Fail(model.status());

  JobConfig config;
  config.name = "rannc-plan";
  // Plans are for training: the memory estimate counts gradients and optimizer state.
  config.mode.set_training(true);
  config.optimizer.set_type(flags.optimizer == "sgd"    ? v1::SGD
                            : flags.optimizer == "adam" ? v1::ADAM
                                                        : v1::ADAMW);
  std::mt19937_64 rng(flags.seed);
  for (size_t i = 0; i < flags.inputs.size(); ++i) {
    absl::StatusOr<InputSpec> spec = ParseInputSpec(flags.inputs[i]);
    if (!spec.ok()) return Fail(spec.status());
    config.example_inputs.push_back(MakeExampleInput(*spec, flags.batch, rng));
    config.input_names.push_back("input" + std::to_string(i));
  }
  for (const std::string& entry : flags.config) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Fail("--config takes KEY=VALUE (e.g. partition_num=2), got '" + entry + "'");
    }
    config.config[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  if (!flags.schedule.empty()) config.config["schedule"] = flags.schedule;
  config.dry_run.set_num_devices(flags.devices);
  if (!flags.device_memory.empty()) {
    absl::StatusOr<uint64_t> memory = ParseByteSize(flags.device_memory);
    if (!memory.ok()) return Fail(absl::InvalidArgumentError(
        absl::StrCat("--device-memory: ", memory.status().message())));
    config.dry_run.set_device_memory_bytes(*memory);
  }
  config.dry_run.set_batch_size(flags.batch);
  config.dry_run.set_links(flags.links);

  absl::StatusOr<v1::CreateJobResponse> plan = client.CreateJob(*model, config);
  if (!plan.ok()) return Fail(plan.status());
  if (!plan->job_id().empty()) {
    // A daemon without dry runs made a real job; it must not linger.
    (void)client.DeleteJob(plan->job_id());
    return Fail("ranncd created job " + plan->job_id() + " (now deleted) instead of only "
                "planning: it does not support dry runs (rannc plan needs a newer ranncd)");
  }
  if (!plan->has_deployment()) return Fail("ranncd returned no deployment");
  if (!plan->plan_summary().empty()) {
    std::cout << plan->plan_summary();
    if (plan->plan_summary().back() != '\n') std::cout << "\n";
  } else {
    absl::StatusOr<std::string> text =
        FormatDeployment(plan->deployment(), plan->deployment().batch_size());
    if (!text.ok()) return Fail(text.status());
    std::cout << *text;
  }
  if (!flags.save.empty()) {
    std::ofstream out(flags.save, std::ios::binary | std::ios::trunc);
    out << plan->deployment().SerializeAsString();
    out.close();
    if (!out) return Fail("cannot write " + flags.save);
    std::cout << "saved the deployment to " << flags.save << "\n";
  }
  return 0;
}

int RunKeys(const std::string& format) {
  if (format == "markdown") {
    std::cout << ConfigKeysMarkdown();
  } else if (format == "python") {
    std::cout << ConfigKeysPython();
  } else {
    for (const ConfigKey& k : ConfigKeys()) {
      if (k.scope == KeyScope::kRaNNC) continue;
      std::cout << k.name << " (" << KeyScopeName(k.scope) << ", " << KeyTypeName(k.type)
                << (*k.default_value ? std::string(", default ") + k.default_value : "")
                << "): " << k.doc << "\n";
    }
  }
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app{"rannc: the command-line client of the ranncd training daemon"};
  app.require_subcommand(1);
  // Lets `--daemon` follow the subcommand too: `rannc info --daemon host:port`.
  app.fallthrough();
  std::string daemon = "127.0.0.1:7411";
  app.add_option("--daemon", daemon,
                 "ranncd address HOST:PORT, or several of one cluster (a:7411,b:7411): the "
                 "first that answers")
      ->envname("RANNC_DAEMON")
      ->capture_default_str();
  double wait_for_daemon_s = 0;
  app.add_option("--wait-for-daemon", wait_for_daemon_s,
                 "seconds to wait for the daemon to answer before the command, e.g. while it "
                 "starts or restarts (0: fail at once if it cannot be reached)")
      ->envname("RANNC_WAIT_FOR_DAEMON")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  // TLS, for a daemon started with --tls-cert (docs/security.md).
  ClientOptions client_options;
  app.add_option("--tls-ca", client_options.tls_ca, "PEM CA to verify the daemon with")
      ->envname("RANNC_TLS_CA");
  app.add_option("--tls-cert", client_options.tls_cert,
                 "PEM client certificate to present (with --tls-key)")
      ->envname("RANNC_TLS_CERT");
  app.add_option("--tls-key", client_options.tls_key, "PEM private key of --tls-cert")
      ->envname("RANNC_TLS_KEY");
  // Tokens, for a daemon started with --auth-token-file.
  std::string token_file;
  app.add_option("--token-file", token_file,
                 "file whose first line is the token to send (the admin's, or a job's)")
      ->envname("RANNC_TOKEN_FILE");

  CLI::App* info = app.add_subcommand("info", "show the daemon's version, devices and jobs");
  CLI::App* jobs = app.add_subcommand("jobs", "list the daemon's jobs");
  CLI::App* locate = app.add_subcommand(
      "locate", "say where a registered job runs now (ranncd --cluster-store), and since when");
  std::string locate_name;
  locate->add_option("name", locate_name, "the job's name")->required();

  CLI::App* resume = app.add_subcommand(
      "resume", "bring back a suspended job (ranncd --state-dir) from its latest checkpoint");
  std::string resume_job;
  resume->add_option("job", resume_job, "the suspended job: its id, or its name")->required();

  CLI::App* submit = app.add_subcommand(
      "submit", "submit a detached job (a TOML job file, docs/detached.md): the daemon trains it "
                "on its own; prints its id");
  std::string submit_file;
  bool submit_follow = false;
  submit->add_option("file", submit_file, "the job file (TOML)")->required();
  submit->add_flag("--follow,-f", submit_follow,
                   "then print its log until it ends (Ctrl-C detaches; the job trains on)");
  bool submit_upload = false, submit_no_upload = false;
  submit->add_flag("--upload", submit_upload,
                   "send the model and data files to the daemon (default: when the daemon "
                   "runs on another host)");
  submit->add_flag("--no-upload", submit_no_upload,
                   "the daemon reads the files from its own file system, at the paths given");
  CLI::App* queue = app.add_subcommand(
      "queue", "list the daemon's detached jobs: running, queued (in order), ended since it "
               "started");
  CLI::App* status = app.add_subcommand("status", "show a detached job's progress");
  std::string status_job;
  status->add_option("job", status_job, "the job's id")->required();
  CLI::App* logs = app.add_subcommand("logs", "print a detached job's log");
  std::string logs_job;
  bool logs_follow = false;
  logs->add_option("job", logs_job, "the job's id")->required();
  logs->add_flag("--follow,-f", logs_follow, "then each new line until the job ends");
  CLI::App* cancel = app.add_subcommand(
      "cancel", "stop a detached job after its current step (its checkpoints stay)");
  std::string cancel_job;
  cancel->add_option("job", cancel_job, "the job's id")->required();

  CLI::App* del = app.add_subcommand("delete", "delete a job");
  std::string delete_id;
  del->add_option("job_id", delete_id, "the job to delete")->required();

  const std::string dir_env = JobKeyEnv("checkpoint_dir");
  const std::string dir_help =
      "for a JOB that is no live job: the checkpoint_dir it wrote to (the daemon reads DIR/JOB/)";
  CLI::App* checkpoint = app.add_subcommand(
      "checkpoint", "write a checkpoint of a live job now (it needs config key checkpoint_dir)");
  std::string checkpoint_job;
  bool no_wait = false;
  checkpoint->add_option("job", checkpoint_job, "the job: its id, or its name")->required();
  checkpoint->add_flag("--no-wait", no_wait,
                       "return once the tensors are in host memory; the daemon writes them on");

  CLI::App* checkpoints = app.add_subcommand("checkpoints", "list a job's checkpoints");
  std::string checkpoints_job;
  std::string checkpoints_dir;
  checkpoints->add_option("job", checkpoints_job, "the job: its id, or its name")->required();
  CLI::Option* checkpoints_dir_option =
      checkpoints->add_option("--dir", checkpoints_dir, dir_help);

  CLI::App* export_checkpoint = app.add_subcommand(
      "export", "write a checkpoint as one file plain torch.load opens "
                "({'model': state_dict, 'optimizer': optimizer state_dict})");
  std::string export_job;
  std::string export_out;
  std::string export_dir;
  export_checkpoint
      ->add_option("job", export_job,
                   "JOB or JOB@STEP: the job (id or name) and the checkpoint's step (default: "
                   "the newest)")
      ->required();
  export_checkpoint->add_option("out", export_out, "the file to write (OUT.pt)")->required();
  CLI::Option* export_dir_option = export_checkpoint->add_option("--dir", export_dir, dir_help);
  if (!dir_env.empty()) {
    checkpoints_dir_option->envname(dir_env);
    export_dir_option->envname(dir_env);
  }

  CLI::App* train = app.add_subcommand(
      "train", "train a TorchScript language model (input_ids, targets) -> loss on a token file");
  TrainFlags flags;
  train->add_option("model", flags.model, "TorchScript file (torch.jit.save of a traced model)")
      ->required()
      ->check(CLI::ExistingFile);
  train->add_option("--tokens", flags.tokens, "flat file of token ids")
      ->required()
      ->check(CLI::ExistingFile);
  train->add_option("--token-dtype", flags.token_dtype, "width of each token in the file")
      ->check(CLI::IsMember({"uint8", "uint16", "int32"}))
      ->capture_default_str();
  train->add_option("--batch", flags.batch, "sequences per step")->required();
  train->add_option("--seq", flags.seq, "tokens per sequence")->required();
  train->add_option("--steps", flags.steps, "optimizer steps")->required();
  train->add_option("--lr", flags.lr, "learning rate (the schedule's peak)")
      ->capture_default_str();
  train->add_option("--schedule", flags.schedule,
                    "lr schedule after the warmup: constant, or linear / cosine decay to "
                    "--min-lr at the last step (Hugging Face's)")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}))
      ->capture_default_str();
  train->add_option("--warmup", flags.warmup, "steps of linear lr warmup from 0")
      ->capture_default_str();
  train->add_option("--min-lr", flags.min_lr, "where linear and cosine decay end")
      ->capture_default_str();
  train->add_option("--optimizer", flags.optimizer, "optimizer")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  train->add_option("--weight-decay", flags.weight_decay,
                    "weight decay (default: 0.01 for adamw, 0 otherwise)");
  train->add_option("--momentum", flags.momentum, "SGD momentum")->capture_default_str();
  train->add_option("--seed", flags.seed, "seed of the batch sampler")->capture_default_str();
  train->add_option("--log-every", flags.log_every, "steps between log lines when not on a TTY")
      ->capture_default_str();
  train->add_option("--name", flags.name, "job name shown by `rannc jobs`");
  train->add_option("--lease", flags.lease_s,
                    "seconds after which the daemon deletes the job if this process died "
                    "(0: never)")
      ->capture_default_str();

  CLI::App* plan = app.add_subcommand(
      "plan", "plan a TorchScript model for N devices without creating a job (a dry run), or "
              "print a saved deployment with --show");
  PlanFlags plan_flags;
  plan->add_option("model", plan_flags.model,
                   "TorchScript file (torch.jit.save of a model traced in training mode)")
      ->check(CLI::ExistingFile);
  plan->add_option("--show", plan_flags.show,
                   "print this deployment file (for --batch) instead of planning; no daemon; "
                   "- reads the deployment from standard input")
      ->check([](const std::string& path) {
        std::string checked = path;
        return path == "-" ? std::string() : CLI::ExistingFile(checked);
      });
  plan->add_option("--devices", plan_flags.devices, "devices to plan for (need not exist)");
  plan->add_option("--device-memory", plan_flags.device_memory,
                   "memory per device, e.g. 80GiB, 512MiB, 1e9 (default: the daemon's devices')");
  plan->add_option("--batch", plan_flags.batch,
                   "global batch size; replaces dim 0 of every --input (default: the inputs' "
                   "dim 0; with --show, the planned batch)");
  plan->add_option("--input", plan_flags.inputs,
                   "one model input as DTYPE:SHAPE, e.g. int64:64x1024, in forward's order; "
                   "floating inputs are standard normal, integer inputs zeros (valid token ids "
                   "and class targets)")
      ->allow_extra_args(false);  // one value per --input, so MODEL.pt may follow it
  plan->add_option("--config", plan_flags.config,
                   "planner config KEY=VALUE, e.g. partition_num=2 (see docs/planner.md)")
      ->allow_extra_args(false);
  plan->add_option("--links", plan_flags.links,
                   "link speeds to assume, e.g. \"p2p=300GB/s,allreduce=2:150GB/s\"");
  plan->add_option("--schedule", plan_flags.schedule, "pipeline schedule (config key schedule)")
      ->check(CLI::IsMember({"1f1b", "gpipe"}));
  plan->add_option("--optimizer", plan_flags.optimizer,
                   "optimizer whose state the memory estimate counts")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  plan->add_option("--save", plan_flags.save, "write the deployment to this file");
  plan->add_option("--seed", plan_flags.seed, "seed of the random example inputs")
      ->capture_default_str();

  CLI::App* keys = app.add_subcommand(
      "keys", "list the configuration keys rannc.toml and RANNC_<KEY> may hold (no daemon)");
  std::string keys_format = "text";
  keys->add_option("--format", keys_format,
                   "text, markdown (docs/config.md's table) or python (pyrannc/_keys.py)")
      ->check(CLI::IsMember({"text", "markdown", "python"}))
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);

  if (*keys) return RunKeys(keys_format);
  if (*plan && !plan_flags.show.empty()) return RunShow(plan_flags);

  if (const char* token = std::getenv("RANNC_TOKEN"); token != nullptr) {
    client_options.token = token;
  }
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = security::ReadTokenFile(token_file, "--token-file");
    if (!token.ok()) return Fail(token.status());
    client_options.token = *token;
  }
  const security::TlsFiles tls{client_options.tls_cert, client_options.tls_key,
                               client_options.tls_ca};
  if (absl::Status files = security::CheckTlsFiles(tls, "--tls", false); !files.ok()) {
    return Fail(files);
  }
  const absl::Duration wait_for_daemon = absl::Seconds(wait_for_daemon_s);
  std::unique_ptr<Client> connected;
  if (daemon.find(',') == std::string::npos) {
    connected = std::make_unique<Client>(daemon, client_options);
    if (wait_for_daemon > absl::ZeroDuration()) {
      if (absl::Status ready = connected->WaitUntilReady(wait_for_daemon); !ready.ok()) {
        return Fail(ready);
      }
    }
  } else {
    absl::StatusOr<std::unique_ptr<Client>> any = Client::ConnectAny(
        daemon, std::max(absl::Seconds(5), wait_for_daemon), client_options);
    if (!any.ok()) return Fail(any.status());
    connected = std::move(*any);
  }
  const Client& client = *connected;
  if (*info) return RunInfo(client);
  if (*jobs) return RunJobs(client);
  if (*locate) return RunLocate(client, locate_name);
  if (*del) return RunDelete(client, delete_id);
  if (*resume) return RunResume(client, resume_job);
  if (*checkpoint) return RunCheckpoint(client, checkpoint_job, no_wait);
  if (*checkpoints) return RunCheckpoints(client, checkpoints_job, checkpoints_dir);
  if (*export_checkpoint) return RunExport(client, export_job, export_out, export_dir);
  if (*train) return RunTrain(client, flags);
  if (*submit) {
    if (submit_follow) InstallSigintHandler();
    const UploadFiles upload = submit_upload      ? UploadFiles::kYes
                               : submit_no_upload ? UploadFiles::kNo
                                                  : UploadFiles::kIfRemote;
    absl::StatusOr<int> code =
        RunSubmit(client, submit_file, submit_follow, upload, wait_for_daemon, Interrupted);
    return code.ok() ? *code : Fail(code.status());
  }
  auto done = [](const absl::Status& s) { return s.ok() ? 0 : Fail(s); };
  if (*queue) return RunQueue(client);
  if (*status) return done(RunStatus(client, status_job));
  if (*logs) {
    if (logs_follow) InstallSigintHandler();
    return done(RunLogs(client, logs_job, logs_follow, wait_for_daemon, Interrupted));
  }
  if (*cancel) return done(RunCancel(client, cancel_job));
  if (*plan) return RunPlan(client, plan_flags);
  return 2;
}

}  // namespace
}  // namespace rannc

int main(int argc, char** argv) { return rannc::Main(argc, argv); }
