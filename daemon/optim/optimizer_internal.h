// Checks and error conversion shared by the optimizer implementations (sgd.cc, adam.cc) and
// the factory (optimizer.cc). Private to //daemon/optim:optimizer. Free functions, safe from any
// thread.
#ifndef RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_
#define RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_

#include <exception>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/optim/optimizer.h"

namespace rannc {
namespace optim_internal {

// Everything Step() can reject before touching a tensor, so that a rejected step changes
// nothing: the hypers count, each group's hyper-parameters, and each defined grad's shape,
// dtype, device and layout against its param.
absl::Status CheckStepArgs(OptimizerKind kind, const std::vector<ParamGroup>& groups,
                           const std::vector<HyperParams>& hypers);

// The first line of an exception's message: LibTorch appends a C++ backtrace nobody can act on.
std::string FirstLine(const char* message);

// Runs `fn` (returning absl::Status) and turns anything LibTorch throws into a Status, so that
// no c10::Error leaves the optimizer.
template <typename Fn>
absl::Status CatchTorch(const char* context, Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(std::string(context) + ": out of memory");
  } catch (const std::exception& e) {
    return absl::InternalError(std::string(context) + ": " + FirstLine(e.what()));
  }
}

}  // namespace optim_internal
}  // namespace rannc

#endif  // RANNC_DAEMON_OPTIM_OPTIMIZER_INTERNAL_H_
