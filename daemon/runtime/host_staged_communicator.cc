#include "daemon/runtime/host_staged_communicator.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

at::ScalarType ScalarTypeOf(comm::DataType type) {
  switch (type) {
    case comm::DataType::kFloat32: return at::kFloat;
    case comm::DataType::kFloat64: return at::kDouble;
    case comm::DataType::kFloat16: return at::kHalf;
    case comm::DataType::kBFloat16: return at::kBFloat16;
    case comm::DataType::kInt64: return at::kLong;
    case comm::DataType::kInt32: return at::kInt;
    case comm::DataType::kInt8: return at::kChar;
    case comm::DataType::kUInt8: return at::kByte;
  }
  return at::kByte;
}

// The device memory a Buffer names, as a tensor that does not own it.
at::Tensor DeviceView(const comm::Buffer& b) {
  return at::from_blob(b.data, {static_cast<int64_t>(b.count)},
                       at::TensorOptions()
                           .dtype(ScalarTypeOf(b.dtype))
                           .device(c10::Device(c10::kCUDA, b.device_index)));
}

// A failed Work for a copy that could not be made.
class FailedWork : public comm::Work {
 public:
  explicit FailedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait(std::chrono::milliseconds) override { return status_; }
  bool IsCompleted() override { return true; }

 private:
  absl::Status status_;
};

// The inner Work, the host copies it reads or writes, and where the written ones go back.
class StagedWork : public comm::Work {
 public:
  StagedWork(std::unique_ptr<comm::Work> inner, std::vector<at::Tensor> keep,
             std::vector<std::pair<at::Tensor, at::Tensor>> back)
      : inner_(std::move(inner)), keep_(std::move(keep)), back_(std::move(back)) {}

  absl::Status Wait(std::chrono::milliseconds timeout) override {
    absl::Status s = inner_->Wait(timeout);
    if (!s.ok()) return s;
    return CopyBack();
  }
  bool IsCompleted() override { return inner_->IsCompleted() && CopyBack().ok(); }

 private:
  absl::Status CopyBack() {
    if (copied_) return copy_status_;
    copied_ = true;
    try {
      for (auto& [device, host] : back_) device.copy_(host);
    } catch (const std::exception& e) {
      copy_status_ = absl::InternalError(
          absl::StrCat("copying a staged result back to the device: ", e.what()));
    }
    back_.clear();
    keep_.clear();
    return copy_status_;
  }

  std::unique_ptr<comm::Work> inner_;
  std::vector<at::Tensor> keep_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (device view, host copy)
  bool copied_ = false;
  absl::Status copy_status_;
};

class HostStagedCommunicator : public comm::Communicator {
 public:
  explicit HostStagedCommunicator(std::unique_ptr<comm::Communicator> inner)
      : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }

  std::unique_ptr<comm::Work> Send(const comm::Buffer& buffer, int dst,
                                   const comm::SendOptions& options) override {
    return Staged({{buffer, kRead}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->Send(b[0], dst, options);
    });
  }
  std::unique_ptr<comm::Work> Recv(const comm::Buffer& buffer, int src,
                                   const comm::RecvOptions& options) override {
    return Staged({{buffer, kWrite}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->Recv(b[0], src, options);
    });
  }
  std::unique_ptr<comm::Work> AllReduce(const comm::Buffer& buffer,
                                        const comm::AllReduceOptions& options) override {
    return Staged({{buffer, kReadWrite}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->AllReduce(b[0], options);
    });
  }
  std::unique_ptr<comm::Work> ReduceScatter(const comm::Buffer& input, const comm::Buffer& output,
                                            const comm::ReduceScatterOptions& options) override {
    return Staged({{input, kRead}, {output, kWrite}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->ReduceScatter(b[0], b[1], options);
    });
  }
  std::unique_ptr<comm::Work> AllGather(const comm::Buffer& input, const comm::Buffer& output,
                                        const comm::AllGatherOptions& options) override {
    return Staged({{input, kRead}, {output, kWrite}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->AllGather(b[0], b[1], options);
    });
  }
  std::unique_ptr<comm::Work> Broadcast(const comm::Buffer& buffer,
                                        const comm::BroadcastOptions& options) override {
    return Staged({{buffer, kReadWrite}}, [&](const std::vector<comm::Buffer>& b) {
      return inner_->Broadcast(b[0], options);
    });
  }
  std::unique_ptr<comm::Work> Barrier(const comm::BarrierOptions& options) override {
    return inner_->Barrier(options);
  }

 private:
  enum Role { kRead, kWrite, kReadWrite };

  // Issues `op` with a host stand-in for each CUDA buffer: a copy of it where the operation
  // reads it, a copy made back into it when the Work completes where the operation writes it.
  template <typename Op>
  std::unique_ptr<comm::Work> Staged(const std::vector<std::pair<comm::Buffer, Role>>& buffers,
                                     const Op& op) {
    std::vector<comm::Buffer> host;
    std::vector<at::Tensor> keep;
    std::vector<std::pair<at::Tensor, at::Tensor>> back;
    try {
      for (const auto& [b, role] : buffers) {
        if (b.device != comm::DeviceKind::kCuda) {
          host.push_back(b);
          continue;
        }
        const at::Tensor device = DeviceView(b);
        at::Tensor copy = role == kWrite ? at::empty_like(device, at::Device(at::kCPU))
                                         : device.to(at::kCPU);
        host.push_back({copy.data_ptr(), b.count, b.dtype, comm::DeviceKind::kCpu, 0});
        keep.push_back(copy);
        if (role != kRead) back.emplace_back(device, copy);
      }
    } catch (const std::exception& e) {
      return std::make_unique<FailedWork>(absl::InternalError(
          absl::StrCat("staging a CUDA buffer through host memory: ", e.what())));
    }
    return std::make_unique<StagedWork>(op(host), std::move(keep), std::move(back));
  }

  std::unique_ptr<comm::Communicator> inner_;
};

}  // namespace

std::unique_ptr<comm::Communicator> StageThroughHost(std::unique_ptr<comm::Communicator> inner) {
  return std::make_unique<HostStagedCommunicator>(std::move(inner));
}

}  // namespace rannc
