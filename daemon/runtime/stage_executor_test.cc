#include "daemon/runtime/stage_executor.h"

#include <map>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

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
at::Tensor PipelineStep(const FixtureIr& f, int num_stages, int m,
                        const std::vector<at::Tensor>& leaves) {
  const IrGraph& ir = *f.ir;
  const int n = static_cast<int>(ir.nodes.size());
  std::vector<std::unique_ptr<StageExecutor>> stages;
  for (int s = 0; s < num_stages; ++s) {
    absl::StatusOr<Subgraph> sub = BuildSubgraph(ir, s * n / num_stages, (s + 1) * n / num_stages);
    REQUIRE(sub.ok());
    absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
        StageExecutor::Create(ir, std::move(*sub), leaves);
    REQUIRE(stage.ok());
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
      env[ir.inputs[i]] = f.fixture.inputs[i].narrow(0, offsets[mb], sizes[mb]);
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

}  // namespace
}  // namespace rannc
