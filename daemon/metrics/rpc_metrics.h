// The daemon's gRPC calls, counted by method and status code, with each method's latency: a
// server interceptor records every call of every service as it ends (its status sent), so the
// handlers need nothing. Read by the metrics endpoint (metrics.h) as
// rannc_grpc_server_handled_total{method, code} and rannc_grpc_server_handling_seconds{method}.
// Methods are the services' own (bounded), and so are the codes.
//
//   RpcMetrics rpcs;
//   std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
//   f.push_back(rpcs.InterceptorFactory());
//   builder.experimental().SetInterceptorCreators(std::move(f));
//
// Thread-safe; outlives the server it intercepts.
#ifndef RANNC_DAEMON_METRICS_RPC_METRICS_H_
#define RANNC_DAEMON_METRICS_RPC_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/support/server_interceptor.h>

namespace rannc {
namespace metrics {

class RpcMetrics {
 public:
  // Upper bounds (seconds) of the latency histogram's buckets; +Inf follows the last.
  static const std::vector<double>& LatencyBuckets();

  // A call of `method` ("rannc.v1.TrainingService/Forward") ended with `code` ("OK",
  // "NOT_FOUND", ...) after `seconds`.
  void Record(const std::string& method, const std::string& code, double seconds);

  struct Latency {
    std::vector<uint64_t> buckets;  // cumulative, per LatencyBuckets() bound
    uint64_t count = 0;
    double sum_s = 0;
  };
  struct Snapshot {
    std::map<std::pair<std::string, std::string>, uint64_t> handled;  // (method, code)
    std::map<std::string, Latency> latency;                           // by method
  };
  Snapshot Read() const;

  // Creates an interceptor per call that Records it (the factory refers to this object).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

 private:
  mutable std::mutex mu_;
  Snapshot s_;
};

// gRPC's name of a status code ("OK", "DEADLINE_EXCEEDED", ...): absl's, which are the same.
std::string CodeName(int code);

}  // namespace metrics
}  // namespace rannc

#endif  // RANNC_DAEMON_METRICS_RPC_METRICS_H_
