// A comm::Store across daemons: one daemon serves its in-memory store over gRPC
// (StoreServiceImpl, registered on its gRPC server), and ranks on any daemon reach it through
// MakeGrpcStore. This is how a group that spans daemons meets: UCX worker addresses and NCCL
// unique ids go through the control plane, never through the data plane they set up.
//
//   comm::StoreServiceImpl service(comm::MakeInMemoryStore());   // on the serving daemon
//   builder.RegisterService(&service);
//   std::unique_ptr<comm::Store> store = comm::MakeGrpcStore("10.0.0.1:7411");  // anywhere
//   MakeCommunicator(Backend::kUcx, {store.get(), "job1/world", rank, size});
//
// Errors: a call waits up to its RPC timeout for the server to come up (ranks start in any
// order), then returns UNAVAILABLE naming the address; a Get or Wait that times out returns
// DEADLINE_EXCEEDED naming the key. Thread-safe.
#ifndef RANNC_DAEMON_COMM_GRPC_STORE_H_
#define RANNC_DAEMON_COMM_GRPC_STORE_H_

#include <chrono>
#include <memory>
#include <string>

#include "daemon/comm/store.h"
#include "daemon/security/auth.h"
#include "rannc/v1/store.grpc.pb.h"

namespace rannc {
namespace comm {

// Serves `store` (owned). A Get waits for its key on the server at most one second per call.
class StoreServiceImpl final : public v1::StoreService::Service {
 public:
  explicit StoreServiceImpl(std::unique_ptr<Store> store);
  // The served store, for this process's own ranks.
  Store* store() const { return store_.get(); }
  // Tokens (security/auth.h; not owned): callers must be daemons of the cluster (a certificate,
  // or the admin token). Unset: every call is allowed.
  void set_authorizer(const security::Authorizer* auth) { auth_ = auth; }

  grpc::Status Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                   v1::StoreSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                   v1::StoreGetResponse* response) override;
  grpc::Status Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                   v1::StoreAddResponse* response) override;

 private:
  std::unique_ptr<Store> store_;
  const security::Authorizer* auth_ = nullptr;
};

// A client of the StoreService at `address` ("host:port"). Each call has `rpc_timeout` to
// reach the server (Get and Wait wait longer, up to their own timeouts, by asking again).
std::unique_ptr<Store> MakeGrpcStore(const std::string& address,
                                     std::chrono::milliseconds rpc_timeout =
                                         std::chrono::seconds(5));

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_GRPC_STORE_H_
