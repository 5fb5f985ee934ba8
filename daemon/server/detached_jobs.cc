#include "daemon/server/detached_jobs.h"

#include <ATen/ops/ones_like.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/files.h"
#include "daemon/common/status.h"
#include "daemon/optim/lr_schedule.h"
#include "daemon/planner/deployment.h"
#include "daemon/server/detached_data.h"
#include "daemon/server/job_settings.h"

namespace rannc {
namespace {

constexpr size_t kKeptLines = 10000;
constexpr int64_t kDefaultEvalBatches = 4;

// DetachedJobSpec.optimizer: torch.optim's kinds by OptimizerKindName.
absl::StatusOr<v1::OptimizerType> OptimizerTypeNamed(const std::string& name) {
  std::vector<std::string> names;
  for (int t = v1::SGD; t <= v1::RPROP; ++t) {
    const auto type = static_cast<v1::OptimizerType>(t);
    absl::StatusOr<OptimizerKind> kind = OptimizerKindOf(type);
    if (!kind.ok()) continue;
    if (name == OptimizerKindName(*kind)) return type;
    names.push_back(OptimizerKindName(*kind));
  }
  return absl::InvalidArgumentError(absl::StrCat("optimizer: unknown '", name, "'; one of ",
                                                 absl::StrJoin(names, ", ")));
}

// DetachedJobSpec.hyper: one HyperParams field by its name.
absl::Status SetHyper(const std::string& name, double value, HyperParams* h) {
  const std::map<std::string, double*> numbers = {
      {"lr", &h->lr}, {"weight_decay", &h->weight_decay}, {"momentum", &h->momentum},
      {"dampening", &h->dampening}, {"beta1", &h->beta1}, {"beta2", &h->beta2},
      {"eps", &h->eps}, {"alpha", &h->alpha}, {"lr_decay", &h->lr_decay},
      {"initial_accumulator_value", &h->initial_accumulator_value},
      {"momentum_decay", &h->momentum_decay}, {"rho", &h->rho}, {"lambd", &h->lambd},
      {"t0", &h->t0}, {"etaminus", &h->etaminus}, {"etaplus", &h->etaplus},
      {"step_size_min", &h->step_size_min}, {"step_size_max", &h->step_size_max}};
  const std::map<std::string, bool*> flags = {
      {"nesterov", &h->nesterov}, {"amsgrad", &h->amsgrad}, {"centered", &h->centered},
      {"maximize", &h->maximize}, {"decoupled_weight_decay", &h->decoupled_weight_decay}};
  if (auto it = numbers.find(name); it != numbers.end()) {
    *it->second = value;
    return absl::OkStatus();
  }
  if (auto it = flags.find(name); it != flags.end()) {
    if (value != 0 && value != 1) {
      return absl::InvalidArgumentError(absl::StrCat("hyper ", name, " is 0 or 1, not ", value));
    }
    *it->second = value != 0;
    return absl::OkStatus();
  }
  std::vector<std::string> known;
  for (const auto& [n, p] : numbers) known.push_back(n);
  for (const auto& [n, p] : flags) known.push_back(n);
  return absl::InvalidArgumentError(absl::StrCat("hyper: unknown '", name, "'; one of ",
                                                 absl::StrJoin(known, ", ")));
}

// A job's status before it runs: `state`, no step or loss yet.
v1::DetachedStatus NewStatus(const std::string& id, const std::string& name,
                             v1::DetachedState state, int64_t steps) {
  v1::DetachedStatus status;
  status.set_job_id(id);
  status.set_name(name);
  status.set_state(state);
  status.set_steps(steps);
  status.set_eval_loss(std::numeric_limits<double>::quiet_NaN());
  return status;
}

// `line` as a line of its job's log file: one line of JSON (its text's newlines escaped); ""
// if it cannot be written so.
std::string LogFileLine(const v1::DetachedLogLine& line) {
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(line, &json).ok()) return "";
  json.push_back('\n');
  return json;
}

// The status of a recorded job a restarted daemon has yet to resubmit.
v1::DetachedStatus ResubmittingStatus(const std::string& id) {
  v1::DetachedStatus status = NewStatus(id, "", v1::DETACHED_QUEUED, 0);  // its record unread
  status.set_waiting_for("resubmitted after the daemon's restart: being checked and planned");
  return status;
}

}  // namespace

std::vector<std::string> NamedFiles(const v1::DetachedJobSpec& spec) {
  std::vector<std::string> out;
  for (const std::string* path : {&spec.model_path(), &spec.tokens_path(),
                                  &spec.eval_tokens_path(), &spec.dataset_path(),
                                  &spec.eval_dataset_path()}) {
    if (!path->empty()) out.push_back(*path);
  }
  return out;
}

struct DetachedJobs::Entry {
  std::string id;
  v1::DetachedJobSpec spec;
  v1::JobSpec job_spec;
  std::string model;
  std::unique_ptr<BatchSource> train, eval;  // eval: null without held-out data
  LrSchedule schedule;
  v1::HyperParams hyper;  // the one group's, lr from the schedule at each step
  std::vector<at::Tensor> examples;  // the first batch, which the job is planned and made with
  std::vector<uint64_t> need;         // its plan's bytes per device (Hooks::need)
  std::atomic<bool> cancel{false};
  std::thread thread;
  // Guarded by DetachedJobs::mu_.
  v1::DetachedStatus status;
  std::deque<v1::DetachedLogLine> lines;
  int64_t next_seq = 1;
  // Whether each line is also appended to LogPath(id): while its record is kept. Guarded by
  // file_mu, which orders the appends with DropRecord's removal.
  std::mutex file_mu;
  bool durable = false;
  bool stopped = false;  // with the daemon, to resume at its next start; guarded by mu_
  std::shared_ptr<Job> job;  // while running
  std::chrono::steady_clock::time_point started;
  std::chrono::steady_clock::time_point queued;  // when it joined the queue
};

DetachedJobs::DetachedJobs(Hooks hooks, std::string records_dir)
    : hooks_(std::move(hooks)), records_dir_(std::move(records_dir)) {
  // Listed here, before the daemon serves its first call, not in ResubmitRecorded (after the
  // cluster is joined): a client asking about a recorded job in between gets it queued.
  if (records_dir_.empty()) return;
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(records_dir_);
  if (!names.ok()) return;  // none yet
  for (const std::string& name : *names) {
    if (absl::EndsWith(name, ".json")) resubmitting_.insert(name.substr(0, name.size() - 5));
  }
}

void DetachedJobs::ResubmitRecorded() {
  std::set<std::string> recorded;
  {
    std::lock_guard<std::mutex> lock(mu_);
    recorded = resubmitting_;
  }
  for (const std::string& id : recorded) {
    if (stopping_) break;  // the rest stay recorded, for the next start
    v1::DetachedJobSpec spec;
    absl::Status read = checkpoint::ReadJsonFile(RecordPath(id), &spec);
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled = cancelled_early_.count(id) > 0;
    }
    absl::StatusOr<std::string> again =
        cancelled ? absl::CancelledError("cancelled before the restarted daemon resubmitted it")
        : read.ok() ? SubmitAs(id, spec, /*resume=*/true)
                    : absl::StatusOr<std::string>(read);
    if (again.ok()) {
      spdlog::info("detached job {} '{}' resubmitted after the restart", id, spec.name());
    } else if (stopping_) {
      spdlog::info("detached job {} is left for the next start: the daemon is stopping", id);
    } else {
      spdlog::error("detached job {} was not resubmitted after the restart: {}", id,
                    again.status().ToString());
      // Its status and log say why, rather than the id becoming unknown (AddEnded drops its
      // record and log file).
      AddEnded(id, spec, cancelled ? v1::DETACHED_CANCELLED : v1::DETACHED_FAILED,
               cancelled ? std::string(again.status().message())
                         : absl::StrCat("could not be resubmitted after the daemon's restart: ",
                                        again.status().message()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      resubmitting_.erase(id);
      cancelled_early_.erase(id);
    }
    changed_.notify_all();
  }
}

void DetachedJobs::AddEnded(const std::string& id, const v1::DetachedJobSpec& spec,
                            v1::DetachedState state, const std::string& why) {
  auto e = std::make_unique<Entry>();
  e->id = id;
  e->spec = spec;
  Entry* entry = e.get();
  entry->status = NewStatus(id, spec.name().empty() ? id : spec.name(), state, spec.steps());
  if (state == v1::DETACHED_FAILED) entry->status.set_error(why);
  RestoreLog(id, entry);  // what it logged before the restart, then why it ends
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[id] = std::move(e);
  }
  EndRun(entry,
         absl::StrCat(state == v1::DETACHED_CANCELLED ? "cancelled: " : "failed: ", why));
}

DetachedJobs::~DetachedJobs() { Stop(); }

void DetachedJobs::Stop() {
  std::vector<Entry*> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // under mu_: SubmitAs starts no job after this
    for (auto& [id, entry] : jobs_) {
      entry->cancel = true;
      entries.push_back(entry.get());
    }
  }
  changed_.notify_all();
  for (Entry* e : entries) {
    if (e->thread.joinable()) e->thread.join();
  }
}

std::string DetachedJobs::RecordPath(const std::string& id) const {
  return JoinPath(records_dir_, id + ".json");
}

std::string DetachedJobs::LogPath(const std::string& id) const {
  return JoinPath(records_dir_, id + ".log");
}

void DetachedJobs::RestoreLog(const std::string& id, Entry* entry) {
  if (records_dir_.empty() || !PathExists(LogPath(id))) return;
  absl::StatusOr<std::string> text = ReadFile(LogPath(id));
  if (!text.ok()) {
    spdlog::warn("detached job {}: its log before the restart is lost: {}", id,
                 text.status().ToString());
    return;
  }
  std::vector<v1::DetachedLogLine> lines;
  for (absl::string_view json : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    v1::DetachedLogLine line;
    if (google::protobuf::util::JsonStringToMessage(std::string(json), &line).ok()) {
      lines.push_back(std::move(line));
    }
  }
  std::stable_sort(lines.begin(), lines.end(), [](const auto& a, const auto& b) {
    return a.seq() < b.seq();
  });
  const size_t first = lines.size() > kKeptLines ? lines.size() - kKeptLines : 0;
  if (first > 0) {  // the file is cut to what is kept, so that it grows by one run's lines only
    std::string kept;
    for (size_t i = first; i < lines.size(); ++i) kept += LogFileLine(lines[i]);
    (void)WriteFileDurably(LogPath(id), kept.data(), kept.size());
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = first; i < lines.size(); ++i) entry->lines.push_back(std::move(lines[i]));
  if (!entry->lines.empty()) entry->next_seq = entry->lines.back().seq() + 1;
}

void DetachedJobs::DropRecord(Entry* entry) {
  if (records_dir_.empty()) return;
  std::lock_guard<std::mutex> lock(entry->file_mu);
  entry->durable = false;
  // The log first: a crash between the two leaves a record, resubmitted without its old log,
  // never a log file no record names.
  (void)RemoveTree(LogPath(entry->id));
  (void)RemoveTree(RecordPath(entry->id));
}

void DetachedJobs::EndRun(Entry* entry, const std::string& last_line) {
  DropRecord(entry);
  if (hooks_.ended) hooks_.ended(entry->spec);  // its uploads go
  Log(entry, last_line);
}

absl::StatusOr<std::string> DetachedJobs::Submit(const v1::DetachedJobSpec& spec) {
  return SubmitAs(hooks_.new_id(), spec, /*resume=*/false);
}

absl::StatusOr<std::string> DetachedJobs::SubmitAs(const std::string& id,
                                                   const v1::DetachedJobSpec& spec, bool resume) {
  auto e = std::make_unique<Entry>();
  e->id = id;
  e->spec = spec;
  if (spec.batch() <= 0 || spec.steps() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch (", spec.batch(), ") and steps (",
                                                   spec.steps(), ") must be positive"));
  }
  if (spec.eval_every() < 0 || spec.eval_batches() < 0) {
    return absl::InvalidArgumentError("eval_every and eval_batches must not be negative");
  }
  if (spec.eval_batches() == 0) e->spec.set_eval_batches(kDefaultEvalBatches);
  absl::StatusOr<std::string> model = ReadFile(spec.model_path());
  if (!model.ok()) return Annotate(model.status(), "model");
  e->model = std::move(*model);
  absl::StatusOr<std::unique_ptr<BatchSource>> train = OpenTrainingData(spec);
  if (!train.ok()) return train.status();
  e->train = std::move(*train);
  absl::StatusOr<std::unique_ptr<BatchSource>> eval = OpenEvalData(e->spec, *e->train);
  if (!eval.ok()) return eval.status();
  e->eval = std::move(*eval);

  absl::StatusOr<v1::OptimizerType> type = OptimizerTypeNamed(spec.optimizer());
  if (!type.ok()) return type.status();
  absl::StatusOr<OptimizerKind> kind = OptimizerKindOf(*type);
  if (!kind.ok()) return Annotate(kind.status(), "optimizer");
  HyperParams hyper = DefaultHyperParams(*kind);
  for (const auto& [name, value] : spec.hyper()) {
    if (absl::Status set = SetHyper(name, value, &hyper); !set.ok()) return set;
  }
  if (absl::Status valid = ValidateHyperParams(*kind, hyper); !valid.ok()) {
    return Annotate(valid, "hyper");
  }
  e->hyper = ToProto(hyper);
  absl::StatusOr<LrSchedule::Kind> schedule =
      ParseLrScheduleKind(spec.schedule().empty() ? "constant" : spec.schedule());
  if (!schedule.ok()) return Annotate(schedule.status(), "schedule");
  e->schedule = {*schedule, hyper.lr, spec.warmup_steps(), spec.min_lr(), spec.steps()};
  if (absl::Status valid = e->schedule.Validate(); !valid.ok()) {
    return Annotate(valid, "schedule");
  }

  v1::JobSpec& js = e->job_spec;
  js.set_name(spec.name().empty() ? id : spec.name());
  js.mutable_mode()->set_training(true);
  js.mutable_mode()->set_dropout(true);
  js.mutable_optimizer()->set_type(*type);  // one group of every parameter
  js.mutable_options()->set_check_unused_values(true);
  js.mutable_options()->set_gather_inputs(true);
  *js.mutable_options()->mutable_config() = spec.config();
  if (resume && spec.config().count("checkpoint_dir")) {
    (*js.mutable_options()->mutable_config())["resume"] = "latest";
  }
  for (const std::string& name : e->train->InputNames()) js.add_input_names(name);
  js.set_model_bytes(e->model.size());
  // Planned now, on the first batch (the examples the job is made with): bad config keys, a
  // model that does not take the data, or a plan that can never fit the devices are refused
  // here rather than queued.
  e->examples = e->train->Next();
  e->train->Reset();
  absl::StatusOr<Hooks::Need> need = hooks_.need(js, e->model, e->examples);
  if (!need.ok()) return need.status();
  e->need = std::move(need->bytes);
  // The job starts with this plan (load_deployment), checked against the model again but not
  // planned twice.
  js.mutable_options()->set_load_deployment(std::move(need->plan));
  // Every id of the data, not only the first batch's, within what the model indexes with it.
  for (const IndexBound& bound : need->bounds) {
    for (BatchSource* data : {e->train.get(), e->eval.get()}) {
      if (data == nullptr) continue;
      absl::Status in_range = data->CheckRange(bound.input, bound.limit, bound.ignore,
                                               bound.what);
      if (!in_range.ok()) return in_range;
    }
  }

  Entry* entry = e.get();
  if (!records_dir_.empty() && !resume) {
    absl::Status made = MakeDirs(records_dir_);
    absl::StatusOr<std::string> json = checkpoint::ToJson(spec);
    if (made.ok() && !json.ok()) made = json.status();
    if (made.ok()) made = WriteFileDurably(RecordPath(id), json->data(), json->size());
    if (made.ok()) {
      entry->durable = true;
    } else {
      spdlog::warn("detached job {} runs, but is not durable: {}", id, made.ToString());
    }
  } else if (!records_dir_.empty()) {
    RestoreLog(id, entry);  // the log goes on where the last run's ended
    entry->durable = true;
  }
  Log(entry, absl::StrFormat("%s: %s, %d steps of batch %d from %s",
                             resume ? "resubmitted after the daemon's restart" : "submitted",
                             spec.model_path(), spec.steps(), spec.batch(),
                             entry->train->Describe()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {  // Stop() has listed the jobs it waits for: this one would not be
      if (!resume) DropRecord(entry);
      return absl::UnavailableError("the daemon is stopping; submit the job to another one");
    }
    entry->status = NewStatus(id, js.name(), v1::DETACHED_QUEUED, spec.steps());
    // Cancelled while it was being resubmitted (checked and planned): it ends before it starts.
    if (cancelled_early_.count(id)) entry->cancel = true;
    jobs_[id] = std::move(e);
    entry->queued = std::chrono::steady_clock::now();
    queue_.push_back(id);
    OrderQueueLocked();
    entry->thread = std::thread([this, entry] { Run(entry); });
  }
  return id;
}

void DetachedJobs::OrderQueueLocked() {
  const auto now = std::chrono::steady_clock::now();
  const std::chrono::milliseconds aging = queue_aging_.load();
  auto effective = [&](const Entry& e) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - e.queued);
    return static_cast<int64_t>(e.spec.priority()) +
           (aging.count() > 0 ? static_cast<int64_t>(waited / aging) : 0);
  };
  std::stable_sort(queue_.begin(), queue_.end(), [&](const std::string& a, const std::string& b) {
    const Entry& x = *jobs_.at(a);
    const Entry& y = *jobs_.at(b);
    const int64_t px = effective(x), py = effective(y);
    return px != py ? px > py : x.queued < y.queued;
  });
}

void DetachedJobs::Log(Entry* entry, const std::string& text) {
  spdlog::info("detached job {}: {}", entry->id, text);
  v1::DetachedLogLine line;
  {
    std::lock_guard<std::mutex> lock(mu_);
    line.set_seq(entry->next_seq++);
    line.set_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count());
    line.set_text(text);
    entry->lines.push_back(line);
    if (entry->lines.size() > kKeptLines) entry->lines.pop_front();
  }
  changed_.notify_all();
  std::lock_guard<std::mutex> lock(entry->file_mu);
  if (!entry->durable) return;
  // In one append: a crash cuts at most the last line, which RestoreLog skips. Lines logged at
  // once by two threads may land out of order; RestoreLog orders them.
  const std::string json = LogFileLine(line);
  if (json.empty()) return;
  absl::Status appended = AppendToFile(LogPath(entry->id), json);
  if (!appended.ok()) {
    spdlog::warn("detached job {}: its log is no longer kept on disk: {}", entry->id,
                 appended.ToString());
    entry->durable = false;
  }
}

void DetachedJobs::Finish(Entry* entry, v1::DetachedState state, const std::string& error) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = std::move(entry->job);
    DequeueLocked(entry->id);
  }
  if (job != nullptr) {
    job.reset();
    hooks_.remove(entry->id);
  }
  const bool resumes = stopping_ && state == v1::DETACHED_CANCELLED;
  if (resumes) {
    // Not ended: queued for the daemon's next start, which resumes it (a client following its
    // log follows it there).
    Log(entry, "stopped with the daemon; it resumes when the daemon starts again");
    state = v1::DETACHED_QUEUED;
  } else {
    const char* name = state == v1::DETACHED_DONE ? "done"
                       : state == v1::DETACHED_FAILED ? "failed"
                                                      : "cancelled";
    EndRun(entry, absl::StrCat(name, error.empty() ? "" : ": ", error));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    entry->status.set_state(state);
    entry->status.set_error(error);
    entry->status.clear_device_bytes();
    if (resumes) {
      entry->status.set_waiting_for("the daemon to start again (stopped with it)");
      entry->stopped = true;
    }
  }
  changed_.notify_all();
  // Only the status and the log outlive the run (Finish runs on the job's own thread).
  std::string().swap(entry->model);
  entry->train.reset();
  entry->eval.reset();
}

void DetachedJobs::Run(Entry* entry) {
  const v1::DetachedJobSpec& spec = entry->spec;
  // Wait for the turn (by priority, raised by the time waited, then FIFO), then for the memory:
  // the job starts once its plan fits what the other jobs leave free, and every daemon of the
  // cluster answers; it looks again whenever a job ends, and at least every second. A job of a
  // higher priority submitted meanwhile goes first.
  std::shared_ptr<Job> job;
  std::string waiting_for;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Looked at every second too: waiting raises a job's place (queue_aging).
      while (!entry->cancel && (queue_.empty() || queue_.front() != entry->id)) {
        OrderQueueLocked();
        if (!queue_.empty() && queue_.front() == entry->id) {
          changed_.notify_all();  // the job it passed waits for its turn again
          break;
        }
        changed_.wait_for(lock, std::chrono::seconds(1));
      }
    }
    if (entry->cancel) return Finish(entry, v1::DETACHED_CANCELLED, "");
    const std::string short_of = hooks_.short_of(entry->need);
    absl::StatusOr<std::shared_ptr<Job>> made =
        short_of.empty() ? hooks_.start(entry->id, entry->job_spec, entry->model, entry->examples)
                         : absl::StatusOr<std::shared_ptr<Job>>(
                               absl::ResourceExhaustedError(short_of));
    if (made.ok()) {
      job = std::move(*made);
      break;
    }
    // Short of memory, or the cluster not whole yet (a daemon restarted before its peers
    // answer it: UNAVAILABLE): the job waits; anything else fails it.
    const absl::StatusCode code = made.status().code();
    if (code != absl::StatusCode::kResourceExhausted && code != absl::StatusCode::kUnavailable) {
      return Finish(entry, v1::DETACHED_FAILED, std::string(made.status().message()));
    }
    if (waiting_for != made.status().message()) {
      waiting_for = std::string(made.status().message());
      const char* what = code == absl::StatusCode::kUnavailable ? "the cluster" : "device memory";
      Log(entry, absl::StrCat("waiting for ", what, ": ", waiting_for));
      std::lock_guard<std::mutex> lock(mu_);
      entry->status.set_waiting_for(waiting_for);
    }
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, std::chrono::seconds(1), [&] { return entry->cancel.load(); });
  }
  const int64_t resumed = std::max<int64_t>(job->resumed_step(), 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    DequeueLocked(entry->id);
    entry->job = job;
    entry->started = std::chrono::steady_clock::now();
    entry->status.set_state(v1::DETACHED_RUNNING);
    entry->status.clear_waiting_for();
    entry->status.set_step(resumed);
    entry->status.set_plan_summary(std::string(
        absl::StripTrailingAsciiWhitespace(planner::DescribeDeployment(job->info().plan))));
  }
  changed_.notify_all();
  Log(entry, absl::StrCat("running on ", absl::StrJoin(job->info().devices, ","), ": ",
                          absl::StripTrailingAsciiWhitespace(
                              planner::DescribeDeployment(job->info().plan)),
                          resumed > 0 ? absl::StrCat("; resumed at step ", resumed) : ""));

  // The training batches, past those a resumed job has trained on, drawn ahead on a thread.
  entry->train->Skip(resumed);
  const int64_t batch_tokens = entry->train->TokensPerBatch();
  BatchPrefetcher batches(std::move(entry->train));
  const OptimizerKind kind = job->optimizer_kind();
  const int64_t log_every = std::max<int64_t>(1, spec.steps() / 20);
  const double tokens_per_step = static_cast<double>(batch_tokens);

  auto evaluate = [&](int64_t step) -> absl::Status {
    if (!entry->eval) return absl::OkStatus();
    entry->eval->Reset();
    const int64_t n = EvalBatches(spec, *entry->eval);
    double sum = 0;
    for (int64_t b = 0; b < n; ++b) {
      absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, entry->eval->Next(), false);
      if (!out.ok()) return Annotate(out.status(), "evaluation");
      sum += (*out)[0].item<double>();
    }
    const double loss = sum / static_cast<double>(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      entry->status.set_eval_loss(loss);
      entry->status.set_eval_step(step);
    }
    Log(entry, absl::StrFormat("eval step %d/%d loss %.6f", step, spec.steps(), loss));
    return absl::OkStatus();
  };

  absl::Status failed;
  int64_t step = resumed;
  while (step < spec.steps() && !entry->cancel) {
    ++step;
    std::vector<at::Tensor> batch = batches.Next();
    JobOp zero;
    zero.kind = JobOp::Kind::kZeroGrad;
    zero.set_to_none = true;
    failed = job->Run(0, zero).status();
    if (!failed.ok()) break;
    absl::StatusOr<std::vector<at::Tensor>> out = job->Forward(0, std::move(batch), true);
    if (!out.ok()) {
      failed = out.status();
      break;
    }
    if (out->size() != 1 || (*out)[0].numel() != 1) {
      failed = absl::InvalidArgumentError(absl::StrCat(
          "the model must return one scalar loss from a batch of the data; it returned ",
          out->size(), " outputs"));
      break;
    }
    const double loss = (*out)[0].item<double>();
    failed = job->Backward(0, {{0, at::ones_like((*out)[0])}}, false);
    if (!failed.ok()) break;
    v1::HyperParams hyper = entry->hyper;
    hyper.set_lr(entry->schedule.At(step));
    JobOp op;
    op.kind = JobOp::Kind::kStep;
    op.hypers.push_back(FromProto(hyper, kind));
    failed = job->Run(0, op).status();
    if (!failed.ok()) break;

    const double elapsed = SecondsSince(entry->started);
    const double rate = tokens_per_step * static_cast<double>(step - resumed) / elapsed;
    const JobMetrics::Snapshot measured = job->Measure();
    {
      std::lock_guard<std::mutex> lock(mu_);
      v1::DetachedStatus& st = entry->status;
      st.set_step(step);
      st.set_loss(loss);
      st.set_lr(hyper.lr());
      st.set_elapsed_s(elapsed);
      st.set_tokens_per_s(rate);
      st.set_eta_s(rate > 0 ? tokens_per_step * static_cast<double>(spec.steps() - step) / rate
                            : 0);
      st.clear_device_bytes();
      for (int64_t b : measured.device_bytes) st.add_device_bytes(static_cast<uint64_t>(b));
      st.set_step_seconds(measured.step_s);
      st.set_planned_step_seconds(measured.planned_step_s);
      st.set_bubble(measured.bubble);
    }
    if (step % log_every == 0 || step == resumed + 1 || step == spec.steps()) {
      Log(entry, absl::StrFormat("step %d/%d loss %.6f lr %.6g tokens/s %.1f", step,
                                 spec.steps(), loss, hyper.lr(), rate));
    }
    if ((spec.eval_every() > 0 && step % spec.eval_every() == 0) || step == spec.steps()) {
      failed = evaluate(step);
      if (!failed.ok()) break;
    }
  }
  if (!failed.ok()) return Finish(entry, v1::DETACHED_FAILED, std::string(failed.message()));
  // A cancel that came after the last step is too late to stop anything: the job is done.
  const bool stopped = entry->cancel && step < spec.steps();
  if (stopped && stopping_) CheckpointAtEnd(entry, job.get(), step, /*stopping=*/true);
  if (stopped) return Finish(entry, v1::DETACHED_CANCELLED, "");
  CheckpointAtEnd(entry, job.get(), step, /*stopping=*/false);
  Finish(entry, v1::DETACHED_DONE, "");
}

void DetachedJobs::CheckpointAtEnd(Entry* entry, Job* job, int64_t step, bool stopping) {
  const char* what = stopping ? "stopping" : "done";
  if (job->checkpoint_dir().empty()) {
    if (stopping) {
      Log(entry, absl::StrCat("stopping at step ", step,
                              " without a checkpoint (no checkpoint_dir): it resumes from the "
                              "start"));
    }
    return;
  }
  std::vector<CheckpointInfo> saved = job->Checkpoints();
  if (!saved.empty() && saved.back().step == step) {
    // checkpoint_every's own of this step (the job's writer finishes it before the job goes).
    Log(entry, absl::StrCat(what, " at step ", step, ", which checkpoint_every saved"));
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CheckpointInfo> info = job->Checkpoint(/*wait=*/true);
  if (info.ok()) {
    Log(entry, absl::StrFormat("%s: checkpoint of step %d written in %.2f s (%s)", what,
                               info->step, SecondsSince(start), info->path));
  } else {
    Log(entry, absl::StrCat(what, ": the checkpoint of step ", step, " failed",
                            stopping ? ", so the job resumes from its last one: " : ": ",
                            info.status().message()));
  }
}

void DetachedJobs::DequeueLocked(const std::string& id) {
  auto it = std::find(queue_.begin(), queue_.end(), id);
  if (it != queue_.end()) queue_.erase(it);
}

absl::StatusOr<DetachedJobs::Entry*> DetachedJobs::FindLocked(const std::string& id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no detached job ", id, " on this daemon"));
  }
  return it->second.get();
}

absl::StatusOr<v1::DetachedStatus> DetachedJobs::Status(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> entry = FindLocked(id);
  if (!entry.ok() && resubmitting_.count(id)) return ResubmittingStatus(id);
  if (!entry.ok()) return entry.status();
  v1::DetachedStatus status = (*entry)->status;
  OrderQueueLocked();
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (queue_[i] == id) status.set_queue_position(static_cast<int64_t>(i) + 1);
  }
  return status;
}

std::vector<v1::DetachedStatus> DetachedJobs::List() {
  std::lock_guard<std::mutex> lock(mu_);
  OrderQueueLocked();
  std::vector<const Entry*> running;
  std::vector<v1::DetachedStatus> queued, waiting, ended;
  for (const auto& [id, e] : jobs_) {
    const v1::DetachedState s = e->status.state();
    if (s == v1::DETACHED_RUNNING) {
      running.push_back(e.get());
    } else if (s != v1::DETACHED_QUEUED) {
      ended.push_back(e->status);
    } else if (std::find(queue_.begin(), queue_.end(), id) == queue_.end()) {
      waiting.push_back(e->status);  // stopped with the daemon
    }
  }
  for (size_t i = 0; i < queue_.size(); ++i) {
    queued.push_back(jobs_.at(queue_[i])->status);
    queued.back().set_queue_position(static_cast<int64_t>(i) + 1);
  }
  for (const std::string& id : resubmitting_) {
    if (!jobs_.count(id)) waiting.push_back(ResubmittingStatus(id));
  }
  std::sort(waiting.begin(), waiting.end(),
            [](const auto& a, const auto& b) { return a.job_id() < b.job_id(); });
  std::stable_sort(running.begin(), running.end(),
                   [](const Entry* a, const Entry* b) { return a->started < b->started; });
  std::vector<v1::DetachedStatus> out;
  for (const Entry* e : running) out.push_back(e->status);
  for (auto* part : {&queued, &waiting, &ended}) {
    for (v1::DetachedStatus& s : *part) out.push_back(std::move(s));
  }
  return out;
}

absl::Status DetachedJobs::Cancel(const std::string& id) {
  Entry* stopped = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    absl::StatusOr<Entry*> entry = FindLocked(id);
    if (!entry.ok() && resubmitting_.count(id)) {
      cancelled_early_.insert(id);  // ResubmitRecorded ends it
      return absl::OkStatus();
    }
    if (!entry.ok()) return entry.status();
    (*entry)->cancel = true;
    stopped = (*entry)->stopped ? *entry : nullptr;
    if (stopped != nullptr) {
      // Stopped with the daemon (its run over): it ends here rather than at the next start.
      stopped->stopped = false;
      stopped->status.set_state(v1::DETACHED_CANCELLED);
      stopped->status.clear_waiting_for();
    }
  }
  if (stopped != nullptr) {
    EndRun(stopped, "cancelled: it does not resume when the daemon starts again");
  }
  changed_.notify_all();
  return absl::OkStatus();
}

absl::Status DetachedJobs::Lines(const std::string& id, int64_t after_seq,
                                 std::chrono::milliseconds wait,
                                 std::vector<v1::DetachedLogLine>* out, bool* ended) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!jobs_.count(id) && resubmitting_.count(id)) {  // being resubmitted after a restart
    changed_.wait_for(lock, wait, [&] { return jobs_.count(id) || !resubmitting_.count(id); });
    if (!jobs_.count(id) && resubmitting_.count(id)) {
      *ended = false;
      return absl::OkStatus();  // no lines yet
    }
  }
  absl::StatusOr<Entry*> found = FindLocked(id);
  if (!found.ok()) return found.status();
  Entry* e = *found;
  auto over = [&] {
    const v1::DetachedState s = e->status.state();
    return s == v1::DETACHED_DONE || s == v1::DETACHED_FAILED || s == v1::DETACHED_CANCELLED;
  };
  auto fresh = [&] { return !e->lines.empty() && e->lines.back().seq() > after_seq; };
  if (wait.count() > 0) {
    changed_.wait_for(lock, wait, [&] { return fresh() || over() || stopping_; });
  }
  for (const v1::DetachedLogLine& line : e->lines) {
    if (line.seq() > after_seq) out->push_back(line);
  }
  // A daemon that stops ends every log's stream (its jobs go on at its next start).
  *ended = over() || stopping_;
  return absl::OkStatus();
}

size_t DetachedJobs::Queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

std::set<std::string> DetachedJobs::PathsInUse() {
  std::set<std::string> out;
  if (!records_dir_.empty()) {
    absl::StatusOr<std::vector<std::string>> names = ListDirectory(records_dir_);
    for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
      v1::DetachedJobSpec spec;
      if (absl::EndsWith(name, ".json") &&
          checkpoint::ReadJsonFile(JoinPath(records_dir_, name), &spec).ok()) {
        for (std::string& path : NamedFiles(spec)) out.insert(std::move(path));
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, e] : jobs_) {
    const v1::DetachedState s = e->status.state();
    if (s != v1::DETACHED_QUEUED && s != v1::DETACHED_RUNNING) continue;
    for (std::string& path : NamedFiles(e->spec)) out.insert(std::move(path));
  }
  return out;
}

}  // namespace rannc
