#include "client/detached_cli.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/common/files.h"
#include "daemon/config/toml_file.h"

namespace rannc {
namespace {

std::string Where(const std::string& path, const std::string& key, const toml::node& node) {
  return absl::StrCat("'", key, "' in ", path, " (line ", node.source().begin.line, ")");
}

// A path of the job file, absolute: relative ones are the file's directory's.
std::string Resolve(const std::string& job_file, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const std::string dir = ParentPath(job_file);
  std::string base = dir.empty() ? "." : dir;
  if (base[0] != '/') {
    char cwd[4096];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) base = JoinPath(cwd, base == "." ? "" : base);
  }
  return JoinPath(base, path);
}

absl::StatusOr<double> Number(const std::string& where, const toml::node& node) {
  if (node.is_integer()) return static_cast<double>(node.as_integer()->get());
  if (node.is_floating_point()) return node.as_floating_point()->get();
  if (node.is_boolean()) return node.as_boolean()->get() ? 1.0 : 0.0;
  return absl::InvalidArgumentError(absl::StrCat(where, " must be a number"));
}

absl::StatusOr<int64_t> Integer(const std::string& where, const toml::node& node) {
  if (!node.is_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " must be an integer"));
  }
  return node.as_integer()->get();
}

absl::StatusOr<std::string> Text(const std::string& where, const toml::node& node) {
  if (!node.is_string()) return absl::InvalidArgumentError(absl::StrCat(where, " must be text"));
  return std::string(node.as_string()->get());
}

// Sets an int64 field from `node`, failing the enclosing function on a wrong type.
#define RANNC_SET_OR_RETURN(setter, getter, where, node)        \
  do {                                                          \
    auto value = getter(where, node);                           \
    if (!value.ok()) return value.status();                     \
    spec.setter(*value);                                        \
  } while (false)

absl::Status ReadOptimizer(const std::string& path, const toml::table& table,
                           v1::DetachedJobSpec& spec) {
  for (auto&& [k, node] : table) {
    const std::string key(k.str());
    const std::string where = Where(path, "optimizer." + key, node);
    if (key == "type") {
      RANNC_SET_OR_RETURN(set_optimizer, Text, where, node);
    } else if (key == "betas" || key == "etas" || key == "step_sizes") {
      const toml::array* pair = node.as_array();
      if (pair == nullptr || pair->size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(where, " must be [a, b]"));
      }
      const char* names[3][2] = {{"beta1", "beta2"}, {"etaminus", "etaplus"},
                                 {"step_size_min", "step_size_max"}};
      const int which = key == "betas" ? 0 : key == "etas" ? 1 : 2;
      for (int i = 0; i < 2; ++i) {
        absl::StatusOr<double> v = Number(where, *pair->get(i));
        if (!v.ok()) return v.status();
        (*spec.mutable_hyper())[names[which][i]] = *v;
      }
    } else {
      absl::StatusOr<double> v = Number(where, node);
      if (!v.ok()) return v.status();
      (*spec.mutable_hyper())[key] = *v;  // the daemon names the unknown ones
    }
  }
  return absl::OkStatus();
}

const char* StateName(v1::DetachedState state) {
  switch (state) {
    case v1::DETACHED_QUEUED: return "queued";
    case v1::DETACHED_RUNNING: return "running";
    case v1::DETACHED_DONE: return "done";
    case v1::DETACHED_FAILED: return "failed";
    case v1::DETACHED_CANCELLED: return "cancelled";
    default: return "unknown";
  }
}

std::string Duration(double seconds) {
  if (!(seconds >= 0)) return "-";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// The line a progress bar shows, as tqdm's: " 37%|####      | 74/200 [00:12<00:20, 5123.4
// tokens/s, loss=2.3100]"; `width` characters of bar.
std::string ProgressLine(const v1::DetachedStatus& s, int width) {
  if (s.state() == v1::DETACHED_QUEUED) {
    return absl::StrFormat("queued (place %d)%s", s.queue_position(),
                           s.waiting_for().empty() ? "" : ": " + s.waiting_for());
  }
  const double done = s.steps() > 0 ? static_cast<double>(s.step()) / s.steps() : 0;
  const int filled = static_cast<int>(done * width);
  auto clock = [](double seconds) {
    if (!(seconds >= 0)) return std::string("?");
    const int64_t t = static_cast<int64_t>(std::llround(seconds));
    return t >= 3600 ? absl::StrFormat("%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60)
                     : absl::StrFormat("%02d:%02d", t / 60, t % 60);
  };
  return absl::StrFormat("%3.0f%%|%s%s| %d/%d [%s<%s, %.1f tokens/s, loss=%.4f]", 100 * done,
                         std::string(filled, '#'), std::string(width - filled, ' '), s.step(),
                         s.steps(), clock(s.elapsed_s()),
                         s.state() == v1::DETACHED_RUNNING ? clock(s.eta_s()) : "00:00",
                         s.tokens_per_s(), s.loss());
}

// `rannc submit --follow`'s progress bar, on the last line of a terminal (stderr), redrawn from
// the job's status twice a second by a thread of its own; log lines print above it. Nothing
// when stderr is not a terminal.
class ProgressBar {
 public:
  ProgressBar(const Client& client, std::string job)
      : client_(client), job_(std::move(job)), enabled_(::isatty(STDERR_FILENO) == 1) {
    if (enabled_) thread_ = std::thread([this] { Poll(); });
  }
  ~ProgressBar() {
    if (!enabled_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    if (!line_.empty()) std::cerr << "\n" << std::flush;  // the last bar stays
  }
  // Prints `text` on a line of its own, above the bar.
  void Print(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    if (enabled_ && !line_.empty()) std::cerr << "\r\033[K" << std::flush;
    std::cout << text << "\n" << std::flush;
    if (enabled_ && !line_.empty()) std::cerr << line_ << std::flush;
  }

 private:
  void Poll() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      absl::StatusOr<v1::DetachedStatus> s = client_.DetachedJobStatus(job_);
      lock.lock();
      if (s.ok() && !stop_) {
        line_ = ProgressLine(*s, 20);
        std::cerr << "\r\033[K" << line_ << std::flush;
      }
      changed_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stop_; });
    }
  }

  const Client& client_;
  const std::string job_;
  const bool enabled_;
  std::mutex mu_;
  std::condition_variable changed_;
  bool stop_ = false;
  std::string line_;  // the bar on screen ("" before the first)
  std::thread thread_;
};

bool Ended(v1::DetachedState state) {
  return state == v1::DETACHED_DONE || state == v1::DETACHED_FAILED ||
         state == v1::DETACHED_CANCELLED;
}

// Prints the job's log; with `follow`, until the job ends or `interrupted`, with a progress bar
// when `bar`. Returns the job's state then. A followed log whose daemon stops or goes away
// (the job not ended) is followed on, from the line after the last one printed, once the
// daemon answers again within `wait_for_daemon`; a zero wait returns the job's state then
// (QUEUED: it resumes at the daemon's next start) or the failure.
absl::StatusOr<v1::DetachedState> FollowLog(const Client& client, const std::string& job,
                                            bool follow, bool bar, absl::Duration wait_for_daemon,
                                            const std::function<bool()>& interrupted) {
  std::optional<ProgressBar> progress;
  if (bar) progress.emplace(client, job);
  int64_t after = 0;
  bool said = false;  // that it waits for the daemon: once (a stopping daemon answers a while)
  while (true) {
    absl::Status read = client.DetachedJobLogs(
        job, after, follow,
        [&](const v1::DetachedLogLine& line) {
          if (progress) {
            progress->Print(line.text());
          } else {
            std::cout << line.text() << "\n" << std::flush;
          }
          after = line.seq();
        },
        interrupted);
    absl::StatusOr<v1::DetachedStatus> status =
        read.ok() ? client.DetachedJobStatus(job) : absl::StatusOr<v1::DetachedStatus>(read);
    if (!follow || interrupted() || (status.ok() && Ended(status->state()))) {
      if (!status.ok()) return status.status();
      return status->state();
    }
    // The daemon stops (the job resumes at its next start; a stopping server cancels the calls
    // it has) or went away.
    const absl::StatusCode code = status.status().code();
    const bool unreachable =
        code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kCancelled;
    if (wait_for_daemon <= absl::ZeroDuration() || (!status.ok() && !unreachable)) {
      if (!status.ok()) return status.status();
      std::cerr << "rannc: the daemon stopped; job " << job
                << " resumes when it starts again (--wait-for-daemon follows it there)\n";
      return status->state();
    }
    if (!said) {
      std::cerr << "rannc: the daemon stopped; following job " << job
                << " on once it answers again (waiting up to "
                << absl::FormatDuration(wait_for_daemon) << " each time)\n";
      said = true;
    }
    // A stopping daemon still answers for a moment (its last lines), its log's stream ending at
    // once.
    absl::SleepFor(absl::Milliseconds(250));
    if (absl::Status ready = client.WaitUntilReady(wait_for_daemon); !ready.ok()) return ready;
  }
}

}  // namespace

absl::StatusOr<v1::DetachedJobSpec> ReadJobFile(const std::string& path) {
  if (!IsRegularFile(path)) return absl::NotFoundError(absl::StrCat("no job file ", path));
  absl::StatusOr<toml::table> parsed = ReadTomlFile(path);
  if (!parsed.ok()) return parsed.status();
  const toml::table& table = *parsed;
  v1::DetachedJobSpec spec;
  for (auto&& [k, node] : table) {
    const std::string key(k.str());
    const std::string where = Where(path, key, node);
    if (key == "name") {
      RANNC_SET_OR_RETURN(set_name, Text, where, node);
    } else if (key == "model" || key == "tokens" || key == "eval_tokens" || key == "dataset" ||
               key == "eval_dataset") {
      absl::StatusOr<std::string> file = Text(where, node);
      if (!file.ok()) return file.status();
      const std::string resolved = Resolve(path, *file);
      if (key == "model") spec.set_model_path(resolved);
      if (key == "tokens") spec.set_tokens_path(resolved);
      if (key == "eval_tokens") spec.set_eval_tokens_path(resolved);
      if (key == "dataset") spec.set_dataset_path(resolved);
      if (key == "eval_dataset") spec.set_eval_dataset_path(resolved);
    } else if (key == "token_dtype") {
      RANNC_SET_OR_RETURN(set_token_dtype, Text, where, node);
    } else if (key == "batch") {
      RANNC_SET_OR_RETURN(set_batch, Integer, where, node);
    } else if (key == "seq") {
      RANNC_SET_OR_RETURN(set_seq, Integer, where, node);
    } else if (key == "steps") {
      RANNC_SET_OR_RETURN(set_steps, Integer, where, node);
    } else if (key == "seed") {
      RANNC_SET_OR_RETURN(set_seed, Integer, where, node);
    } else if (key == "eval_every") {
      RANNC_SET_OR_RETURN(set_eval_every, Integer, where, node);
    } else if (key == "eval_batches") {
      RANNC_SET_OR_RETURN(set_eval_batches, Integer, where, node);
    } else if (key == "priority") {
      RANNC_SET_OR_RETURN(set_priority, Integer, where, node);
    } else if (key == "optimizer" && node.is_table()) {
      absl::Status read = ReadOptimizer(path, *node.as_table(), spec);
      if (!read.ok()) return read;
    } else if (key == "schedule" && node.is_table()) {
      for (auto&& [sk, sn] : *node.as_table()) {
        const std::string skey(sk.str());
        const std::string swhere = Where(path, "schedule." + skey, sn);
        if (skey == "kind") {
          RANNC_SET_OR_RETURN(set_schedule, Text, swhere, sn);
        } else if (skey == "warmup_steps") {
          RANNC_SET_OR_RETURN(set_warmup_steps, Integer, swhere, sn);
        } else if (skey == "min_lr") {
          RANNC_SET_OR_RETURN(set_min_lr, Number, swhere, sn);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat(swhere, ": unknown; schedule has kind, warmup_steps, min_lr"));
        }
      }
    } else if (key == "config" && node.is_table()) {
      for (auto&& [ck, cn] : *node.as_table()) {
        const std::string ckey(ck.str());
        std::string value;
        if (cn.is_string()) {
          value = std::string(cn.as_string()->get());
          // A directory the job writes: relative to the job file, as its other paths.
          if (ckey == "checkpoint_dir") value = Resolve(path, value);
        } else if (cn.is_integer()) {
          value = absl::StrCat(cn.as_integer()->get());
        } else if (cn.is_floating_point()) {
          value = absl::StrCat(cn.as_floating_point()->get());
        } else if (cn.is_boolean()) {
          value = cn.as_boolean()->get() ? "true" : "false";
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat(Where(path, "config." + ckey, cn), " must be text or a number"));
        }
        (*spec.mutable_config())[ckey] = value;
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown; a job file has name, model, tokens, token_dtype, eval_tokens, "
                 "dataset, eval_dataset, batch, seq, steps, seed, eval_every, eval_batches, "
                 "priority and the tables "
                 "[optimizer], [schedule], [config] (docs/detached.md)"));
    }
  }
  return spec;
}

#undef RANNC_SET_OR_RETURN

absl::StatusOr<int> RunSubmit(const Client& client, const std::string& file, bool follow,
                              UploadFiles upload, absl::Duration wait_for_daemon,
                              const std::function<bool()>& interrupted) {
  absl::StatusOr<v1::DetachedJobSpec> spec = ReadJobFile(file);
  if (!spec.ok()) return spec.status();
  if (upload == UploadFiles::kIfRemote) {
    absl::StatusOr<v1::DaemonInfo> info = client.GetInfo();
    if (!info.ok()) return info.status();
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    upload = info->hostname() != host ? UploadFiles::kYes : UploadFiles::kNo;
  }
  if (upload == UploadFiles::kYes) {
    for (std::string* path : {spec->mutable_model_path(), spec->mutable_tokens_path(),
                              spec->mutable_eval_tokens_path(), spec->mutable_dataset_path(),
                              spec->mutable_eval_dataset_path()}) {
      if (path->empty()) continue;
      absl::StatusOr<std::string> there = client.UploadFile(*path);
      if (!there.ok()) return there.status();
      *path = *there;
    }
  }
  absl::StatusOr<std::string> id = client.SubmitJob(*spec);
  if (!id.ok()) return id.status();
  std::cout << *id << "\n" << std::flush;
  if (!follow) return 0;
  absl::StatusOr<v1::DetachedState> ended =
      FollowLog(client, *id, /*follow=*/true, /*bar=*/true, wait_for_daemon, interrupted);
  if (!ended.ok()) return ended.status();
  if (interrupted()) {
    std::cout << "detached: job " << *id << " trains on (rannc status " << *id << ")\n";
    return 0;
  }
  return *ended == v1::DETACHED_DONE ? 0 : 1;
}

absl::Status RunStatus(const Client& client, const std::string& job) {
  absl::StatusOr<v1::DetachedStatus> s = client.DetachedJobStatus(job);
  if (!s.ok()) return s.status();
  std::cout << absl::StrFormat("job %s '%s': %s\n", s->job_id(), s->name(), StateName(s->state()));
  if (s->state() == v1::DETACHED_QUEUED) {
    // Not in the queue (position 0): recorded for the daemon's next start.
    std::vector<std::string> where;
    if (s->queue_position() > 0) {
      where.push_back(absl::StrFormat("place in the queue: %d", s->queue_position()));
    }
    if (!s->waiting_for().empty()) where.push_back("waiting: " + s->waiting_for());
    if (!where.empty()) std::cout << absl::StrJoin(where, "; ") << "\n";
  } else {
    const double pct = s->steps() > 0 ? 100.0 * s->step() / s->steps() : 0;
    std::cout << absl::StrFormat(
        "step %d/%d (%.0f%%)  loss %.6f  lr %.4g  %.1f tokens/s  elapsed %s  ETA %s\n",
        s->step(), s->steps(), pct, s->loss(), s->lr(), s->tokens_per_s(),
        Duration(s->elapsed_s()),
        s->state() == v1::DETACHED_RUNNING ? Duration(s->eta_s()) : std::string("-"));
  }
  if (!std::isnan(s->eval_loss())) {
    std::cout << absl::StrFormat("eval loss %.6f (after step %d)\n", s->eval_loss(),
                                 s->eval_step());
  }
  if (!s->plan_summary().empty()) std::cout << "plan: " << s->plan_summary() << "\n";
  if (s->step_seconds() > 0) {
    std::cout << absl::StrFormat("last step %.3f s (planned %.3f s), pipeline bubble %.0f%%\n",
                                 s->step_seconds(), s->planned_step_seconds(), 100 * s->bubble());
  }
  if (s->device_bytes_size() > 0) {
    std::vector<std::string> mib;
    for (uint64_t b : s->device_bytes()) mib.push_back(absl::StrCat(b >> 20, " MiB"));
    std::cout << "device memory: " << absl::StrJoin(mib, ", ") << "\n";
  }
  if (!s->error().empty()) std::cout << "error: " << s->error() << "\n";
  return absl::OkStatus();
}

absl::Status RunLogs(const Client& client, const std::string& job, bool follow,
                     absl::Duration wait_for_daemon, const std::function<bool()>& interrupted) {
  return FollowLog(client, job, follow, /*bar=*/false, wait_for_daemon, interrupted).status();
}

std::vector<std::vector<std::string>> QueueTable(const std::vector<v1::DetachedStatus>& jobs) {
  std::vector<std::vector<std::string>> rows = {{"JOB ID", "NAME", "STATE", "PLACE", "STEP",
                                                 "LOSS", "TOK/S", "ELAPSED", "ETA", "NOTE"}};
  for (const v1::DetachedStatus& s : jobs) {
    const bool started = s.step() > 0;
    const std::string note = s.state() == v1::DETACHED_FAILED ? s.error() : s.waiting_for();
    rows.push_back({s.job_id(), s.name().empty() ? "-" : s.name(), StateName(s.state()),
                    s.queue_position() > 0 ? std::to_string(s.queue_position()) : "-",
                    s.steps() > 0 ? absl::StrFormat("%d/%d", s.step(), s.steps()) : "-",
                    started ? absl::StrFormat("%.4f", s.loss()) : "-",
                    started ? absl::StrFormat("%.0f", s.tokens_per_s()) : "-",
                    started ? Duration(s.elapsed_s()) : "-",
                    s.state() == v1::DETACHED_RUNNING ? Duration(s.eta_s()) : "-",
                    note.empty() ? "-" : note});
  }
  return rows;
}

absl::Status RunCancel(const Client& client, const std::string& job) {
  absl::StatusOr<v1::DetachedStatus> before = client.DetachedJobStatus(job);
  if (!before.ok()) return before.status();
  if (Ended(before->state())) {
    std::cout << "job " << job << " has ended (" << StateName(before->state()) << ")\n";
    return absl::OkStatus();
  }
  if (absl::Status s = client.CancelJob(job); !s.ok()) return s;
  std::cout << "cancelling job " << job << ": it stops after its current step\n";
  return absl::OkStatus();
}

}  // namespace rannc
