// Deployments (proto/rannc/v1/deployment.proto) as the daemon reads them: checking that a saved
// one fits a model and a set of devices, and describing one for people.
//
//   absl::Status fits = CheckDeployment(deployment, ir, target, config.mem_margin);
//   std::string text = DescribeDeployment(deployment);
//
// Pure functions; safe from any thread.
#ifndef RANNC_DAEMON_PLANNER_DEPLOYMENT_H_
#define RANNC_DAEMON_PLANNER_DEPLOYMENT_H_

#include <string>

#include "absl/status/status.h"
#include "daemon/graph/ir.h"
#include "daemon/planner/planner.h"
#include "rannc/v1/deployment.pb.h"

namespace rannc {
namespace planner {

inline constexpr uint32_t kDeploymentFormatVersion = 1;

// OK when `deployment` was made for this model and the target's devices can hold every stage:
// the device memory may differ from the one planned for as long as each stage's estimate, with
// its activations scaled to the target's batch size, fits within the memory less the margin.
// INVALID_ARGUMENT for another model, device type or format version, or a malformed plan;
// FAILED_PRECONDITION when it places stages on devices the target does not have;
// RESOURCE_EXHAUSTED when a stage no longer fits.
absl::Status CheckDeployment(const v1::Deployment& deployment, const IrGraph& ir,
                             const PlanTarget& target);

// Several lines: the plan's shape and estimates, then one line per stage.
std::string DescribeDeployment(const v1::Deployment& deployment);

// "1.5 GiB", "512 MiB", "12 KiB", "17 B".
std::string HumanBytes(uint64_t bytes);

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_DEPLOYMENT_H_
