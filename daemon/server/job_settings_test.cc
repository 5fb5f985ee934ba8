#include "daemon/server/job_settings.h"

#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

DaemonFacts TwoCpus() {
  DaemonFacts facts;
  facts.version = "1.0";
  facts.torch_version = "1.13";
  facts.devices = {{"cpu:0", "cpu", 1 << 30}, {"cpu:1", "cpu", 1 << 30}};
  return facts;
}

cluster::MemberInfo Member(const std::string& address, int rank, cluster::MemberState state,
                           bool self) {
  cluster::MemberInfo m;
  m.address = address;
  m.rank = rank;
  m.state = state;
  m.self = self;
  m.devices = {{"cpu:0", "cpu", 1 << 30}, {"cpu:1", "cpu", 1 << 30}};
  return m;
}

TEST_CASE("JobSettingsFromSpec resolves a spec for this daemon's devices", "[job]") {
  v1::JobSpec spec;
  spec.set_name("j");
  spec.mutable_optimizer()->set_type(v1::ADAM);
  spec.mutable_options()->set_enable_apex_amp(true);
  (*spec.mutable_options()->mutable_config())["amp_level"] = "o2";
  (*spec.mutable_options()->mutable_config())["partition_num"] = "2";
  absl::StatusOr<JobSettings> s = JobSettingsFromSpec(spec, TwoCpus());
  REQUIRE(s.ok());
  CHECK(s->optimizer.enabled);
  CHECK(s->optimizer.kind == OptimizerKind::kAdam);
  CHECK(s->amp == c10::ScalarType::BFloat16);
  CHECK(s->amp_o2);
  CHECK(s->amp_cast_group_bytes == int64_t{256} << 20);
  CHECK(s->planner.partition_num == 2);
  CHECK(s->plan_target.num_devices == 2);
  CHECK(s->device_names == std::vector<std::string>{"cpu:0", "cpu:1"});
  CHECK(s->created_by == "ranncd 1.0 (LibTorch 1.13)");

  for (const auto& [value, bytes] : std::vector<std::pair<std::string, int64_t>>{
           {"0", 0}, {"1MiB", int64_t{1} << 20}, {"4096", 4096}}) {
    v1::JobSpec grouped = spec;
    (*grouped.mutable_options()->mutable_config())["amp_cast_group_bytes"] = value;
    absl::StatusOr<JobSettings> g = JobSettingsFromSpec(grouped, TwoCpus());
    REQUIRE(g.ok());
    CHECK(g->amp_cast_group_bytes == bytes);
  }
  v1::JobSpec bad_group = spec;
  (*bad_group.mutable_options()->mutable_config())["amp_cast_group_bytes"] = "lots";
  absl::StatusOr<JobSettings> bad = JobSettingsFromSpec(bad_group, TwoCpus());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("amp_cast_group_bytes") != std::string::npos);

  CHECK(s->outputs_before_backward);
  v1::JobSpec late = spec;
  (*late.mutable_options()->mutable_config())["outputs_before_backward"] = "false";
  absl::StatusOr<JobSettings> l = JobSettingsFromSpec(late, TwoCpus());
  REQUIRE(l.ok());
  CHECK_FALSE(l->outputs_before_backward);
  (*late.mutable_options()->mutable_config())["outputs_before_backward"] = "soon";
  CHECK_THAT(std::string(JobSettingsFromSpec(late, TwoCpus()).status().message()),
             Catch::Contains("outputs_before_backward=soon"));

  (*spec.mutable_options()->mutable_config())["partiton_num"] = "2";
  absl::StatusOr<JobSettings> typo = JobSettingsFromSpec(spec, TwoCpus());
  CHECK(typo.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(typo.status().message().find("partition_num") != std::string::npos);

  v1::JobSpec short_lease;
  short_lease.mutable_options()->set_lease_ms(10);
  CHECK(JobSettingsFromSpec(short_lease, TwoCpus()).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("SpanCluster numbers the leader's devices first, then the others' by member rank",
          "[job]") {
  v1::JobSpec spec;
  JobSettings s = *JobSettingsFromSpec(spec, TwoCpus());
  std::vector<std::string> left_out;
  // This daemon (the leader) is rank 1; rank 2 is DOWN and left out, rank 3 comes after it.
  absl::Status spanned = SpanCluster(
      "job-1", spec,
      {Member("b:1", 1, cluster::MemberState::kUp, true),
       Member("d:1", 3, cluster::MemberState::kUp, false),
       Member("a:1", 0, cluster::MemberState::kUp, false),
       Member("c:1", 2, cluster::MemberState::kDown, false)},
      TwoCpus(), nullptr, &s, &left_out);
  REQUIRE(spanned.ok());
  CHECK(left_out == std::vector<std::string>{"c:1"});
  CHECK(s.device_names == std::vector<std::string>{"b:1/cpu:0", "b:1/cpu:1", "a:1/cpu:0",
                                                   "a:1/cpu:1", "d:1/cpu:0", "d:1/cpu:1"});
  CHECK(s.local_devices == std::vector<int>{0, 1});
  REQUIRE(s.members.size() == 2);
  CHECK(s.members[0].address == "a:1");
  CHECK(s.members[0].devices == std::vector<int>{2, 3});
  CHECK(s.members[1].address == "d:1");
  CHECK(s.members[1].devices == std::vector<int>{4, 5});
  CHECK(s.self_address == "b:1");
  CHECK(s.engine_group == "job-1");
  CHECK(s.plan_target.num_devices == 6);

  // A member not heard from yet is waited for; alone, a daemon runs the job by itself.
  JobSettings waiting = *JobSettingsFromSpec(spec, TwoCpus());
  CHECK(SpanCluster("job-2", spec,
                    {Member("a:1", 0, cluster::MemberState::kUp, true),
                     Member("b:1", 1, cluster::MemberState::kUnknown, false)},
                    TwoCpus(), nullptr, &waiting, &left_out)
            .code() == absl::StatusCode::kUnavailable);
  JobSettings alone = *JobSettingsFromSpec(spec, TwoCpus());
  REQUIRE(SpanCluster("job-3", spec, {Member("a:1", 0, cluster::MemberState::kUp, true)},
                      TwoCpus(), nullptr, &alone, &left_out)
              .ok());
  CHECK(alone.members.empty());
  CHECK(alone.plan_target.num_devices == 2);
}

TEST_CASE("PartSettings runs the leader's plan on the part's devices", "[job]") {
  v1::JobSpec spec;
  v1::PartSpec part;
  part.set_store_address("a:1");
  part.set_num_devices(4);
  part.add_local_devices(2);
  part.add_local_devices(3);
  part.set_group("job-1");
  absl::StatusOr<JobSettings> s = PartSettings(spec, part, TwoCpus());
  REQUIRE(s.ok());
  CHECK(s->is_part);
  CHECK(s->local_devices == std::vector<int>{2, 3});
  CHECK(s->engine_store_address == "a:1");
  CHECK(s->placement.size() == 4);
  CHECK(s->backend == comm::Backend::kUcx);
}

TEST_CASE("Placement puts a daemon's GPUs at its plan devices, the rest on the CPU", "[job]") {
  std::vector<DaemonFacts::Device> devices = {{"cuda:0", "cuda", 1, 0}, {"cuda:1", "cuda", 1, 1}};
  std::vector<c10::Device> p = Placement(devices, 4, {2, 3});
  REQUIRE(p.size() == 4);
  CHECK(p[0].is_cpu());
  CHECK(p[2] == c10::Device(c10::kCUDA, 0));
  CHECK(p[3] == c10::Device(c10::kCUDA, 1));
}

TEST_CASE("ApplyDryRun plans for the devices asked for", "[job]") {
  JobSettings s = *JobSettingsFromSpec(v1::JobSpec(), TwoCpus());
  v1::PlanTarget dry;
  dry.set_num_devices(8);
  dry.set_batch_size(64);
  dry.set_links("p2p=bogus");
  CHECK(ApplyDryRun(dry, &s).code() == absl::StatusCode::kInvalidArgument);
  dry.clear_links();
  REQUIRE(ApplyDryRun(dry, &s).ok());
  CHECK(s.plan_target.num_devices == 8);
  CHECK(s.plan_target.batch_size == 64);
}

}  // namespace
}  // namespace rannc
