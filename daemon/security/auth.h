// Tokens (issue 24): who may call what. An admin token (ranncd --auth-token-file) may do
// anything; creating a job returns a job token that alone (or the admin's) may drive, read,
// checkpoint or delete that job; daemons of the cluster call each other with their verified
// certificates (mutual TLS, tls.h) or the admin token.
//
//   auto auth = Authorizer::FromFile("/etc/rannc/admin.token").value();
//   std::string token = auth->IssueJobToken(job_id, name);             // CreateJob's answer
//   absl::Status ok = auth->Check(*context, "/rannc.v1.TrainingService/Step", job_id, "");
//
// A token travels as the call's `authorization: Bearer <token>` metadata (TokenChannel adds it to
// every call of a channel). Without a token where one is required: UNAUTHENTICATED; a valid token
// not allowed this call (another job's): PERMISSION_DENIED. Tokens are compared in constant time
// and never logged. Job tokens are "rj1.<job id>.<secret>": the id finds the job's secret, which
// is then compared.
//
// Every RPC of rannc.v1's services has a rule (MethodAccess); auth_test fails when one is
// missing, and a call of a method without one is refused.
//
// Thread-safe.
#ifndef RANNC_DAEMON_SECURITY_AUTH_H_
#define RANNC_DAEMON_SECURITY_AUTH_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class Channel;
class ChannelArguments;
class ChannelCredentials;
class ServerContext;
}  // namespace grpc

namespace rannc {
namespace security {

inline constexpr char kAuthorizationMetadata[] = "authorization";

// Who may call an RPC.
enum class Access {
  kAuthenticated,  // any valid token (admin or a job's), or a daemon's certificate
  kAdmin,          // the admin token, or a daemon's certificate (a call forwarded by a daemon)
  kJob,            // the admin token, or the token of the job the request names by id
  kJobName,        // the admin token, or the token of a job of the name the request names
  kPeer,           // another daemon: its verified certificate, or the admin token
};
const char* AccessName(Access access);

// The rule of every RPC of rannc.v1, by full method name ("/rannc.v1.TrainingService/Step").
const std::map<std::string, Access>& MethodAccess();

// Who called.
struct Caller {
  enum class Kind { kNone, kInvalid, kAdmin, kJob, kPeer } kind = Kind::kNone;
  std::string job_id;    // kJob
  std::string job_name;  // kJob
  std::string peer;      // kPeer: its certificate's common name
};

class Authorizer {
 public:
  // The admin token: the first line of `token_file`, at least 16 characters. "" makes an
  // Authorizer that allows every call (no --auth-token-file). INVALID_ARGUMENT naming the file.
  static absl::StatusOr<std::unique_ptr<Authorizer>> FromFile(const std::string& token_file);

  bool enabled() const { return !admin_.empty(); }
  // For this daemon's own calls to the others of its cluster (SetPeerToken); never logged.
  const std::string& admin_token() const { return admin_; }
  // A new token for the job; replaces any it had.
  std::string IssueJobToken(const std::string& job_id, const std::string& job_name);
  // The job is gone: its token no longer works.
  void ForgetJob(const std::string& job_id);

  Caller Identify(const grpc::ServerContext& context) const;
  // Whether the caller may call `method` on the job `job_id` (or, for kJobName, `job_name`).
  // OK, UNAUTHENTICATED or PERMISSION_DENIED, saying what is missing (never the token).
  absl::Status Check(const grpc::ServerContext& context, const std::string& method,
                     const std::string& job_id = "", const std::string& job_name = "") const;
  // The same for a caller already identified.
  absl::Status Allow(const Caller& caller, const std::string& method, const std::string& job_id,
                     const std::string& job_name) const;
  // The first half of Allow, for a stream whose job its first message names: UNAUTHENTICATED
  // for a caller without a valid token or certificate, OK otherwise.
  absl::Status Authenticated(const Caller& caller, const std::string& method) const;
  // The job's token as IssueJobToken made it; "" when it has none.
  std::string JobToken(const std::string& job_id) const;

 private:
  explicit Authorizer(std::string admin) : admin_(std::move(admin)) {}
  struct Issued {
    std::string secret;
    std::string name;
  };
  const std::string admin_;
  mutable std::mutex mu_;
  std::map<std::string, Issued> jobs_;  // by job id
};

// A handler's checks of its caller, as gRPC statuses: OK, or the status to return, the refusal
// logged (without the token). A null `auth`, or one without tokens, allows everything.
// CheckCall: Authorizer::Check. For a stream whose first message names its job, in two halves:
// CheckAuthenticated (Authorizer::Authenticated) before reading it, CheckCaller
// (Authorizer::Allow) after.
grpc::Status CheckCall(const Authorizer* auth, const grpc::ServerContext& context,
                       const std::string& method, const std::string& job_id = "",
                       const std::string& job_name = "");
grpc::Status CheckAuthenticated(const Authorizer* auth, const Caller& caller,
                                const std::string& method);
grpc::Status CheckCaller(const Authorizer* auth, const Caller& caller, const std::string& method,
                         const std::string& job_id, const std::string& job_name = "");

// A token file's token: the first line of `path`, stripped. INVALID_ARGUMENT naming `flag` and
// the file when it cannot be read.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag);

// Whether two strings are equal, in time that depends on their lengths only.
bool ConstantTimeEqual(const std::string& a, const std::string& b);

// A channel whose every call carries `token` (none when empty) as authorization metadata.
std::shared_ptr<grpc::Channel> TokenChannel(const std::string& target,
                                            const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                            const grpc::ChannelArguments& args,
                                            const std::string& token);

// This daemon's channels to the others: PeerCredentials() (tls.h), and the admin token on every
// call when set (SetPeerToken, once at start).
void SetPeerToken(std::string token);
std::shared_ptr<grpc::Channel> PeerChannel(const std::string& target,
                                           const grpc::ChannelArguments& args);
std::shared_ptr<grpc::Channel> PeerChannel(const std::string& target);

}  // namespace security
}  // namespace rannc

#endif  // RANNC_DAEMON_SECURITY_AUTH_H_
