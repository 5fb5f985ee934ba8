// Test helper for pipeline_engine_cross_process_test: one process's part of a job whose plan
// spans several processes, as each daemon of a cluster will run its devices' part.
//
//   engine_part STORE_ADDRESS FIXTURE PLAN MICRO_BATCHES LOCAL_DEVICES OUT_FILE
//
// PLAN lists the stages' devices, stages separated by '/' and replicas by ',' ("0,1/2,3");
// LOCAL_DEVICES the devices this process runs ("2,3"). The process trains the fixture model
// for two SGD steps (lr 0.1, momentum 0.9, the gradient of outputs[0].sum() each time), checks
// the gradients of the first step and the parameters after the second against the fixture's
// PyTorch references for every parameter its devices hold (rtol 1e-5 / atol 1e-6), and writes
// its share of the first step's first output (a loss: its weighted partial sum) to OUT_FILE.
// Exit status: 0 when everything matches, 1 on a mismatch, 2 on an error (stderr says which).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "daemon/comm/grpc_store.h"
#include "daemon/graph/ir_testing.h"
#include "daemon/runtime/pipeline_engine.h"
#include "daemon/runtime/plan_testing.h"

namespace rannc {
namespace {

std::vector<int> Ints(absl::string_view list) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v)) std::exit(2);
    out.push_back(v);
  }
  return out;
}

int Main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s STORE FIXTURE PLAN MICRO_BATCHES LOCAL_DEVICES OUT_FILE\n",
                 argv[0]);
    return 2;
  }
  std::vector<std::vector<int>> stages;
  for (absl::string_view s : absl::StrSplit(argv[3], '/')) stages.push_back(Ints(s));
  testing::FixtureIr f = testing::BuildFixtureIr(argv[2]);
  if (!f.ir.ok()) {
    std::fprintf(stderr, "%s\n", std::string(f.ir.status().message()).c_str());
    return 2;
  }
  const IrGraph& ir = *f.ir;
  std::unique_ptr<comm::Store> store = comm::MakeGrpcStore(argv[1]);
  EngineOptions options;
  options.num_devices = 4;
  options.local_devices = Ints(argv[5]);
  options.store = store.get();
  options.group = std::string("xproc/") + argv[2] + "/" + argv[3];
  options.timeout = std::chrono::seconds(60);
  absl::StatusOr<std::unique_ptr<PipelineEngine>> engine = PipelineEngine::Create(
      ir, testing::MakePlan(ir, stages, std::atoi(argv[4]), v1::SCHEDULE_1F1B), f.tensors,
      options);
  if (!engine.ok()) {
    std::fprintf(stderr, "create: %s\n", std::string(engine.status().message()).c_str());
    return 2;
  }
  std::vector<int> params;
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    if (ir.values[ir.inputs[ir.num_user_inputs + i]].role == ValueRole::kParam) {
      params.push_back(static_cast<int>(i));
    }
  }
  if (absl::Status s = (*engine)->SetOptimizer(OptimizerKind::kSgd, {params}); !s.ok()) return 2;
  HyperParams sgd;
  sgd.lr = 0.1;
  sgd.momentum = 0.9;
  int mismatches = 0;
  for (int step = 0; step < 2; ++step) {
    (*engine)->ZeroGrad();
    absl::StatusOr<std::vector<at::Tensor>> out = (*engine)->Forward(f.fixture.inputs, true);
    absl::Status back = out.ok() ? (*engine)->Backward({{0, at::ones_like((*out)[0])}}, false)
                                 : out.status();
    if (!back.ok()) {
      std::fprintf(stderr, "step %d: %s\n", step, std::string(back.message()).c_str());
      return 2;
    }
    for (int li : params) {
      const at::Tensor grad = (*engine)->GradAt(li);
      if (step != 0 || !grad.defined()) continue;  // held by another process
      if (!at::allclose(grad, f.fixture.Ref("grad", ir.tensor_names[li]), 1e-5, 1e-6)) {
        std::fprintf(stderr, "gradient of %s differs\n", ir.tensor_names[li].c_str());
        ++mismatches;
      }
    }
    if (step == 0) {
      std::ofstream(argv[6]) << (*out)[0].item<double>() << "\n";
    }
    if (absl::Status s = (*engine)->Step({sgd}); !s.ok()) return 2;
  }
  for (int li : params) {
    const at::Tensor value = (*engine)->ParamAt(li);
    if (value.defined() != (*engine)->Holds(li)) {
      std::fprintf(stderr, "Holds(%s) disagrees with ParamAt\n", ir.tensor_names[li].c_str());
      ++mismatches;
    }
    if (!value.defined()) continue;
    if (!at::allclose(value, f.fixture.Ref("step2", ir.tensor_names[li]), 1e-5, 1e-6)) {
      std::fprintf(stderr, "%s after two steps differs\n", ir.tensor_names[li].c_str());
      ++mismatches;
    }
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace
}  // namespace rannc

int main(int argc, char** argv) { return rannc::Main(argc, argv); }
