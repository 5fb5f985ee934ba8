#include "daemon/runtime/stage_executor.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <string>
#include <thread>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "daemon/graph/ir_testing.h"
#include "daemon/runtime/micro_batch.h"

namespace rannc {
namespace {

using testing::BuildFixtureIr;
using testing::FixtureIr;

// Trains one step of `f` split into `num_stages` contiguous stages and `m` micro-batches, all
// on this thread, the way the pipeline runtime does: each stage's outputs feed later stages,
// the loss is the batch-weighted mean over micro-batches, and gradients flow back stage by
// stage (summed where a value feeds several stages). Returns the combined loss; gradients land
// in `leaves`.
// With `block_bytes` > 0 each stage runs as blocks (CreateBlocked, ParamBlockStarts) with
// `options` and `hooks`. With `share_casts` the micro-batches share their grouped casts
// (StageExecutor::ShareCasts), as the engine's do within one call.
at::Tensor PipelineStep(const FixtureIr& f, int num_stages, int m,
                        const std::vector<at::Tensor>& leaves, int64_t block_bytes = 0,
                        StageOptions options = {}, const StageBlockHooks& hooks = {},
                        bool share_casts = false) {
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  std::vector<std::unique_ptr<StageExecutor>> stages;
  for (int s = 0; s < num_stages; ++s) {
    const int first = s * n / num_stages, end = (s + 1) * n / num_stages;
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, first, end);
    REQUIRE(sub.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        block_bytes > 0
            ? StageExecutor::CreateBlocked(ir, std::move(*sub),
                                           ParamBlockStarts(ir, first, end, block_bytes), leaves,
                                           options, hooks)
            : StageExecutor::Create(ir, std::move(*sub), leaves, options);
    REQUIRE(stage.ok());
    (*stage)->ShareCasts(share_casts);
    stages.push_back(std::move(*stage));
  }
  REQUIRE(ir.values[ir.outputs[0]].is_loss);
  const int64_t batch = ir.example_batch;
  const std::vector<int64_t> sizes = SplitSizes(batch, m);
  const std::vector<int64_t> offsets = Offsets(sizes);
  at::Tensor loss = at::zeros({});
  for (int mb = 0; mb < m; ++mb) {
    std::map<int, at::Tensor> env;
    for (size_t i = 0; i < ir.num_user_inputs; ++i) {
      env[ir.inputs[i]] = i < ir.num_client_inputs
                              ? f.user_inputs[i].narrow(0, offsets[mb], sizes[mb])
                              : f.user_inputs[i];
    }
    for (auto& stage : stages) {
      std::vector<at::Tensor> in;
      for (int v : stage->data_inputs()) in.push_back(env.at(v));
      absl::StatusOr<std::vector<at::Tensor>> out = stage->Forward(mb, in, true);
      REQUIRE(out.ok());
      for (size_t i = 0; i < out->size(); ++i) env[stage->outputs()[i]] = (*out)[i];
    }
    const double weight = static_cast<double>(sizes[mb]) / batch;
    loss = loss + env.at(ir.outputs[0]).detach() * weight;
    // Backward, last stage first; d(loss)/d(micro-batch loss) = its weight.
    std::map<int, at::Tensor> grads;
    grads[ir.outputs[0]] = at::full({}, weight);
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      std::vector<at::Tensor> out_grads;
      for (int v : (*it)->outputs()) out_grads.push_back(grads.count(v) ? grads[v] : at::Tensor());
      absl::StatusOr<std::vector<at::Tensor>> in_grads = (*it)->Backward(mb, out_grads);
      REQUIRE(in_grads.ok());
      for (size_t i = 0; i < in_grads->size(); ++i) {
        if (!(*in_grads)[i].defined()) continue;
        at::Tensor& g = grads[(*it)->data_inputs()[i]];
        g = g.defined() ? g + (*in_grads)[i] : (*in_grads)[i];
      }
      CHECK((*it)->pending() == 0);
    }
  }
  return loss;
}

std::vector<at::Tensor> Leaves(const FixtureIr& f) {
  std::vector<at::Tensor> leaves;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    at::Tensor t = f.tensors[i].detach().clone();
    if (f.ir->values[f.ir->inputs[f.ir->num_user_inputs + i]].role == ValueRole::kParam) {
      t.requires_grad_(true);
    }
    leaves.push_back(t);
  }
  return leaves;
}

TEST_CASE("Stages over micro-batches give PyTorch's loss and gradients", "[runtime]") {
  for (const char* name : {"mlp", "tiny_gpt", "multi_io"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    for (int num_stages : {1, 2, 3}) {
      for (int m : {1, 2, 3}) {
        INFO(name << ": " << num_stages << " stages, " << m << " micro-batches");
        std::vector<at::Tensor> leaves = Leaves(f);
        at::Tensor loss = PipelineStep(f, num_stages, m, leaves);
        CHECK(at::allclose(loss, f.fixture.ref.at("out_0"), 1e-5, 1e-6));
        for (size_t i = 0; i < leaves.size(); ++i) {
          if (!leaves[i].requires_grad()) continue;
          const std::string& param = f.ir->tensor_names[i];
          INFO(param);
          REQUIRE(leaves[i].grad().defined());
          CHECK(at::allclose(leaves[i].grad(), f.fixture.Ref("grad", param), 1e-5, 1e-6));
        }
      }
    }
  }
}

TEST_CASE("O2's casts made in groups give bitwise the graph's own casts' results", "[runtime]") {
  FixtureIr f = testing::BuildO2FixtureIr("tiny_gpt");
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  int cast_params = 0;  // trainable, read through one cast each
  for (size_t li = 0; li < f.tensors.size(); ++li) {
    if (LowPrecisionRead(ir, static_cast<int>(li)) && f.tensors[li].requires_grad()) {
      ++cast_params;
    }
  }
  REQUIRE(cast_params > 4);
  // The groups an executor of the whole model makes, and the autograd nodes its forward's loss
  // reaches that are theirs.
  auto groups = [&](StageOptions options) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, 0, n);
    REQUIRE(sub.ok());
    std::vector<at::Tensor> leaves = Leaves(f);
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(ir, std::move(*sub), leaves, options);
    REQUIRE(stage.ok());
    std::vector<at::Tensor> in;
    for (int v : (*stage)->data_inputs()) {
      in.push_back(f.user_inputs[std::find(ir.inputs.begin(), ir.inputs.end(), v) -
                                 ir.inputs.begin()]);
    }
    absl::StatusOr<std::vector<at::Tensor>> out = (*stage)->Forward(0, in, true);
    REQUIRE(out.ok());
    std::set<torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> todo;
    if (!options.recompute) todo.push_back((*out)[0].grad_fn().get());
    int nodes = 0;
    while (!todo.empty()) {
      torch::autograd::Node* node = todo.back();
      todo.pop_back();
      if (node == nullptr || !seen.insert(node).second) continue;
      if (node->name().find("GroupCast") != std::string::npos) ++nodes;
      for (const torch::autograd::Edge& e : node->next_edges()) todo.push_back(e.function.get());
    }
    CHECK(nodes == (*stage)->num_cast_groups());
    return (*stage)->num_cast_groups();
  };
  StageOptions options;
  CHECK(groups(options) == 0);
  options.cast_group_bytes = 1;  // a group a parameter
  CHECK(groups(options) == cast_params);
  options.cast_group_bytes = int64_t{1} << 30;
  CHECK(groups(options) == 1);
  options.recompute = true;
  CHECK(groups(options) == 0);

  for (int num_stages : {1, 2}) {
    for (int m : {1, 3}) {
      for (int64_t block_bytes : {int64_t{0}, int64_t{4096}}) {
        std::vector<at::Tensor> reference = Leaves(f);
        const at::Tensor expected = PipelineStep(f, num_stages, m, reference, block_bytes);
        for (int64_t group_bytes : {int64_t{1}, int64_t{4096}, int64_t{1} << 30}) {
         for (bool share : {false, true}) {
          INFO(num_stages << " stages, " << m << " micro-batches, blocks of " << block_bytes
                          << ", groups of " << group_bytes << " bytes"
                          << (share ? ", casts shared" : ""));
          StageOptions grouped;
          grouped.cast_group_bytes = group_bytes;
          std::vector<at::Tensor> leaves = Leaves(f);
          const at::Tensor loss =
              PipelineStep(f, num_stages, m, leaves, block_bytes, grouped, {}, share);
          CHECK(at::equal(loss, expected));
          for (size_t i = 0; i < leaves.size(); ++i) {
            if (!leaves[i].requires_grad()) continue;
            INFO(ir.tensor_names[i]);
            REQUIRE(leaves[i].grad().defined());
            CHECK(leaves[i].grad().scalar_type() == at::kFloat);
            CHECK(at::equal(leaves[i].grad(), reference[i].grad()));
          }
         }
        }
      }
    }
  }
}

TEST_CASE("Shared casts are made again only when a parameter changed", "[runtime]") {
  FixtureIr f = testing::BuildO2FixtureIr("tiny_gpt");
  const IrGraph& ir = *f.ir;
  absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, 0, static_cast<int>(ir.nodes.size()));
  REQUIRE(sub.ok());
  std::vector<at::Tensor> leaves = Leaves(f);
  StageOptions options;
  options.cast_group_bytes = int64_t{1} << 30;
  absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
      StageExecutor::Create(ir, std::move(*sub), leaves, options);
  REQUIRE(stage.ok());
  REQUIRE((*stage)->num_cast_groups() == 1);
  std::vector<at::Tensor> in;
  for (int v : (*stage)->data_inputs()) {
    in.push_back(f.user_inputs[std::find(ir.inputs.begin(), ir.inputs.end(), v) -
                               ir.inputs.begin()]);
  }
  int mb = 0;
  auto loss = [&] {
    absl::StatusOr<std::vector<at::Tensor>> out = (*stage)->Forward(mb, in, true);
    REQUIRE(out.ok());
    (*stage)->Release(mb++);
    return (*out)[0].detach();
  };
  // A trainable parameter read through a cast, and a way to change its values that its version
  // counter does not see (another tensor over its memory), which only a cast made anew reads.
  size_t li = 0;
  while (!(LowPrecisionRead(ir, static_cast<int>(li)) && leaves[li].requires_grad())) ++li;
  at::Tensor& p = leaves[li];
  at::Tensor behind = at::from_blob(p.data_ptr(), p.sizes(), p.strides(), p.options());
  const at::Tensor before = p.detach().clone();

  (*stage)->ShareCasts(true);
  const at::Tensor first = loss();
  CHECK(at::equal(loss(), first));
  behind.mul_(3);
  CHECK(at::equal(loss(), first));  // the first casts, shared
  (*stage)->ShareCasts(false);
  const at::Tensor unshared = loss();  // cast anew: reads the changed values
  CHECK(!at::equal(unshared, first));

  (*stage)->ShareCasts(true);
  CHECK(at::equal(loss(), unshared));
  behind.copy_(before);
  {
    at::NoGradGuard no_grad;
    p.mul_(3);  // the version counter moves: cast again
  }
  CHECK(at::equal(loss(), unshared));
  {
    at::NoGradGuard no_grad;
    p.copy_(before);
  }
  CHECK(at::equal(loss(), first));
  // Other memory (as an upload into a new tensor would give) is cast again too.
  p.set_data(before.clone().mul_(3));
  CHECK(at::equal(loss(), unshared));
}

TEST_CASE("A stage run as blocks gives PyTorch's loss and gradients, its hooks in order",
          "[runtime]") {
  for (const char* name : {"mlp", "tiny_gpt", "multi_io"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    const IrGraph& ir = *f.ir;
    const int n = static_cast<int>(ir.nodes.size());
    for (int num_stages : {1, 2}) {
      for (int m : {1, 2}) {
        for (bool recompute : {false, true}) {
          INFO(name << ": " << num_stages << " stages, " << m << " micro-batches"
                    << (recompute ? ", recompute" : ""));
          // One byte: every node that reads a parameter starts a block.
          const std::vector<int> starts = ParamBlockStarts(ir, 0, n / num_stages, 1);
          if (num_stages == 1) REQUIRE(starts.size() > 1);
          std::vector<std::string> calls;
          StageBlockHooks hooks;
          auto logger = [&calls](const char* what) {
            return [&calls, what](int k) {
              calls.push_back(absl::StrCat(what, k));
              return absl::OkStatus();
            };
          };
          hooks.before_forward = logger("f");
          hooks.after_forward = logger("F");
          hooks.before_backward = logger("b");
          hooks.after_backward = logger("B");
          std::vector<at::Tensor> leaves = Leaves(f);
          StageOptions options;
          options.recompute = recompute;
          at::Tensor loss = PipelineStep(f, num_stages, m, leaves, 1, options, hooks);
          CHECK(at::allclose(loss, f.fixture.ref.at("out_0"), 1e-5, 1e-6));
          for (size_t i = 0; i < leaves.size(); ++i) {
            if (!leaves[i].requires_grad()) continue;
            const std::string& param = ir.tensor_names[i];
            INFO(param);
            REQUIRE(leaves[i].grad().defined());
            CHECK(at::allclose(leaves[i].grad(), f.fixture.Ref("grad", param), 1e-5, 1e-6));
          }
          // The first stage's blocks: each forward f0 F0 f1 F1 ..., each backward in reverse.
          const int K = static_cast<int>(starts.size());
          std::string forward, backward;
          for (int k = 0; k < K; ++k) forward += absl::StrCat("f", k, "F", k);
          for (int k = K - 1; k >= 0; --k) backward += absl::StrCat("b", k, "B", k);
          auto joined = [&calls](size_t from, size_t count) {
            std::string out;
            for (size_t i = from; i < from + count && i < calls.size(); ++i) out += calls[i];
            return out;
          };
          CHECK(joined(0, 2 * K) == forward);
          if (num_stages == 1) CHECK(joined(2 * K, 2 * K) == backward);
          CHECK(static_cast<int>(calls.size()) >= 4 * K * m);
        }
      }
    }
  }
}

TEST_CASE("A failing block hook fails the stage's call and leaves nothing pending", "[runtime]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  std::vector<at::Tensor> leaves = Leaves(f);
  const std::vector<int> starts = ParamBlockStarts(ir, 0, n, 1);
  REQUIRE(starts.size() > 2);
  absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, 0, n);
  REQUIRE(sub.ok());
  bool fail = true;
  StageBlockHooks hooks;
  hooks.before_forward = [&fail](int k) {
    return fail && k == 1 ? absl::ResourceExhaustedError("no room for block 1")
                          : absl::OkStatus();
  };
  absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
      StageExecutor::CreateBlocked(ir, std::move(*sub), starts, leaves, {}, hooks);
  REQUIRE(stage.ok());
  CHECK((*stage)->num_blocks() == static_cast<int>(starts.size()));
  std::vector<at::Tensor> in;
  for (int v : (*stage)->data_inputs()) {
    const auto it = std::find(ir.inputs.begin(), ir.inputs.end(), v);
    REQUIRE(it != ir.inputs.end());
    in.push_back(f.user_inputs[it - ir.inputs.begin()]);
  }
  absl::StatusOr<std::vector<at::Tensor>> out = (*stage)->Forward(0, in, true);
  CHECK(out.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK((*stage)->pending() == 0);
  fail = false;
  out = (*stage)->Forward(0, in, true);
  REQUIRE(out.ok());
  CHECK(at::allclose((*out)[0], f.fixture.ref.at("out_0"), 1e-5, 1e-6));
  // Every parameter the stage reads is some block's.
  std::set<int> read;
  for (int k = 0; k < (*stage)->num_blocks(); ++k) {
    for (int li : (*stage)->block_lifted(k)) read.insert(li);
  }
  for (size_t li = 0; li < leaves.size(); ++li) {
    if (leaves[li].requires_grad()) CHECK(read.count(static_cast<int>(li)));
  }
}

TEST_CASE("ParamBlockStarts cuts where a block's parameters would pass the limit", "[runtime]") {
  FixtureIr f = BuildFixtureIr("tiny_gpt");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  int64_t total = 0, largest_node = 0;
  for (int node = 0; node < n; ++node) {
    int64_t bytes = 0;
    for (int v : ir.nodes[node].inputs) {
      if (ir.values[v].role == ValueRole::kParam) bytes += ir.values[v].bytes;
    }
    largest_node = std::max(largest_node, bytes);
  }
  for (const IrValue& v : ir.values) {
    if (v.role == ValueRole::kParam) total += v.bytes;
  }
  CHECK(ParamBlockStarts(ir, 0, n, 0) == std::vector<int>{0});
  CHECK(ParamBlockStarts(ir, 0, n, total) == std::vector<int>{0});
  for (int64_t limit : {largest_node, 2 * largest_node, std::max(largest_node, total / 2)}) {
    INFO("limit " << limit);
    const std::vector<int> starts = ParamBlockStarts(ir, 0, n, limit);
    REQUIRE(starts.front() == 0);
    if (limit < total) CHECK(starts.size() > 1);
    for (size_t k = 0; k < starts.size(); ++k) {
      const int end = k + 1 < starts.size() ? starts[k + 1] : n;
      REQUIRE(starts[k] < end);
      std::set<int> params;
      int64_t bytes = 0;
      for (int node = starts[k]; node < end; ++node) {
        for (int v : ir.nodes[node].inputs) {
          if (ir.values[v].role == ValueRole::kParam && params.insert(v).second) {
            bytes += ir.values[v].bytes;
          }
        }
      }
      CHECK(bytes <= limit);
    }
  }
}

TEST_CASE("StageExecutor refuses a second forward of a micro-batch and a backward without one",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  std::vector<at::Tensor> leaves = Leaves(f);
  absl::StatusOr<Subgraph> sub = BuildSubgraph(*f.ir, 0, 1);
  REQUIRE(sub.ok());
  absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
      StageExecutor::Create(*f.ir, std::move(*sub), leaves);
  REQUIRE(stage.ok());
  std::vector<at::Tensor> in = {f.fixture.inputs[0]};
  REQUIRE((*stage)->Forward(0, in, true).ok());
  CHECK((*stage)->Forward(0, in, true).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*stage)->Backward(1, {at::Tensor()}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // Without gradients nothing stays pending.
  REQUIRE((*stage)->Forward(1, in, false).ok());
  CHECK((*stage)->pending() == 1);
  (*stage)->Release(0);
  CHECK((*stage)->pending() == 0);
}


at::Tensor CpuRngState() { return at::globalContext().defaultGenerator(at::kCPU).get_state(); }

int64_t Bytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

// What one step of a split returns: per micro-batch and stage, the forward's outputs and the
// backward's input gradients; the parameters' gradients; the CPU generator's state after it.
struct StepRecord {
  std::map<std::pair<int, int>, std::vector<at::Tensor>> outputs, input_grads;
  std::vector<at::Tensor> param_grads;
  at::Tensor rng_after;
};

// A step's order: micro-batch `mb`'s forward through every stage, or its backward.
struct Op {
  bool forward;
  int mb;
};

// Orders of m micro-batches, by name: all forwards first (fwd0 fwd1 bwd0 bwd1), interleaved
// (fwd0 bwd0 fwd1 bwd1), 1F1B with two in flight (fwd0 fwd1 bwd0 fwd2 bwd1 bwd2) and all
// forwards then the backwards in reverse (fwd0 fwd1 bwd1 bwd0). The last two catch a replay that
// leaves the generator where the replayed forward ended instead of where it was.
std::map<std::string, std::vector<Op>> Orders(int m) {
  std::map<std::string, std::vector<Op>> orders;
  for (int mb = 0; mb < m; ++mb) {
    orders["forwards first"].push_back({true, mb});
    orders["interleaved"].push_back({true, mb});
    orders["interleaved"].push_back({false, mb});
    orders["reverse backwards"].push_back({true, mb});
  }
  for (int mb = 0; mb < m; ++mb) {
    orders["forwards first"].push_back({false, mb});
    orders["reverse backwards"].push_back({false, m - 1 - mb});
  }
  std::vector<Op>& one_f_one_b = orders["1F1B, two in flight"];
  one_f_one_b.push_back({true, 0});
  for (int mb = 1; mb < m; ++mb) {
    one_f_one_b.push_back({true, mb});
    one_f_one_b.push_back({false, mb - 1});
  }
  one_f_one_b.push_back({false, m - 1});
  return orders;
}

// One step of `f` split into `num_stages` stages over `m` micro-batches in `order`, seeded with
// `seed`: a micro-batch's forwards in stage order, its backwards in reverse with a gradient of
// ones for each floating model output.
StepRecord RunStep(const FixtureIr& f, int num_stages, int m, const std::vector<Op>& order,
                   bool recompute, uint64_t seed) {
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  std::vector<at::Tensor> leaves = Leaves(f);
  std::vector<std::unique_ptr<StageExecutor>> stages;
  for (int s = 0; s < num_stages; ++s) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, s * n / num_stages, (s + 1) * n / num_stages);
    REQUIRE(sub.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(ir, std::move(*sub), leaves, {recompute});
    REQUIRE(stage.ok());
    stages.push_back(std::move(*stage));
  }
  const std::vector<int64_t> sizes = SplitSizes(ir.example_batch, m);
  const std::vector<int64_t> offsets = Offsets(sizes);
  std::vector<std::map<int, at::Tensor>> env(m);
  StepRecord record;
  at::manual_seed(seed);
  auto forward = [&](int mb) {
    for (size_t i = 0; i < ir.num_user_inputs; ++i) {
      env[mb][ir.inputs[i]] = i < ir.num_client_inputs
                                  ? f.user_inputs[i].narrow(0, offsets[mb], sizes[mb])
                                  : f.user_inputs[i];
    }
    for (int s = 0; s < num_stages; ++s) {
      std::vector<at::Tensor> in;
      for (int v : stages[s]->data_inputs()) in.push_back(env[mb].at(v));
      absl::StatusOr<std::vector<at::Tensor>> out = stages[s]->Forward(mb, in, true);
      REQUIRE(out.ok());
      for (size_t i = 0; i < out->size(); ++i) {
        env[mb][stages[s]->outputs()[i]] = (*out)[i];
        // Recomputing stages keep no graph: their outputs must not hold one either.
        if (recompute) CHECK(!(*out)[i].requires_grad());
      }
      record.outputs[{mb, s}] = *out;
    }
  };
  auto backward = [&](int mb) {
    std::map<int, at::Tensor> grads;
    for (int v : ir.outputs) {
      if (env[mb].at(v).is_floating_point()) grads[v] = at::ones_like(env[mb].at(v));
    }
    for (int s = num_stages - 1; s >= 0; --s) {
      std::vector<at::Tensor> out_grads;
      for (int v : stages[s]->outputs()) out_grads.push_back(grads.count(v) ? grads[v] : at::Tensor());
      absl::StatusOr<std::vector<at::Tensor>> in_grads = stages[s]->Backward(mb, out_grads);
      REQUIRE(in_grads.ok());
      for (size_t i = 0; i < in_grads->size(); ++i) {
        if (!(*in_grads)[i].defined()) continue;
        at::Tensor& g = grads[stages[s]->data_inputs()[i]];
        g = g.defined() ? g + (*in_grads)[i] : (*in_grads)[i];
      }
      record.input_grads[{mb, s}] = *in_grads;
    }
  };
  for (const Op& op : order) {
    if (op.forward) {
      forward(op.mb);
    } else {
      backward(op.mb);
    }
  }
  for (auto& stage : stages) CHECK(stage->pending() == 0);
  for (const at::Tensor& leaf : leaves) record.param_grads.push_back(leaf.grad());
  record.rng_after = CpuRngState();
  return record;
}

// Bitwise equality of two lists where undefined tensors match only undefined ones.
bool Identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !(a[i].sizes().equals(b[i].sizes()) && at::equal(a[i], b[i]))) {
      return false;
    }
  }
  return true;
}

TEST_CASE("StageExecutor with recompute returns exactly what it returns without", "[runtime]") {
  for (const char* name : {"mlp", "tiny_gpt", "dropout_net"}) {
    FixtureIr f = BuildFixtureIr(name);
    REQUIRE(f.ir.ok());
    for (int num_stages : {1, 2, 3}) {
      for (int m : {1, 2, 3}) {
        for (const auto& [order_name, order] : Orders(m)) {
          INFO(name << ": " << num_stages << " stages, " << m << " micro-batches, "
                    << order_name);
          StepRecord plain = RunStep(f, num_stages, m, order, false, 17);
          StepRecord recomputed = RunStep(f, num_stages, m, order, true, 17);
          for (const auto& [key, outputs] : plain.outputs) {
            INFO("micro-batch " << key.first << ", stage " << key.second);
            CHECK(Identical(outputs, recomputed.outputs.at(key)));
            CHECK(Identical(plain.input_grads.at(key), recomputed.input_grads.at(key)));
          }
          CHECK(Identical(plain.param_grads, recomputed.param_grads));
          // Recomputation's replay puts the generator back: the stream goes on as without it.
          CHECK(at::equal(plain.rng_after, recomputed.rng_after));
        }
      }
    }
  }
}

TEST_CASE("dropout_net's masks depend on the seed, so the equality above compares them",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("dropout_net");
  REQUIRE(f.ir.ok());
  const std::vector<Op> order = Orders(1).at("interleaved");
  StepRecord a = RunStep(f, 1, 1, order, true, 17);
  StepRecord b = RunStep(f, 1, 1, order, true, 18);
  CHECK_FALSE(Identical(a.outputs.at({0, 0}), b.outputs.at({0, 0})));
  CHECK_FALSE(Identical(a.param_grads, b.param_grads));
}

TEST_CASE("StageExecutor finds random ops at Create", "[runtime]") {
  FixtureIr mlp = BuildFixtureIr("mlp");
  FixtureIr drop = BuildFixtureIr("dropout_net");
  REQUIRE(mlp.ir.ok());
  REQUIRE(drop.ir.ok());
  for (int i = 0; i < static_cast<int>(drop.ir->nodes.size()); ++i) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(*drop.ir, i, i + 1);
    REQUIRE(sub.ok());
    const bool has_dropout = drop.ir->nodes[i].label.find("dropout") != std::string::npos;
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(*drop.ir, std::move(*sub), Leaves(drop), {true});
    REQUIRE(stage.ok());
    INFO(drop.ir->nodes[i].label);
    CHECK((*stage)->is_random() == has_dropout);
  }
  absl::StatusOr<Subgraph> whole = BuildSubgraph(*mlp.ir, 0, mlp.ir->nodes.size());
  REQUIRE(whole.ok());
  absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
      StageExecutor::Create(*mlp.ir, std::move(*whole), Leaves(mlp));
  REQUIRE(stage.ok());
  CHECK_FALSE((*stage)->is_random());
}

TEST_CASE("StageExecutor with recompute keeps only its inputs for pending micro-batches",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("mlp");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  REQUIRE(n >= 2);
  std::vector<at::Tensor> leaves = Leaves(f);
  // The first stage's outputs are the second's inputs.
  absl::StatusOr<Subgraph> first = BuildSubgraph(ir, 0, n / 2);
  REQUIRE(first.ok());
  absl::StatusOr<std::unique_ptr<StageExecutor>> producer =
      StageExecutor::Create(ir, std::move(*first), leaves);
  REQUIRE(producer.ok());
  std::vector<at::Tensor> in;
  for (int v : (*producer)->data_inputs()) {
    for (size_t i = 0; i < ir.num_user_inputs; ++i) {
      if (ir.inputs[i] == v) in.push_back(f.user_inputs[i]);
    }
  }
  absl::StatusOr<std::vector<at::Tensor>> acts = (*producer)->Forward(0, in, false);
  REQUIRE(acts.ok());
  std::map<int, at::Tensor> env;
  for (size_t i = 0; i < acts->size(); ++i) env[(*producer)->outputs()[i]] = (*acts)[i];
  for (size_t i = 0; i < ir.num_user_inputs; ++i) env[ir.inputs[i]] = f.user_inputs[i];

  for (bool recompute : {false, true}) {
    INFO("recompute " << recompute);
    absl::StatusOr<Subgraph> second = BuildSubgraph(ir, n / 2, n);
    REQUIRE(second.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(ir, std::move(*second), leaves, {recompute});
    REQUIRE(stage.ok());
    std::vector<at::Tensor> stage_in;
    for (int v : (*stage)->data_inputs()) stage_in.push_back(env.at(v));
    CHECK((*stage)->PendingBytes() == 0);
    int64_t output_bytes = 0;
    for (int mb : {0, 1}) {
      absl::StatusOr<std::vector<at::Tensor>> out = (*stage)->Forward(mb, stage_in, true);
      REQUIRE(out.ok());
      output_bytes += Bytes(*out);
    }
    REQUIRE(output_bytes > 0);
    const int64_t input_bytes = 2 * Bytes(stage_in);
    CHECK((*stage)->PendingBytes() == input_bytes + (recompute ? 0 : output_bytes));
    // A forward without gradients keeps nothing.
    REQUIRE((*stage)->Forward(2, stage_in, false).ok());
    CHECK((*stage)->PendingBytes() == input_bytes + (recompute ? 0 : output_bytes));
    (*stage)->Release(0);
    (*stage)->Release(1);
    CHECK((*stage)->PendingBytes() == 0);
  }
}

TEST_CASE("A random stage with recompute also keeps the generator state it replays",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("dropout_net");
  REQUIRE(f.ir.ok());
  absl::StatusOr<Subgraph> whole = BuildSubgraph(*f.ir, 0, f.ir->nodes.size());
  REQUIRE(whole.ok());
  absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
      StageExecutor::Create(*f.ir, std::move(*whole), Leaves(f), {true});
  REQUIRE(stage.ok());
  REQUIRE((*stage)->is_random());
  REQUIRE((*stage)->Forward(0, f.fixture.inputs, true).ok());
  CHECK((*stage)->PendingBytes() == Bytes(f.fixture.inputs) + CpuRngState().numel());
}

TEST_CASE("StageExecutor with recompute updates BatchNorm statistics once per forward",
          "[runtime]") {
  FixtureIr f = BuildFixtureIr("bn_net");
  REQUIRE(f.ir.ok());
  std::vector<at::Tensor> initial;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    if (f.ir->values[f.ir->inputs[f.ir->num_user_inputs + i]].role == ValueRole::kBuffer) {
      initial.push_back(f.tensors[i].clone());
    }
  }
  REQUIRE_FALSE(initial.empty());
  std::vector<std::vector<at::Tensor>> buffers;
  for (bool recompute : {false, true}) {
    std::vector<at::Tensor> leaves = Leaves(f);
    absl::StatusOr<Subgraph> whole = BuildSubgraph(*f.ir, 0, f.ir->nodes.size());
    REQUIRE(whole.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(*f.ir, std::move(*whole), leaves, {recompute});
    REQUIRE(stage.ok());
    absl::StatusOr<std::vector<at::Tensor>> out = (*stage)->Forward(0, f.fixture.inputs, true);
    REQUIRE(out.ok());
    std::vector<at::Tensor> grads;
    for (const at::Tensor& o : *out) grads.push_back(at::ones_like(o));
    absl::StatusOr<std::vector<at::Tensor>> in_grads = (*stage)->Backward(0, grads);
    INFO("recompute " << recompute << ": " << in_grads.status());
    REQUIRE(in_grads.ok());
    buffers.emplace_back();
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (f.ir->values[f.ir->inputs[f.ir->num_user_inputs + i]].role == ValueRole::kBuffer) {
        buffers.back().push_back(leaves[i]);
      }
    }
  }
  // The forward moved the statistics (so a second update would show), and recompute's replay
  // left them where the forward put them.
  CHECK_FALSE(Identical(initial, buffers[0]));
  CHECK(Identical(buffers[0], buffers[1]));
}

// Two devices' threads run random recomputing stages at once: each replay must give the masks of
// that micro-batch's own forward. The stage is dropout alone, so with an output gradient of ones
// the input gradient is the mask (scaled): forward output == input x input gradient, bitwise.
TEST_CASE("Concurrent random stages with recompute replay their own masks", "[runtime]") {
  FixtureIr f = BuildFixtureIr("dropout_net");
  REQUIRE(f.ir.ok());
  const IrGraph& ir = *f.ir;
  int dropout_node = -1;
  for (int i = 0; i < static_cast<int>(ir.nodes.size()); ++i) {
    if (ir.nodes[i].label == "aten::dropout") dropout_node = i;
  }
  REQUIRE(dropout_node >= 0);
  constexpr int kThreads = 2;
  constexpr int kSteps = 200;
  std::vector<std::unique_ptr<StageExecutor>> stages;
  std::vector<at::Tensor> stage_inputs;
  for (int t = 0; t < kThreads; ++t) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, dropout_node, dropout_node + 1);
    REQUIRE(sub.ok());
    REQUIRE(sub->inputs.size() == 1);
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(ir, std::move(*sub), Leaves(f), {true});
    REQUIRE(stage.ok());
    REQUIRE((*stage)->is_random());
    // Nonzero everywhere, so every dropped element shows in the output; many samples, so that
    // the two threads' forwards and replays overlap often.
    const std::vector<int64_t>& shape = ir.values[(*stage)->data_inputs()[0]].shape;
    REQUIRE(shape.size() == 2);
    stage_inputs.push_back(at::rand({1024, shape[1]}) + 0.5);
    stages.push_back(std::move(*stage));
  }
  std::atomic<int> failures{0}, mismatches{0};
  auto work = [&](int t) {
    // Catch2's assertions are not thread-safe: count here, check on the main thread.
    StageExecutor& stage = *stages[t];
    for (int step = 0; step < kSteps; ++step) {
      std::vector<at::Tensor> outputs;
      for (int mb : {0, 1}) {
        absl::StatusOr<std::vector<at::Tensor>> out = stage.Forward(mb, {stage_inputs[t]}, true);
        if (!out.ok()) {
          ++failures;
          return;
        }
        outputs.push_back((*out)[0]);
      }
      for (int mb : {0, 1}) {
        absl::StatusOr<std::vector<at::Tensor>> in_grads =
            stage.Backward(mb, {at::ones_like(outputs[mb])});
        if (!in_grads.ok()) {
          ++failures;
          return;
        }
        if (!at::equal(outputs[mb], stage_inputs[t] * (*in_grads)[0])) ++mismatches;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (std::thread& thread : threads) thread.join();
  CHECK(failures == 0);
  CHECK(mismatches == 0);
}

}  // namespace
}  // namespace rannc
