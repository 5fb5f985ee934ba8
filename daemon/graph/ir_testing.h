// Test helper: a fixture model (tests/fixtures) imported and built into an IrGraph, with the
// lifted tensors it runs on and its example inputs.
#ifndef RANNC_DAEMON_GRAPH_IR_TESTING_H_
#define RANNC_DAEMON_GRAPH_IR_TESTING_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "tests/fixtures/fixture.h"

namespace rannc::testing {

struct FixtureIr {
  Fixture fixture;
  ImportedModel model;
  std::vector<at::Tensor> tensors;  // per lifted input, the module's tensor
  absl::StatusOr<IrGraph> ir = absl::UnknownError("not built");
  // The fixture's inputs followed by the step inputs computed from them (IrGraph's user
  // inputs for the whole batch): what a StageExecutor reads. Empty when the IR failed.
  std::vector<at::Tensor> user_inputs;
};

FixtureIr BuildFixtureIr(const std::string& name, const IrOptions& options = {});

// The same at amp_level=O2: the forward rewritten to read every parameter through one cast to
// bf16 (graph/low_precision.h CastForwardTo), as a job's is (server/job_model.h).
FixtureIr BuildO2FixtureIr(const std::string& name);

}  // namespace rannc::testing

#endif  // RANNC_DAEMON_GRAPH_IR_TESTING_H_
