// ranncd's health, as Kubernetes' gRPC probes ask for it (deploy/k8s): the standard
// grpc.health.v1.Health service, with two names:
//   ""             SERVING while the daemon runs (liveness)
//   "rannc.ready"  SERVING once the daemon has joined its cluster: its members are known and it
//                  has its rank (readiness); NOT_SERVING before, and while it stops
// on the main server (TLS when it has TLS) and, with --health-listen HOST:PORT, on a plaintext
// port of its own that serves nothing else: kubelet's gRPC probes do not speak TLS.
//
//   absl::StatusOr<std::unique_ptr<Health>> h = Health::Start(main_server, "0.0.0.0:7412");
//   (*h)->SetReady(true);
//
// Thread-safe.
#ifndef RANNC_DAEMON_HEALTH_H_
#define RANNC_DAEMON_HEALTH_H_

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
class CallbackGenericService;
}  // namespace grpc

namespace rannc {

inline constexpr char kReadyService[] = "rannc.ready";

class Health {
 public:
  // `main`: the daemon's server, built with the default health service (not owned; outlives
  // this). `listen`: the plaintext port's address ("" for none; port 0 picks one).
  // UNAVAILABLE when `listen` cannot be bound. Starts not ready.
  static absl::StatusOr<std::unique_ptr<Health>> Start(grpc::Server* main,
                                                       const std::string& listen);
  ~Health();

  void SetReady(bool ready);
  bool ready() const;
  // The plaintext port's bound address ("" without one).
  const std::string& address() const { return address_; }
  // Every name NOT_SERVING, then the plaintext server stops.
  void Shutdown();

 private:
  Health() = default;
  grpc::Server* main_ = nullptr;
  std::unique_ptr<grpc::CallbackGenericService> unknown_;  // the plaintext port's other calls
  std::unique_ptr<grpc::Server> plain_;
  std::string address_;
  mutable std::mutex mu_;
  bool ready_ = false;
  bool shut_down_ = false;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_HEALTH_H_
