// JobRegistry against a real etcd on loopback: two "daemons" (a registry each, under leases of
// their own) register, refuse a name led by the other, release, and take over a job whose
// leader's lease ended, the old leader's writes fenced off.
#include "daemon/server/job_registry.h"

#include <atomic>
#include <mutex>
#include <set>

#include <catch2/catch.hpp>

#include "daemon/cluster/etcd_testing.h"

namespace rannc {
namespace {

using cluster::EtcdClient;
using cluster::LeaseKeeper;
using std::chrono::milliseconds;
using std::chrono::seconds;

v1::RegisteredJob Entry(const std::string& name, const std::string& id) {
  v1::RegisteredJob e;
  e.set_name(name);
  e.set_job_id(id);
  e.set_record_dir("/shared/ckpt/" + name);
  e.set_record_id(id);
  e.set_resumed_step(-1);
  return e;
}

struct FakeDaemon {
  FakeDaemon(EtcdClient* etcd, const std::string& address)
      : lease(etcd->GrantLease(seconds(10)).value()),
        keeper(etcd, lease, seconds(10), [](const absl::Status&) {}),
        registry(etcd, &keeper, address) {}
  int64_t lease;
  LeaseKeeper keeper;
  JobRegistry registry;
};

TEST_CASE("JobRegistry: a name is led by one daemon; its entry goes with the job", "[etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  FakeDaemon a(client->get(), "10.0.0.1:7000");
  FakeDaemon b(client->get(), "10.0.0.2:7000");

  REQUIRE(a.registry.Lead("gpt").ok());
  REQUIRE(a.registry.Publish(Entry("gpt", "job-a-1")).ok());
  v1::RegisteredJob found = a.registry.Find("gpt").value();
  CHECK(found.job_id() == "job-a-1");
  CHECK(found.leader() == "10.0.0.1:7000");
  CHECK(found.leader_revision() > 0);
  CHECK(b.registry.Find("gpt").value().job_id() == "job-a-1");
  CHECK(a.registry.EntryOf("job-a-1").has_value());
  CHECK(a.registry.Fence().ok());

  absl::Status again = a.registry.Lead("gpt");
  CHECK(again.code() == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(std::string(again.message()), Catch::Contains("job-a-1"));
  absl::Status other = b.registry.Lead("gpt");
  CHECK(other.code() == absl::StatusCode::kAlreadyExists);
  CHECK_THAT(std::string(other.message()), Catch::Contains("10.0.0.1:7000"));
  // b cannot publish what it does not lead.
  CHECK(b.registry.Publish(Entry("gpt", "job-b-1")).code() ==
        absl::StatusCode::kFailedPrecondition);
  // A takeover attempt while a leads: nothing.
  CHECK_FALSE(b.registry.TakeOver("gpt").value().has_value());

  std::optional<v1::RegisteredJob> released = a.registry.Release("job-a-1");
  REQUIRE(released.has_value());
  CHECK(released->record_dir() == "/shared/ckpt/gpt");
  CHECK(a.registry.Find("gpt").status().code() == absl::StatusCode::kNotFound);
  CHECK_FALSE(a.registry.Release("job-a-1").has_value());
  CHECK((*client)->GetPrefix(JobRegistry::kElections).value().empty());
  // Free again: b leads it now.
  REQUIRE(b.registry.Lead("gpt").ok());
  b.registry.Abandon("gpt");
  CHECK((*client)->GetPrefix(JobRegistry::kElections).value().empty());
}

TEST_CASE("JobRegistry: a job whose leader's lease ends is orphaned, taken over by one daemon, "
          "and the old leader's writes no longer land", "[etcd]") {
  testing::EtcdCluster etcd(1);
  RANNC_REQUIRE_ETCD(etcd);
  auto client = EtcdClient::Connect(etcd.endpoints(), seconds(5));
  REQUIRE(client.ok());
  auto a = std::make_unique<FakeDaemon>(client->get(), "10.0.0.1:7000");
  FakeDaemon b(client->get(), "10.0.0.2:7000");
  FakeDaemon c(client->get(), "10.0.0.3:7000");
  REQUIRE(a->registry.Lead("gpt").ok());
  v1::RegisteredJob entry = Entry("gpt", "job-a-1");
  entry.set_resumed_step(-1);
  REQUIRE(a->registry.Publish(entry).ok());

  // b and c both watch for orphans and race for them; a leads, so none yet. The callbacks run
  // on the registries' watch threads and assert nothing (Catch2 is not thread-safe while the
  // main thread asserts): they record what failed, which the main thread checks.
  std::mutex mu;
  std::vector<std::string> won;     // "b:gpt"
  std::vector<std::string> failed;  // "b: <status>"
  auto watcher = [&](FakeDaemon& d, const std::string& who) {
    d.registry.WatchOrphans([&, who](const std::string& name) {
      absl::StatusOr<std::optional<v1::RegisteredJob>> taken = d.registry.TakeOver(name);
      absl::Status published = taken.status();
      if (taken.ok() && *taken) {
        v1::RegisteredJob& e = **taken;
        e.set_job_id(who + "-2");
        e.set_generation(e.generation() + 1);
        published = d.registry.Publish(e);
      }
      std::lock_guard<std::mutex> lock(mu);
      if (!published.ok()) {
        failed.push_back(who + ": " + published.ToString());
      } else if (taken.ok() && *taken) {
        won.push_back(who + ":" + name);
      }
    }, milliseconds(200));
  };
  watcher(b, "b");
  watcher(c, "c");
  std::this_thread::sleep_for(milliseconds(500));
  {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(won.empty());
  }

  // a's lease ends (as when it dies): exactly one of b and c takes the job over.
  const int64_t old_revision = a->registry.Find("gpt").value().leader_revision();
  REQUIRE((*client)->RevokeLease(a->lease).ok());
  REQUIRE(testing::Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return !won.empty();
  }));
  std::this_thread::sleep_for(milliseconds(600));  // two more rescans each
  std::string winner;
  {
    std::lock_guard<std::mutex> lock(mu);
    INFO((failed.empty() ? std::string() : failed[0]));
    CHECK(failed.empty());
    REQUIRE(won.size() == 1);
    winner = won[0].substr(0, 1);
  }
  v1::RegisteredJob now = b.registry.Find("gpt").value();
  CHECK(now.job_id() == winner + "-2");
  CHECK(now.leader() == (winner == "b" ? "10.0.0.2:7000" : "10.0.0.3:7000"));
  CHECK(now.generation() == 1);
  CHECK(now.record_dir() == "/shared/ckpt/gpt");
  CHECK(now.leader_revision() > old_revision);
  // The old leader is fenced off: its write does not land, and its lease says it leads no more.
  CHECK(a->registry.Publish(entry).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(b.registry.Find("gpt").value().job_id() == winner + "-2");
  CHECK(testing::Eventually([&] { return a->keeper.lost(); }, seconds(5)));
  CHECK(a->registry.Fence().code() == absl::StatusCode::kUnavailable);
  a.reset();
}

}  // namespace
}  // namespace rannc
