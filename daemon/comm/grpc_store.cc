#include "daemon/comm/grpc_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The longest a server thread waits for a key in one Get.
constexpr milliseconds kServerWaitCap{1000};

class GrpcStore final : public Store {
 public:
  GrpcStore(std::string address, milliseconds rpc_timeout)
      : address_(std::move(address)),
        rpc_timeout_(rpc_timeout),
        stub_(v1::StoreService::NewStub(
            security::PeerChannel(address_))) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::StoreSetRequest request;
    request.set_key(key);
    request.set_value(value);
    v1::StoreSetResponse response;
    grpc::ClientContext context;
    Deadline(&context, rpc_timeout_);
    return Check(stub_->Set(&context, request, &response), "Set", key);
  }

  absl::StatusOr<std::string> Get(const std::string& key, milliseconds timeout) override {
    const Clock::time_point deadline = Until(timeout);
    for (;;) {
      const milliseconds left = Left(deadline);
      v1::StoreGetRequest request;
      request.set_key(key);
      request.set_wait_ms(static_cast<uint32_t>(std::min(left, kServerWaitCap).count()));
      v1::StoreGetResponse response;
      grpc::ClientContext context;
      Deadline(&context, rpc_timeout_ + std::min(left, kServerWaitCap));
      absl::Status s = Check(stub_->Get(&context, request, &response), "Get", key);
      if (!s.ok()) return s;
      if (response.found()) return std::string(response.value());
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "store at ", address_, ": key '", key, "' was not set within ", timeout.count(),
            " ms"));
      }
    }
  }

  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    v1::StoreAddRequest request;
    request.set_key(key);
    request.set_delta(delta);
    v1::StoreAddResponse response;
    grpc::ClientContext context;
    Deadline(&context, rpc_timeout_);
    absl::Status s = Check(stub_->Add(&context, request, &response), "Add", key);
    if (!s.ok()) return s;
    return response.value();
  }

  absl::Status Wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    const Clock::time_point deadline = Until(timeout);
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> got = Get(key, Left(deadline));
      if (!got.ok()) {
        if (got.status().code() != absl::StatusCode::kDeadlineExceeded) return got.status();
        return absl::DeadlineExceededError(absl::StrCat(
            "store at ", address_, ": key '", key, "' was not set within ", timeout.count(),
            " ms"));
      }
    }
    return absl::OkStatus();
  }

 private:
  static Clock::time_point Until(milliseconds timeout) {
    // kNoTimeout (milliseconds::max()) must not overflow the clock.
    const milliseconds capped = std::min(timeout, milliseconds(std::chrono::hours(24 * 365)));
    return Clock::now() + capped;
  }
  static milliseconds Left(Clock::time_point deadline) {
    return std::max(milliseconds(0),
                    std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  }
  static void Deadline(grpc::ClientContext* context, milliseconds budget) {
    context->set_deadline(std::chrono::system_clock::now() + budget);
    // Ranks start in any order: wait (within the deadline) for a store that is not up yet
    // rather than failing at once.
    context->set_wait_for_ready(true);
  }
  absl::Status Check(const grpc::Status& s, const char* what, const std::string& key) const {
    if (s.ok()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("store at ", address_, ": ", what, " '", key,
                                               "' failed: ", s.error_message(), " (gRPC code ",
                                               static_cast<int>(s.error_code()), ")"));
  }

  const std::string address_;
  const milliseconds rpc_timeout_;
  std::unique_ptr<v1::StoreService::Stub> stub_;
};

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INTERNAL, std::string(s.message()));
}

}  // namespace

StoreServiceImpl::StoreServiceImpl(std::unique_ptr<Store> store) : store_(std::move(store)) {}

grpc::Status StoreServiceImpl::Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                                   v1::StoreSetResponse*) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.StoreService/Set");
  if (!denied.ok()) return denied;
  return ToGrpc(store_->Set(request->key(), request->value()));
}

grpc::Status StoreServiceImpl::Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                                   v1::StoreGetResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.StoreService/Get");
  if (!denied.ok()) return denied;
  const milliseconds wait = std::min(milliseconds(request->wait_ms()), kServerWaitCap);
  absl::StatusOr<std::string> value = store_->Get(request->key(), wait);
  if (value.ok()) {
    response->set_found(true);
    response->set_value(*value);
    return grpc::Status::OK;
  }
  if (value.status().code() == absl::StatusCode::kDeadlineExceeded) return grpc::Status::OK;
  return ToGrpc(value.status());
}

grpc::Status StoreServiceImpl::Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                                   v1::StoreAddResponse* response) {
  grpc::Status denied =
      security::CheckCall(auth_, *context, "/rannc.v1.StoreService/Add");
  if (!denied.ok()) return denied;
  absl::StatusOr<int64_t> value = store_->Add(request->key(), request->delta());
  if (!value.ok()) return ToGrpc(value.status());
  response->set_value(*value);
  return grpc::Status::OK;
}

std::unique_ptr<Store> MakeGrpcStore(const std::string& address, milliseconds rpc_timeout) {
  return std::make_unique<GrpcStore>(address, rpc_timeout);
}

}  // namespace comm
}  // namespace rannc
