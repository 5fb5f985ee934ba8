#include "daemon/health.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace {

// The plaintext port answers its health service and nothing else: every other method is
// UNIMPLEMENTED. (A server needs a service of its own besides the health one to start.)
class Unimplemented : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Answer : public grpc::ServerGenericBidiReactor {
     public:
      Answer() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this port serves grpc.health.v1.Health only (--health-listen)"));
      }
      void OnDone() override { delete this; }
    };
    return new Answer();
  }
};

void Set(grpc::Server* server, bool serving, bool ready) {
  if (server == nullptr || server->GetHealthCheckService() == nullptr) return;
  server->GetHealthCheckService()->SetServingStatus("", serving);
  server->GetHealthCheckService()->SetServingStatus(kReadyService, serving && ready);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Health>> Health::Start(grpc::Server* main,
                                                      const std::string& listen) {
  std::unique_ptr<Health> h(new Health());
  h->main_ = main;
  if (!listen.empty()) {
    grpc::ServerBuilder builder;
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    int port = 0;
    builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
    h->unknown_ = std::make_unique<Unimplemented>();
    builder.RegisterCallbackGenericService(h->unknown_.get());
    h->plain_ = builder.BuildAndStart();
    if (h->plain_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat(
          "--health-listen ", listen, ": cannot listen there (address in use, or not an "
          "address of this host); pick another"));
    }
    h->address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  }
  Set(h->main_, true, false);
  Set(h->plain_.get(), true, false);
  return h;
}

Health::~Health() { Shutdown(); }

void Health::SetReady(bool ready) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_ || ready == ready_) return;
  ready_ = ready;
  Set(main_, true, ready);
  Set(plain_.get(), true, ready);
}

bool Health::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

void Health::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    ready_ = false;
    Set(main_, false, false);
    Set(plain_.get(), false, false);
  }
  if (plain_) plain_->Shutdown(std::chrono::system_clock::now());
}

}  // namespace rannc
