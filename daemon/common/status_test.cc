#include "daemon/common/status.h"

#include <stdexcept>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("UserMessage drops LibTorch's C++ backtrace", "[status]") {
  CHECK(UserMessage("shape mismatch\nException raised from foo at bar.cpp:12\nframe #0") ==
        "shape mismatch");
}

TEST_CASE("UserMessage finds the cause of an error inside a TorchScript model", "[status]") {
  const char* message =
      "The following operation failed in the TorchScript interpreter.\n"
      "Traceback of TorchScript, serialized code (most recent call last):\n"
      "  File \"code/__torch__/torch/nn/modules/sparse.py\", line 10, in forward\n"
      "    return torch.embedding(weight, input)\n"
      "           ~~~~~~~~~~~~~~~ <--- HERE\n"
      "\n"
      "Traceback of TorchScript, original code (most recent call last):\n"
      "/usr/lib/python3/dist-packages/torch/nn/functional.py(2210): embedding\n"
      "/usr/lib/python3/dist-packages/torch/nn/modules/sparse.py(160): forward\n"
      "/usr/lib/python3/dist-packages/torch/jit/_trace.py(759): trace\n"
      "RuntimeError: index out of range in self\n";
  CHECK(UserMessage(message) ==
        "RuntimeError: index out of range in self (at functional.py(2210): embedding in "
        "sparse.py(160): forward)");
}

TEST_CASE("TorchCall turns exceptions into statuses with context", "[status]") {
  absl::Status s = TorchCall(absl::StatusCode::kInvalidArgument, "running", [] {
    throw std::runtime_error("boom\nException raised from x");
    return absl::OkStatus();
  });
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message() == "running: boom");
  CHECK(TorchCall(absl::StatusCode::kInternal, "x", [] { return absl::OkStatus(); }).ok());
}

}  // namespace
}  // namespace rannc
