#include "daemon/runtime/schedule.h"

#include <algorithm>
#include <set>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

// Runs every stage's ops in order across the pipeline (F(s, i) after F(s-1, i); B(s, i) after
// B(s+1, i)) and returns false if the schedule deadlocks.
bool RunsToCompletion(ScheduleKind kind, int num_stages, int m) {
  std::vector<std::vector<PipelineOp>> ops(num_stages);
  for (int s = 0; s < num_stages; ++s) ops[s] = StageOps(kind, s, num_stages, m);
  std::vector<std::set<int>> f_done(num_stages), b_done(num_stages);
  std::vector<size_t> next(num_stages, 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int s = 0; s < num_stages; ++s) {
      while (next[s] < ops[s].size()) {
        const PipelineOp& op = ops[s][next[s]];
        const bool ready = op.backward
            ? f_done[s].count(op.micro_batch) &&
                  (s + 1 == num_stages || b_done[s + 1].count(op.micro_batch))
            : s == 0 || f_done[s - 1].count(op.micro_batch);
        if (!ready) break;
        (op.backward ? b_done : f_done)[s].insert(op.micro_batch);
        ++next[s];
        progressed = true;
      }
    }
  }
  for (int s = 0; s < num_stages; ++s) {
    if (next[s] != ops[s].size()) return false;
  }
  return true;
}

TEST_CASE("Schedules run each micro-batch's forward, then its backward, once", "[runtime]") {
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
    for (int stages = 1; stages <= 6; ++stages) {
      for (int m = 1; m <= 9; ++m) {
        INFO("stages " << stages << " micro-batches " << m);
        for (int s = 0; s < stages; ++s) {
          std::vector<PipelineOp> ops = StageOps(kind, s, stages, m);
          REQUIRE(ops.size() == static_cast<size_t>(2 * m));
          std::set<int> forwarded, backwarded;
          for (const PipelineOp& op : ops) {
            if (op.backward) {
              CHECK(forwarded.count(op.micro_batch));
              CHECK(backwarded.insert(op.micro_batch).second);
            } else {
              CHECK(forwarded.insert(op.micro_batch).second);
            }
          }
        }
        CHECK(RunsToCompletion(kind, stages, m));
      }
    }
  }
}

TEST_CASE("In-flight micro-batches: 1F1B holds min(S - s, m), GPipe all m", "[runtime]") {
  for (int stages = 1; stages <= 6; ++stages) {
    for (int m = 1; m <= 9; ++m) {
      for (int s = 0; s < stages; ++s) {
        CHECK(MaxInFlight(ScheduleKind::k1F1B, s, stages, m) == std::min(stages - s, m));
        CHECK(MaxInFlight(ScheduleKind::kGPipe, s, stages, m) == m);
      }
    }
  }
}

TEST_CASE("1F1B on the last stage alternates from the start", "[runtime]") {
  std::vector<PipelineOp> last = StageOps(ScheduleKind::k1F1B, 2, 3, 3);
  std::vector<PipelineOp> expected = {{false, 0}, {true, 0}, {false, 1},
                                      {true, 1},  {false, 2}, {true, 2}};
  CHECK(last == expected);
  CHECK(StageOps(ScheduleKind::k1F1B, 3, 3, 2).empty());
  CHECK(StageOps(ScheduleKind::kGPipe, 0, 1, 0).empty());
}

}  // namespace
}  // namespace rannc
