#include "daemon/metrics/rpc_metrics.h"

#include <chrono>

#include "absl/status/status.h"

namespace rannc {
namespace metrics {
namespace {

// One call: its start at creation, its end when its status is sent (a call that ends without
// one, cancelled by its client, counts as CANCELLED when the interceptor goes).
class CallInterceptor : public grpc::experimental::Interceptor {
 public:
  CallInterceptor(RpcMetrics* metrics, const char* method)
      : metrics_(metrics),
        method_(method != nullptr && method[0] == '/' ? method + 1 : (method ? method : "")),
        start_(std::chrono::steady_clock::now()) {}
  ~CallInterceptor() override {
    if (!recorded_) metrics_->Record(method_, "CANCELLED", Seconds());
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_->Record(method_, CodeName(methods->GetSendStatus().error_code()), Seconds());
      recorded_ = true;
    }
    methods->Proceed();
  }

 private:
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  RpcMetrics* const metrics_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  bool recorded_ = false;
};

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(RpcMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallInterceptor(metrics_, info->method());
  }

 private:
  RpcMetrics* const metrics_;
};

}  // namespace

std::string CodeName(int code) {
  const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

const std::vector<double>& RpcMetrics::LatencyBuckets() {
  static const std::vector<double> buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                              0.25,  0.5,    1,     2.5,  5,     10,   60};
  return buckets;
}

void RpcMetrics::Record(const std::string& method, const std::string& code, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++s_.handled[{method, code}];
  Latency& l = s_.latency[method];
  const std::vector<double>& bounds = LatencyBuckets();
  if (l.buckets.empty()) l.buckets.assign(bounds.size(), 0);
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (seconds <= bounds[i]) ++l.buckets[i];
  }
  ++l.count;
  l.sum_s += seconds;
}

RpcMetrics::Snapshot RpcMetrics::Read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
RpcMetrics::InterceptorFactory() {
  return std::make_unique<Factory>(this);
}

}  // namespace metrics
}  // namespace rannc
