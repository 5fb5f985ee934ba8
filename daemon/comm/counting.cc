#include "daemon/comm/counting.h"

#include <utility>

namespace rannc {
namespace comm {
namespace {

class CountingCommunicator : public Communicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner,
                       std::shared_ptr<std::atomic<uint64_t>> bytes)
      : inner_(std::move(inner)), bytes_(std::move(bytes)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }

  std::unique_ptr<Work> Send(const Buffer& buffer, int dst, const SendOptions& options) override {
    Count(buffer);
    return inner_->Send(buffer, dst, options);
  }
  std::unique_ptr<Work> Recv(const Buffer& buffer, int src, const RecvOptions& options) override {
    return inner_->Recv(buffer, src, options);
  }
  std::unique_ptr<Work> AllReduce(const Buffer& buffer,
                                  const AllReduceOptions& options) override {
    Count(buffer);
    return inner_->AllReduce(buffer, options);
  }
  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      const ReduceScatterOptions& options) override {
    Count(input);
    return inner_->ReduceScatter(input, output, options);
  }
  std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                  const AllGatherOptions& options) override {
    Count(input);
    return inner_->AllGather(input, output, options);
  }
  std::unique_ptr<Work> Broadcast(const Buffer& buffer,
                                  const BroadcastOptions& options) override {
    Count(buffer);
    return inner_->Broadcast(buffer, options);
  }
  std::unique_ptr<Work> Barrier(const BarrierOptions& options) override {
    return inner_->Barrier(options);
  }

 private:
  void Count(const Buffer& buffer) {
    bytes_->fetch_add(buffer.bytes(), std::memory_order_relaxed);
  }

  const std::unique_ptr<Communicator> inner_;
  const std::shared_ptr<std::atomic<uint64_t>> bytes_;
};

}  // namespace

std::unique_ptr<Communicator> CountBytes(std::unique_ptr<Communicator> inner,
                                         std::shared_ptr<std::atomic<uint64_t>> bytes) {
  if (!bytes || !inner) return inner;
  return std::make_unique<CountingCommunicator>(std::move(inner), std::move(bytes));
}

}  // namespace comm
}  // namespace rannc
