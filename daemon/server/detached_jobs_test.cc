#include "daemon/server/detached_jobs.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/files.h"

// A restarted daemon resubmits the jobs its records name, one after another, each checked and
// planned first (the `need` hook). These tests hold the daemon there, inside `need`, and ask
// what a client would ask meanwhile: the jobs are known (QUEUED), their logs wait, and a cancel
// is kept. The hooks stand in for the daemon's job making only; the records, the data files,
// the queue and the jobs' threads are DetachedJobs' own.

namespace rannc {
namespace {

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  (void)RemoveTree(dir);
  REQUIRE(MakeDirs(JoinPath(dir, "records")).ok());
  return dir;
}

// A job's spec named `name` and the files it names, under `dir`.
v1::DetachedJobSpec Spec(const std::string& dir, const std::string& name) {
  const std::vector<uint16_t> tokens(64, 3);
  std::ofstream(JoinPath(dir, "train.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()),
             static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
  std::ofstream(JoinPath(dir, "model.pt")) << "a model";  // read as bytes; `need` takes it
  v1::DetachedJobSpec spec;
  spec.set_name(name);
  spec.set_model_path(JoinPath(dir, "model.pt"));
  spec.set_tokens_path(JoinPath(dir, "train.bin"));
  spec.set_batch(2);
  spec.set_seq(4);
  spec.set_steps(5);
  spec.set_optimizer("adamw");
  return spec;
}

// A job's record, as Submit leaves it under the state dir, and the files it names.
void Record(const std::string& dir, const std::string& id) {
  absl::StatusOr<std::string> json = checkpoint::ToJson(Spec(dir, id + "-name"));
  REQUIRE(json.ok());
  REQUIRE(WriteFileDurably(JoinPath(dir, "records/" + id + ".json"), json->data(),
                           json->size())
              .ok());
}

// Hooks whose `need` blocks until Release(), then answers `answer`; `start` counts its calls.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  int needs = 0;
  bool open = false;
  int starts = 0;
  std::vector<std::string> ended;
  absl::Status answer = absl::OkStatus();

  DetachedJobs::Hooks Hooks() {
    DetachedJobs::Hooks hooks;
    hooks.need = [this](const v1::JobSpec&, const std::string&, const std::vector<at::Tensor>&)
        -> absl::StatusOr<DetachedJobs::Hooks::Need> {
      std::unique_lock<std::mutex> lock(mu);
      ++needs;
      cv.notify_all();
      cv.wait(lock, [&] { return open; });
      if (!answer.ok()) return answer;
      return DetachedJobs::Hooks::Need{};
    };
    hooks.start = [this](const std::string&, const v1::JobSpec&, const std::string&,
                         const std::vector<at::Tensor>&) -> absl::StatusOr<std::shared_ptr<Job>> {
      std::lock_guard<std::mutex> lock(mu);
      ++starts;
      return absl::UnavailableError("no job is made in this test");
    };
    hooks.remove = [](const std::string&) {};
    hooks.short_of = [](const std::vector<uint64_t>&) { return std::string(); };
    hooks.new_id = [] { return std::string("fresh"); };
    hooks.ended = [this](const v1::DetachedJobSpec& spec) {
      std::lock_guard<std::mutex> lock(mu);
      ended.push_back(spec.name());
    };
    return hooks;
  }
  void WaitInNeed() {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return needs > 0; }));
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
};

// Follows `id`'s log until it ends; its lines' texts.
std::vector<std::string> LogUntilEnded(DetachedJobs& jobs, const std::string& id) {
  std::vector<std::string> texts;
  int64_t seq = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  bool ended = false;
  while (!ended) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::vector<v1::DetachedLogLine> lines;
    REQUIRE(jobs.Lines(id, seq, std::chrono::milliseconds(200), &lines, &ended).ok());
    for (const v1::DetachedLogLine& line : lines) {
      texts.push_back(line.text());
      seq = line.seq();
    }
  }
  return texts;
}

bool Mentions(const std::vector<std::string>& texts, const std::string& part) {
  for (const std::string& t : texts) {
    if (t.find(part) != std::string::npos) return true;
  }
  return false;
}

TEST_CASE("Jobs a restarted daemon is still resubmitting are queued, and a cancel of one holds") {
  const std::string dir = FreshDir("resubmit_cancel");
  Record(dir, "job-a");
  Record(dir, "job-b");
  Gate gate;
  DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
  // Known from the start: the daemon serves calls before it resubmits (it joins its cluster
  // first).
  absl::StatusOr<v1::DetachedStatus> early = jobs.Status("job-b");
  REQUIRE(early.ok());
  CHECK(early->state() == v1::DETACHED_QUEUED);
  std::thread resubmit([&] { jobs.ResubmitRecorded(); });
  gate.WaitInNeed();  // the first of the two is being planned; the other waits its turn

  for (const std::string id : {"job-a", "job-b"}) {
    absl::StatusOr<v1::DetachedStatus> status = jobs.Status(id);
    REQUIRE(status.ok());
    CHECK(status->state() == v1::DETACHED_QUEUED);
    CHECK(status->waiting_for().find("resubmitted after the daemon's restart") !=
          std::string::npos);
    std::vector<v1::DetachedLogLine> lines;
    bool ended = true;
    REQUIRE(jobs.Lines(id, 0, std::chrono::milliseconds(20), &lines, &ended).ok());
    CHECK(!ended);
    REQUIRE(jobs.Cancel(id).ok());
  }
  CHECK(jobs.Status("job-c").status().code() == absl::StatusCode::kNotFound);
  CHECK(jobs.Cancel("job-c").code() == absl::StatusCode::kNotFound);
  gate.Release();
  resubmit.join();

  // One was cancelled inside its resubmission (it is queued, then ends at once), the other
  // before its own began (it is never planned); neither starts, and neither is left recorded.
  for (const std::string id : {"job-a", "job-b"}) {
    const std::vector<std::string> log = LogUntilEnded(jobs, id);
    CHECK(Mentions(log, "cancelled"));
    absl::StatusOr<v1::DetachedStatus> status = jobs.Status(id);
    REQUIRE(status.ok());
    CHECK(status->state() == v1::DETACHED_CANCELLED);
    CHECK(status->name() == id + "-name");
    CHECK(!PathExists(JoinPath(dir, "records/" + id + ".json")));
  }
  std::lock_guard<std::mutex> lock(gate.mu);
  CHECK(gate.needs == 1);
  CHECK(gate.starts == 0);
  CHECK(std::multiset<std::string>(gate.ended.begin(), gate.ended.end()) ==
        std::multiset<std::string>{"job-a-name", "job-b-name"});
}

TEST_CASE("A recorded job that no longer passes its checks ends failed, with the reason") {
  const std::string dir = FreshDir("resubmit_failed");
  Record(dir, "job-a");
  // What it logged before the restart comes first in its log.
  REQUIRE(AppendToFile(JoinPath(dir, "records/job-a.log"),
                       "{\"seq\": \"7\", \"unixMs\": \"1\", \"text\": \"step 5/10\"}\n")
              .ok());
  Gate gate;
  gate.answer = absl::InvalidArgumentError("unknown config key 'pipline_num'");
  DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
  std::thread resubmit([&] { jobs.ResubmitRecorded(); });
  gate.WaitInNeed();
  std::vector<v1::DetachedLogLine> none;
  bool ended = true;
  REQUIRE(jobs.Lines("job-a", 0, std::chrono::milliseconds(20), &none, &ended).ok());
  CHECK(none.empty());
  CHECK(!ended);
  gate.Release();
  resubmit.join();

  const std::vector<std::string> log = LogUntilEnded(jobs, "job-a");
  REQUIRE(log.size() == 2);
  CHECK(log[0] == "step 5/10");
  CHECK(Mentions(log, "failed: could not be resubmitted after the daemon's restart: unknown "
                      "config key 'pipline_num'"));
  CHECK(!PathExists(JoinPath(dir, "records/job-a.log")));
  absl::StatusOr<v1::DetachedStatus> status = jobs.Status("job-a");
  REQUIRE(status.ok());
  CHECK(status->state() == v1::DETACHED_FAILED);
  CHECK(status->error().find("pipline_num") != std::string::npos);
  CHECK(jobs.Cancel("job-a").ok());  // ended: nothing to do
  CHECK(!PathExists(JoinPath(dir, "records/job-a.json")));
  std::lock_guard<std::mutex> lock(gate.mu);
  CHECK(gate.starts == 0);
  CHECK(gate.ended == std::vector<std::string>{"job-a-name"});
}

// `id`'s log lines above `after` as they are now.
std::vector<v1::DetachedLogLine> LinesNow(DetachedJobs& jobs, const std::string& id,
                                          int64_t after, bool* ended) {
  std::vector<v1::DetachedLogLine> lines;
  REQUIRE(jobs.Lines(id, after, std::chrono::milliseconds(0), &lines, ended).ok());
  return lines;
}

TEST_CASE("A restarted daemon's job goes on with its log, numbered on") {
  const std::string dir = FreshDir("log_restart");
  const std::string log_path = JoinPath(dir, "records/fresh.log");
  std::vector<v1::DetachedLogLine> before;
  {
    Gate gate;  // `start` answers UNAVAILABLE: the job waits for the cluster, logging so once
    gate.Release();
    DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
    REQUIRE(jobs.Submit(Spec(dir, "kept")).value() == "fresh");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    bool ended = false;
    while (LinesNow(jobs, "fresh", 1, &ended).empty()) {  // until it says what it waits for
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(PathExists(log_path));
    jobs.Stop();  // as at SIGTERM: the job is not ended but queued for the next start
    absl::StatusOr<v1::DetachedStatus> status = jobs.Status("fresh");
    REQUIRE(status.ok());
    CHECK(status->state() == v1::DETACHED_QUEUED);
    CHECK(status->waiting_for() == "the daemon to start again (stopped with it)");
    const std::vector<v1::DetachedStatus> listed = jobs.List();
    REQUIRE(listed.size() == 1);
    CHECK(listed[0].state() == v1::DETACHED_QUEUED);
    CHECK(listed[0].queue_position() == 0);  // not in the queue: waiting for the next start
    before = LinesNow(jobs, "fresh", 0, &ended);
    CHECK(ended);  // a stopping daemon ends the log's stream
  }
  REQUIRE(before.size() == 3);
  CHECK(before[0].text().find("submitted: ") == 0);
  CHECK(before[1].text().find("waiting for the cluster: no job is made") == 0);
  CHECK(before[2].text() == "stopped with the daemon; it resumes when the daemon starts again");
  // A crash's cut line at the end is skipped.
  REQUIRE(AppendToFile(log_path, "{\"seq\": \"4\", \"te").ok());

  Gate gate;
  gate.Release();
  DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
  std::vector<v1::DetachedStatus> listed = jobs.List();  // known before it is resubmitted
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].job_id() == "fresh");
  CHECK(listed[0].waiting_for().find("resubmitted after the daemon's restart") == 0);
  jobs.ResubmitRecorded();
  listed = jobs.List();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].name() == "kept");
  bool ended = true;
  std::vector<v1::DetachedLogLine> all = LinesNow(jobs, "fresh", 0, &ended);
  CHECK(!ended);
  REQUIRE(all.size() >= 4);
  for (size_t i = 0; i < all.size(); ++i) CHECK(all[i].seq() == static_cast<int64_t>(i) + 1);
  for (size_t i = 0; i < before.size(); ++i) {
    CHECK(all[i].text() == before[i].text());
    CHECK(all[i].unix_ms() == before[i].unix_ms());
  }
  CHECK(all[3].text().find("resubmitted after the daemon's restart: ") == 0);
  // A client that had the first run's lines asks for those after them.
  std::vector<v1::DetachedLogLine> after = LinesNow(jobs, "fresh", before.back().seq(), &ended);
  REQUIRE(!after.empty());
  CHECK(after[0].seq() == 4);
  // Ended (cancelled), the job's record and log file go; its log stays in memory.
  REQUIRE(jobs.Cancel("fresh").ok());
  CHECK(Mentions(LogUntilEnded(jobs, "fresh"), "cancelled"));
  CHECK(!PathExists(JoinPath(dir, "records/fresh.json")));
  CHECK(!PathExists(log_path));
}

TEST_CASE("A job stopped with the daemon and then cancelled does not resume") {
  const std::string dir = FreshDir("stopped_cancel");
  Gate gate;
  gate.Release();
  DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
  REQUIRE(jobs.Submit(Spec(dir, "dropped")).value() == "fresh");
  jobs.Stop();
  REQUIRE(jobs.Status("fresh")->state() == v1::DETACHED_QUEUED);
  CHECK(PathExists(JoinPath(dir, "records/fresh.json")));
  REQUIRE(jobs.Cancel("fresh").ok());
  absl::StatusOr<v1::DetachedStatus> status = jobs.Status("fresh");
  REQUIRE(status.ok());
  CHECK(status->state() == v1::DETACHED_CANCELLED);
  CHECK(status->waiting_for().empty());
  CHECK(Mentions(LogUntilEnded(jobs, "fresh"),
                 "cancelled: it does not resume when the daemon starts again"));
  CHECK(!PathExists(JoinPath(dir, "records/fresh.json")));
  CHECK(!PathExists(JoinPath(dir, "records/fresh.log")));
  std::lock_guard<std::mutex> lock(gate.mu);
  CHECK(gate.ended == std::vector<std::string>{"dropped"});
}

TEST_CASE("A restarted daemon keeps the last 10,000 lines of a job's log, and cuts its file") {
  const std::string dir = FreshDir("log_cut");
  Record(dir, "job-a");
  const std::string log_path = JoinPath(dir, "records/job-a.log");
  std::string text;
  for (int seq = 1; seq <= 10005; ++seq) {
    absl::StrAppend(&text, "{\"seq\": \"", seq, "\", \"text\": \"line ", seq, "\"}\n");
  }
  REQUIRE(AppendToFile(log_path, text).ok());
  Gate gate;
  gate.Release();
  DetachedJobs jobs(gate.Hooks(), JoinPath(dir, "records"));
  jobs.ResubmitRecorded();
  bool ended = true;
  std::vector<v1::DetachedLogLine> lines = LinesNow(jobs, "job-a", 0, &ended);
  REQUIRE(lines.size() == 10000);
  CHECK(lines.front().seq() == 7);  // 6 to 10005 restored, then the resubmission's 10006
  CHECK(lines.front().text() == "line 7");
  CHECK(lines.back().seq() == 10006);
  absl::StatusOr<std::string> file = ReadFile(log_path);
  REQUIRE(file.ok());
  // The 10,000 kept, then what the resubmitted job logged (its resubmission, and what it
  // waits for if it got there): not the 10,005 and more of an uncut file.
  const auto count = std::count(file->begin(), file->end(), '\n');
  CHECK(count >= 10001);
  CHECK(count <= 10002);
  CHECK(file->find("\"line 6\"") < file->find('\n'));
  CHECK(file->find("\"line 5\"") == std::string::npos);
  REQUIRE(jobs.Cancel("job-a").ok());
  LogUntilEnded(jobs, "job-a");
}

// Where `id` waits in the queue (1: next).
int64_t Place(DetachedJobs& jobs, const std::string& id) {
  absl::StatusOr<v1::DetachedStatus> status = jobs.Status(id);
  REQUIRE(status.ok());
  REQUIRE(status->state() == v1::DETACHED_QUEUED);
  return status->queue_position();
}

TEST_CASE("A job that has waited goes before a later one of a higher priority, as aged") {
  const std::string dir = FreshDir("queue_aging");
  // The jobs never start (`start` answers UNAVAILABLE: the first waits "for the cluster" at
  // the head of the queue, the others behind it).
  for (const int64_t aging_ms : {200, 3600 * 1000}) {
    Gate gate;
    gate.Release();
    DetachedJobs::Hooks hooks = gate.Hooks();
    int made = 0;
    hooks.new_id = [&made] { return "job-" + std::to_string(++made); };
    DetachedJobs jobs(hooks, "");
    jobs.set_queue_aging(std::chrono::milliseconds(aging_ms));
    v1::DetachedJobSpec head = Spec(dir, "head");
    head.set_priority(100);
    REQUIRE(jobs.Submit(head).ok());
    absl::StatusOr<std::string> old = jobs.Submit(Spec(dir, "old"));
    REQUIRE(old.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // 5 agings of 200 ms
    v1::DetachedJobSpec higher = Spec(dir, "higher");
    higher.set_priority(2);
    absl::StatusOr<std::string> later = jobs.Submit(higher);
    REQUIRE(later.ok());
    INFO("queue_aging " << aging_ms << " ms");
    if (aging_ms == 200) {  // the old job counts 0 + 5 against the later one's 2 + 0
      CHECK(Place(jobs, *old) == 2);
      CHECK(Place(jobs, *later) == 3);
    } else {  // an hour: strict priorities
      CHECK(Place(jobs, *later) == 2);
      CHECK(Place(jobs, *old) == 3);
    }
    CHECK(Place(jobs, "job-1") == 1);
    // The list is in the queue's order.
    std::vector<std::string> listed;
    for (const v1::DetachedStatus& status : jobs.List()) listed.push_back(status.job_id());
    CHECK(listed == (aging_ms == 200 ? std::vector<std::string>{"job-1", *old, *later}
                                     : std::vector<std::string>{"job-1", *later, *old}));
  }
}

}  // namespace
}  // namespace rannc
