// host_reads' one list against every pass that asks it: each host read is one for IsHostRead,
// makes ShapesFollowFromShapes false (contents became a number), and keeps the batch whole in
// the batch analysis when it reads batch values. A pass that stopped asking (a list of its own
// again) fails here as soon as the lists differ.
#include "daemon/graph/host_reads.h"

#include <memory>

// LibTorch 2.x defines a CHECK macro of its own; Catch2's must come last to win.
#include <torch/csrc/jit/ir/ir.h>
#include <catch2/catch.hpp>

#include "daemon/graph/batch_flow.h"
#include "daemon/graph/ir.h"

namespace rannc {
namespace {

// A graph of one op of `kind` on a tensor input: (x) -> kind(x).
std::shared_ptr<torch::jit::Graph> OneOp(c10::Symbol kind) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::Value* x = graph->addInput("x")->setType(c10::TensorType::get());
  torch::jit::Node* n = graph->insertNode(graph->create(kind, {x}, 1));
  graph->registerOutput(n->output());
  return graph;
}

// The batch analysis of `graph`, whose one input is the client's batch of 4 samples.
BatchFlow FlowOf(const torch::jit::Graph& graph) {
  ValueFacts batch;
  batch.batch_dim = 0;
  batch.shape = {4, 3};
  BatchFlowInputs in;
  in.graph = &graph;
  in.num_client_inputs = 1;
  in.example_batch = 4;
  in.facts = [&](const torch::jit::Value* v) -> const ValueFacts* {
    return v == graph.inputs()[0] ? &batch : nullptr;
  };
  return AnalyzeBatchFlow(in);
}

TEST_CASE("Every host read is one to each pass that must know host reads", "[graph]") {
  REQUIRE(HostReadKinds().size() >= 10);
  for (c10::Symbol kind : HostReadKinds()) {
    INFO(kind.toQualString());
    std::shared_ptr<torch::jit::Graph> graph = OneOp(kind);
    CHECK(IsHostRead(graph->outputs()[0]->node()));
    CHECK_FALSE(ShapesFollowFromShapes(*graph));
    const BatchFlow flow = FlowOf(*graph);
    CHECK_FALSE(flow.separable);
    CHECK_THAT(flow.why, Catch::Contains("into a host number"));
  }
}

TEST_CASE("Ops that compute on the device are not host reads", "[graph]") {
  for (const char* name : {"aten::relu", "aten::size", "aten::to", "prim::NumToTensor"}) {
    INFO(name);
    std::shared_ptr<torch::jit::Graph> graph = OneOp(c10::Symbol::fromQualString(name));
    CHECK_FALSE(IsHostRead(graph->outputs()[0]->node()));
  }
  CHECK(ShapesFollowFromShapes(*OneOp(c10::Symbol::fromQualString("aten::relu"))));
}

}  // namespace
}  // namespace rannc
