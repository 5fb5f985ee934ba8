// Checks shared by the optimizer implementations (sgd.cc, adam.cc, slot_optimizer.cc) and
// the factory (optimizer.cc). Private to //daemon/optim:optimizer. Free functions, safe from any
// thread.
#ifndef RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_
#define RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/optim/optimizer.h"

namespace rannc {
namespace optim_internal {

// MakeOptimizer's checks of `groups`: each group's hyper-parameters, and each param defined, a
// leaf, real unless `kind` is SGD, and in no other place of `groups`.
absl::Status CheckGroups(OptimizerKind kind, const std::vector<ParamGroup>& groups);

// Everything Step() can reject before touching a tensor, so that a rejected step changes
// nothing: the hypers count, each group's hyper-parameters, each defined grad's shape, dtype,
// device and layout against its param, and sparse grads against what `kind` supports.
absl::Status CheckStepArgs(OptimizerKind kind, const std::vector<ParamGroup>& groups,
                           const std::vector<HyperParams>& hypers);

// One entry of a NamedState list, checked against the params (numbered across groups):
// `<index>.<key>` with a known key (`keys`) and, for per-element keys, the param's shape; for
// scalar keys (IsScalarOptimizerState), one value.
struct StateEntryRef {
  size_t group = 0, param = 0;
  std::string key;
};
absl::StatusOr<StateEntryRef> ParseStateEntry(const std::vector<ParamGroup>& groups,
                                              const std::string& name, const at::Tensor& value,
                                              const std::vector<std::string>& keys);

}  // namespace optim_internal
}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_
