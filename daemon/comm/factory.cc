#include "daemon/comm/factory.h"

#include "absl/strings/str_cat.h"
#include "daemon/comm/fake/fake_communicator.h"
#include "daemon/comm/ucx/ucx_communicator.h"
#ifdef RANNC_WITH_NCCL
#include "daemon/comm/nccl/nccl_communicator.h"
#endif

namespace rannc {
namespace comm {
namespace {

absl::Status Validate(const GroupOptions& options) {
  if (options.store == nullptr) {
    return absl::InvalidArgumentError(
        "MakeCommunicator: GroupOptions.store is null; pass the rendezvous store every rank "
        "of the group shares (e.g. MakeInMemoryStore() within one daemon)");
  }
  if (options.group.empty()) {
    return absl::InvalidArgumentError(
        "MakeCommunicator: GroupOptions.group is empty; name the group (e.g. "
        "\"job1/stage0/replicas\"), it prefixes the group's store keys");
  }
  if (options.size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MakeCommunicator: group ", options.group, " has size ", options.size,
        "; a group has at least one rank"));
  }
  if (options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MakeCommunicator: rank ", options.rank, " is outside group ", options.group,
        " of size ", options.size, " (need 0 <= rank < size)"));
  }
  return absl::OkStatus();
}

}  // namespace

bool BackendBuiltIn(Backend backend) {
#ifdef RANNC_WITH_NCCL
  return true;
#else
  return backend != Backend::kNccl;
#endif
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCommunicator(Backend backend,
                                                               const GroupOptions& options) {
  absl::Status valid = Validate(options);
  if (!valid.ok()) return valid;
  switch (backend) {
    case Backend::kFake:
      return MakeFakeCommunicator(options);
    case Backend::kUcx:
      return MakeUcxCommunicator(options);
    case Backend::kNccl:
#ifdef RANNC_WITH_NCCL
      return MakeNcclCommunicator(options);
#else
      return absl::UnimplementedError(
          "MakeCommunicator: the NCCL backend needs a CUDA build (bazel --define=rannc_nccl=1); "
          "this build has none");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("MakeCommunicator: unknown backend ", static_cast<int>(backend)));
}

}  // namespace comm
}  // namespace rannc
