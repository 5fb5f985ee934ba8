// SplitOptimizer against one optimizer of the same kind over the same params: its parts stepped
// on two threads at once, its Step, its state in and out, and its errors. Tolerance: none; the
// same ATen ops run on the same values, so params and state must be equal to the bit.
#include "daemon/optim/split_optimizer.h"

#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <string>
#include <thread>
#include <vector>

namespace rannc {
namespace {

// Two groups of params; part_of splits both (the params numbered across groups 0..5 go to parts
// 0, 1, 1, 0, 1, 0).
const std::vector<std::vector<std::vector<int64_t>>> kShapes = {{{3, 4}, {5}, {2, 3}},
                                                                  {{4, 4}, {6}, {7}}};
const std::vector<std::vector<int>> kPartOf = {{0, 1, 1}, {0, 1, 0}};

std::vector<ParamGroup> Groups(OptimizerKind kind, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<ParamGroup> groups;
  for (size_t g = 0; g < kShapes.size(); ++g) {
    groups.emplace_back();
    groups.back().hyper = DefaultHyperParams(kind);
    for (const auto& shape : kShapes[g]) {
      groups.back().params.push_back(at::randn(shape).requires_grad_(true));
    }
  }
  return groups;
}

std::vector<HyperParams> Hypers(OptimizerKind kind, int step) {
  HyperParams h = DefaultHyperParams(kind);
  h.lr = 0.01 / (1 + step);
  h.weight_decay = 0.1;
  if (kind == OptimizerKind::kSgd || kind == OptimizerKind::kRmsprop) h.momentum = 0.9;
  HyperParams second = h;
  second.lr = h.lr * 2;
  return {h, second};
}

// The same gradients on both sets of params; param (0, 1) only on even steps, param (1, 2)
// never, so that step counts and present state differ between params and parts.
void SetGrads(std::vector<ParamGroup>& a, std::vector<ParamGroup>& b, int step) {
  for (size_t g = 0; g < a.size(); ++g) {
    for (size_t i = 0; i < a[g].params.size(); ++i) {
      a[g].params[i].mutable_grad().reset();
      b[g].params[i].mutable_grad().reset();
      if ((g == 0 && i == 1 && step % 2 == 1) || (g == 1 && i == 2)) continue;
      at::Tensor grad = at::randn(a[g].params[i].sizes());
      a[g].params[i].mutable_grad() = grad;
      b[g].params[i].mutable_grad() = grad.clone();
    }
  }
}

void CheckSame(const std::vector<ParamGroup>& a, const std::vector<ParamGroup>& b,
               const Optimizer& oa, const Optimizer& ob) {
  for (size_t g = 0; g < a.size(); ++g) {
    for (size_t i = 0; i < a[g].params.size(); ++i) {
      INFO("param group " << g << ", param " << i);
      CHECK(at::equal(a[g].params[i], b[g].params[i]));
    }
  }
  const auto sa = oa.NamedState(), sb = ob.NamedState();
  REQUIRE(sa.size() == sb.size());
  for (size_t k = 0; k < sa.size(); ++k) {
    INFO("state entry " << k << ": " << sa[k].first);
    CHECK(sa[k].first == sb[k].first);
    CHECK(at::equal(sa[k].second, sb[k].second));
  }
  CHECK(oa.StateBytes() == ob.StateBytes());
}

TEST_CASE("A split optimizer steps as one optimizer, its parts on two threads at once",
          "[optim]") {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd, OptimizerKind::kRmsprop,
                             OptimizerKind::kAdamax, OptimizerKind::kAdagrad}) {
    INFO(OptimizerKindName(kind));
    std::vector<ParamGroup> whole_groups = Groups(kind, 7), split_groups = Groups(kind, 7);
    auto whole = MakeOptimizer(kind, whole_groups);
    REQUIRE(whole.ok());
    auto split = SplitOptimizer::Make(kind, split_groups, kPartOf, 2);
    REQUIRE(split.ok());
    CHECK((*split)->parts() == 2);
    CHECK((*split)->kind() == kind);
    at::manual_seed(11);
    for (int step = 0; step < 6; ++step) {
      SetGrads(whole_groups, split_groups, step);
      const std::vector<HyperParams> hypers = Hypers(kind, step);
      REQUIRE((*whole)->Step(hypers).ok());
      if (step % 3 == 2) {
        REQUIRE((*split)->Step(hypers).ok());
      } else {
        absl::Status other;
        std::thread thread([&] { other = (*split)->StepPart(1, hypers); });
        absl::Status first = (*split)->StepPart(0, hypers);
        thread.join();
        REQUIRE(first.ok());
        REQUIRE(other.ok());
      }
      INFO("after step " << step);
      CheckSame(whole_groups, split_groups, **whole, **split);
    }
    // Only part 0's params: 0, 3 and 5 (5 never had a gradient).
    int64_t part0 = 0;
    for (const auto& [name, value] : (*whole)->NamedState()) {
      const std::string index = name.substr(0, name.find('.'));
      if ((index == "0" || index == "3" || index == "5") && value.dim() > 0) {
        part0 += static_cast<int64_t>(value.nbytes());
      }
    }
    CHECK((*split)->PartStateBytes(0) == part0);
    CHECK((*split)->PartStateBytes(0) + (*split)->PartStateBytes(1) == (*split)->StateBytes());
  }
}

TEST_CASE("A split optimizer loads one optimizer's state and goes on alike", "[optim]") {
  const OptimizerKind kind = OptimizerKind::kAdamW;
  std::vector<ParamGroup> whole_groups = Groups(kind, 3), split_groups = Groups(kind, 3);
  auto whole = MakeOptimizer(kind, whole_groups);
  auto split = SplitOptimizer::Make(kind, split_groups, kPartOf, 2);
  REQUIRE(whole.ok());
  REQUIRE(split.ok());
  at::manual_seed(5);
  for (int step = 0; step < 3; ++step) {
    SetGrads(whole_groups, split_groups, step);
    REQUIRE((*whole)->Step(Hypers(kind, step)).ok());
  }
  for (size_t g = 0; g < whole_groups.size(); ++g) {
    for (size_t i = 0; i < whole_groups[g].params.size(); ++i) {
      at::NoGradGuard no_grad;
      split_groups[g].params[i].copy_(whole_groups[g].params[i]);
    }
  }
  REQUIRE((*split)->LoadNamedState((*whole)->NamedState()).ok());
  CheckSame(whole_groups, split_groups, **whole, **split);
  for (int step = 3; step < 5; ++step) {
    SetGrads(whole_groups, split_groups, step);
    REQUIRE((*whole)->Step(Hypers(kind, step)).ok());
    REQUIRE((*split)->Step(Hypers(kind, step)).ok());
    CheckSame(whole_groups, split_groups, **whole, **split);
  }
}

TEST_CASE("A split optimizer's errors name params across all groups and change nothing",
          "[optim]") {
  const OptimizerKind kind = OptimizerKind::kAdamax;  // keeps step, exp_avg and exp_inf
  std::vector<ParamGroup> groups = Groups(kind, 9);
  auto split = SplitOptimizer::Make(kind, groups, kPartOf, 2);
  REQUIRE(split.ok());
  at::manual_seed(1);
  for (auto& group : groups) {
    for (auto& p : group.params) p.mutable_grad() = at::randn(p.sizes());
  }
  REQUIRE((*split)->Step(Hypers(kind, 0)).ok());
  const auto before = (*split)->NamedState();
  auto unchanged = [&] {
    const auto now = (*split)->NamedState();
    REQUIRE(now.size() == before.size());
    for (size_t k = 0; k < now.size(); ++k) {
      CHECK(now[k].first == before[k].first);
      CHECK(at::equal(now[k].second, before[k].second));
    }
  };

  SECTION("an entry of the wrong shape, by its own name") {
    std::vector<std::pair<std::string, at::Tensor>> state = before;
    state.emplace_back("4.exp_avg", at::zeros({2}));  // param 4 is (1, 1): [6]
    const absl::Status s = (*split)->LoadNamedState(state);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.message()), Catch::Contains("'4.exp_avg'"));
    unchanged();
  }
  SECTION("a param lacking a key, named across the groups; the part loaded before restored") {
    // Part 0 (params 0, 3, 5) loads first and takes its new state; then part 1 refuses param 4
    // (its third) lacking exp_inf.
    std::vector<std::pair<std::string, at::Tensor>> state;
    for (const auto& [name, value] : before) {
      if (name == "4.exp_inf") continue;
      state.emplace_back(name, name.rfind("0.", 0) == 0 && value.dim() > 0 ? value + 1 : value);
    }
    const absl::Status s = (*split)->LoadNamedState(state);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.message()), Catch::Contains("param 4 lacks exp_inf"));
    unchanged();
  }
  SECTION("an index past the params") {
    const absl::Status s = (*split)->LoadNamedState({{"6.step", at::ones({})}});
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    unchanged();
  }
  SECTION("a step with a bad gradient in the last part steps no part") {
    std::vector<at::Tensor> values;
    for (const auto& group : groups) {
      for (const auto& p : group.params) values.push_back(p.detach().clone());
    }
    groups[1].params[1].mutable_grad() = at::randn({5});  // param 4 is [6]
    const absl::Status s = (*split)->Step(Hypers(kind, 1));
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    size_t k = 0;
    for (const auto& group : groups) {
      for (const auto& p : group.params) CHECK(at::equal(p, values[k++]));
    }
    unchanged();
  }
  SECTION("Make: a param twice, named across the groups; parts of another shape") {
    std::vector<ParamGroup> twice = Groups(kind, 9);
    twice[1].params[0] = twice[0].params[1];
    auto made = SplitOptimizer::Make(kind, twice, kPartOf, 2);
    REQUIRE_FALSE(made.ok());
    CHECK_THAT(std::string(made.status().message()),
               Catch::Contains("param group 1, param 0: appears more than once"));
    auto shape = SplitOptimizer::Make(kind, Groups(kind, 9), {{0, 1, 1}}, 2);
    CHECK(shape.status().code() == absl::StatusCode::kInvalidArgument);
    auto range = SplitOptimizer::Make(kind, Groups(kind, 9), {{0, 1, 2}, {0, 1, 0}}, 2);
    CHECK(range.status().code() == absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace rannc
