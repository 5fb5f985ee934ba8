// Conversions at the daemon's two error boundaries.
//
// Inside the daemon errors are absl::Status values. LibTorch reports errors by throwing
// c10::Error; `TorchCall` runs a callable and turns any exception into a Status, so nothing
// thrown by LibTorch crosses into the job or server code. `ToGrpcStatus` converts once, at
// the RPC boundary. Both are free functions, safe from any thread.
#ifndef RANNC_DAEMON_COMMON_STATUS_H_
#define RANNC_DAEMON_COMMON_STATUS_H_

#include <exception>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class Status;
}

namespace rannc {

// The first line of a LibTorch error message: the rest is a C++ backtrace users cannot act on.
std::string FirstLine(absl::string_view message);

// What a user needs from a LibTorch error: its first line, or for an error raised inside a
// TorchScript model, the Python-level cause and where it was raised ("RuntimeError: index out of
// range in self (at functional.py(2210): embedding in sparse.py(160): forward)").
std::string UserMessage(absl::string_view message);

// Runs `fn` and converts exceptions (c10::Error, std::bad_alloc, std::exception) into a
// Status with `code`, prefixed by `context`. `fn` returns absl::Status.
template <typename Fn>
absl::Status TorchCall(absl::StatusCode code, absl::string_view context, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(std::string(context) + ": out of memory");
  } catch (const std::exception& e) {
    return absl::Status(code, std::string(context) + ": " + UserMessage(e.what()));
  }
}

// Prefixes a non-OK status's message with `context`, keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_STATUS_H_
