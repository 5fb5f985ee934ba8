// Test helpers: a deployment with given stages' devices over an IR's atomic nodes, split evenly;
// which lifted inputs are parameters.
#ifndef RANNC_DAEMON_RUNTIME_PLAN_TESTING_H_
#define RANNC_DAEMON_RUNTIME_PLAN_TESTING_H_

#include <vector>

#include "daemon/graph/ir.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc::testing {

// `devices[s]`: stage s's devices (one per replica), over `num_devices`; nodes split evenly.
inline v1::Deployment MakePlan(const IrGraph& ir, const std::vector<std::vector<int>>& devices,
                               int micro_batches, v1::PipelineSchedule schedule,
                               int num_devices = 4) {
  v1::Deployment plan;
  plan.set_format_version(1);
  plan.set_model_hash(ir.hash);
  const int n = static_cast<int>(ir.nodes.size());
  const int S = static_cast<int>(devices.size());
  plan.set_num_nodes(n);
  plan.set_micro_batches(micro_batches);
  plan.set_schedule(schedule);
  plan.set_num_devices(num_devices);
  plan.set_device_type("cpu");
  for (int s = 0; s < S; ++s) {
    v1::DeploymentStage* st = plan.add_stages();
    st->set_index(s);
    st->set_first_node(s * n / S);
    st->set_end_node((s + 1) * n / S);
    for (int d : devices[s]) st->add_devices(d);
  }
  return plan;
}

// Whether lifted input `lifted_index` of `ir` is a parameter (not a buffer or constant).
inline bool IsParam(const IrGraph& ir, size_t lifted_index) {
  return ir.values[ir.inputs[ir.num_user_inputs + lifted_index]].role == ValueRole::kParam;
}

// The lifted indices of `ir`'s parameters, ascending.
inline std::vector<int> ParamIndices(const IrGraph& ir) {
  std::vector<int> params;
  for (size_t i = 0; i < ir.tensor_names.size(); ++i) {
    if (IsParam(ir, i)) params.push_back(static_cast<int>(i));
  }
  return params;
}

}  // namespace rannc::testing

#endif  // RANNC_DAEMON_RUNTIME_PLAN_TESTING_H_
