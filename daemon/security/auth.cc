#include "daemon/security/auth.h"

#include <fstream>
#include <random>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/security/tls.h"

namespace rannc {
namespace security {
namespace {

constexpr char kJobTokenPrefix[] = "rj1.";
constexpr char kBearer[] = "Bearer ";

std::string RandomHex(size_t bytes) {
  std::random_device device;  // getrandom(2) on Linux
  std::string out;
  static constexpr char kHex[] = "0123456789abcdef";
  for (size_t i = 0; i < bytes; ++i) {
    const unsigned value = device() & 0xFF;
    out.push_back(kHex[value >> 4]);
    out.push_back(kHex[value & 0xF]);
  }
  return out;
}

// The bearer token of the call's metadata; "" when there is none.
std::string BearerToken(const grpc::ServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationMetadata);
  if (it == metadata.end()) return "";
  const std::string value(it->second.data(), it->second.size());
  if (!absl::StartsWith(value, kBearer)) return "\x01";  // present, malformed
  return value.substr(sizeof(kBearer) - 1);
}

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* token) : token_(token) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kAuthorizationMetadata,
                                                 absl::StrCat(kBearer, *token_));
    }
    methods->Proceed();
  }

 private:
  const std::string* token_;
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&token_);
  }

 private:
  const std::string token_;
};

// The token of job `job_id` with `secret` (Identify parses it back).
std::string FormatJobToken(const std::string& job_id, const std::string& secret) {
  return absl::StrCat(kJobTokenPrefix, job_id, ".", secret);
}

// `status` for gRPC (absl and gRPC share the canonical codes), a refusal logged.
grpc::Status Refusal(const std::string& method, const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  spdlog::warn("refused {}: {}", method, std::string(status.message()));
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::mutex peer_token_mu;
std::string& PeerTokenSlot() {
  static auto* token = new std::string();
  return *token;
}

}  // namespace

const char* AccessName(Access access) {
  switch (access) {
    case Access::kAuthenticated: return "any valid token";
    case Access::kAdmin: return "the admin token";
    case Access::kJob: return "the job's token or the admin token";
    case Access::kJobName: return "a token of a job of that name, or the admin token";
    case Access::kPeer: return "a daemon of the cluster (its certificate) or the admin token";
  }
  return "?";
}

const std::map<std::string, Access>& MethodAccess() {
  static const auto* rules = [] {
    auto* out = new std::map<std::string, Access>();
    auto add = [&](const char* service, Access access, std::vector<const char*> methods) {
      for (const char* m : methods) (*out)[absl::StrCat("/rannc.v1.", service, "/", m)] = access;
    };
    add("TrainingService", Access::kAuthenticated, {"GetInfo", "ListJobs", "ListDetachedJobs"});
    add("TrainingService", Access::kAdmin,
        {"CreateJob", "ResumeJob", "SubmitJob", "UploadFile"});
    add("TrainingService", Access::kJob,
        {"AddMode", "DeleteJob", "RenewLeases", "Forward", "Backward", "Step", "ZeroGrad",
         "ClipGradNorm", "AllReduceGrads", "Flush", "GetParam", "StateDict", "LoadStateDict",
         "OptimizerState", "LoadOptimizerState", "SetMode", "Undeploy",
         "RecreateCommunicators", "Checkpoint", "ListCheckpoints", "ExportCheckpoint",
         "DetachedJobStatus", "DetachedJobLogs", "CancelJob"});
    add("TrainingService", Access::kJobName, {"JoinJob", "ClientBarrier", "LocateJob"});
    add("JobPartService", Access::kPeer,
        {"CreatePart", "DeletePart", "Forward", "Backward", "Step", "AllReduceGrads",
         "ZeroGrad", "GradNorms", "ScaleGrads", "GetTensor", "LoadState", "OptimizerState",
         "LoadOptimizerState", "Undeploy", "RecreateCommunicators", "AbortStep", "FindJob",
         "StartCheckpointShare", "CheckpointShare", "RestoreLossScaler"});
    add("StoreService", Access::kPeer, {"Set", "Get", "Add"});
    add("ClusterService", Access::kPeer, {"Heartbeat"});
    return out;
  }();
  return *rules;
}

grpc::Status CheckCall(const Authorizer* auth, const grpc::ServerContext& context,
                       const std::string& method, const std::string& job_id,
                       const std::string& job_name) {
  if (auth == nullptr || !auth->enabled()) return grpc::Status::OK;
  return Refusal(method, auth->Check(context, method, job_id, job_name));
}

grpc::Status CheckAuthenticated(const Authorizer* auth, const Caller& caller,
                                const std::string& method) {
  if (auth == nullptr) return grpc::Status::OK;
  return Refusal(method, auth->Authenticated(caller, method));
}

grpc::Status CheckCaller(const Authorizer* auth, const Caller& caller, const std::string& method,
                         const std::string& job_id, const std::string& job_name) {
  if (auth == nullptr) return grpc::Status::OK;
  return Refusal(method, auth->Allow(caller, method, job_id, job_name));
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": cannot be read (a token, on its first line)"));
  }
  return std::string(absl::StripAsciiWhitespace(line));
}

absl::StatusOr<std::unique_ptr<Authorizer>> Authorizer::FromFile(const std::string& token_file) {
  if (token_file.empty()) return std::unique_ptr<Authorizer>(new Authorizer(""));
  absl::StatusOr<std::string> read = ReadTokenFile(token_file, "--auth-token-file");
  if (!read.ok()) return read.status();
  const std::string& token = *read;
  if (token.size() < 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file ", token_file, ": the token's first line has ", token.size(),
        " characters; give at least 16 (e.g. `openssl rand -hex 32`)"));
  }
  if (absl::StartsWith(token, kJobTokenPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-token-file ", token_file, ": an admin token must not start with '",
        kJobTokenPrefix, "' (job tokens do)"));
  }
  return std::unique_ptr<Authorizer>(new Authorizer(token));
}

std::string Authorizer::IssueJobToken(const std::string& job_id, const std::string& job_name) {
  const std::string secret = RandomHex(24);
  std::lock_guard<std::mutex> lock(mu_);
  jobs_[job_id] = Issued{secret, job_name};
  return FormatJobToken(job_id, secret);
}

void Authorizer::ForgetJob(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(job_id);
}

Caller Authorizer::Identify(const grpc::ServerContext& context) const {
  Caller caller;
  const std::string token = BearerToken(context);
  if (!token.empty()) {
    caller.kind = Caller::Kind::kInvalid;
    if (ConstantTimeEqual(token, admin_)) {
      caller.kind = Caller::Kind::kAdmin;
    } else if (absl::StartsWith(token, kJobTokenPrefix)) {
      const std::string rest = token.substr(sizeof(kJobTokenPrefix) - 1);
      const size_t dot = rest.rfind('.');
      if (dot != std::string::npos) {
        const std::string id = rest.substr(0, dot);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = jobs_.find(id);
        if (it != jobs_.end() && ConstantTimeEqual(rest.substr(dot + 1), it->second.secret)) {
          caller.kind = Caller::Kind::kJob;
          caller.job_id = id;
          caller.job_name = it->second.name;
        }
      }
    }
    if (caller.kind != Caller::Kind::kInvalid) return caller;
  }
  // A daemon of the cluster: the certificate the TLS server verified.
  const std::string peer = PeerCertificate(context);
  if (!peer.empty()) {
    caller.kind = Caller::Kind::kPeer;
    caller.peer = peer;
  }
  return caller;
}

absl::Status Authorizer::Authenticated(const Caller& caller, const std::string& method) const {
  if (!enabled()) return absl::OkStatus();
  if (caller.kind == Caller::Kind::kNone || caller.kind == Caller::Kind::kInvalid) {
    return Allow(caller, method, "", "");
  }
  return absl::OkStatus();
}

std::string Authorizer::JobToken(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return "";
  return FormatJobToken(job_id, it->second.secret);
}

absl::Status Authorizer::Check(const grpc::ServerContext& context, const std::string& method,
                               const std::string& job_id, const std::string& job_name) const {
  if (!enabled()) return absl::OkStatus();
  return Allow(Identify(context), method, job_id, job_name);
}

absl::Status Authorizer::Allow(const Caller& caller, const std::string& method,
                               const std::string& job_id, const std::string& job_name) const {
  if (!enabled()) return absl::OkStatus();
  auto rule = MethodAccess().find(method);
  if (rule == MethodAccess().end()) {
    return absl::InternalError(absl::StrCat(method, " has no authorization rule; refused"));
  }
  const Access access = rule->second;
  switch (caller.kind) {
    case Caller::Kind::kNone:
      return absl::UnauthenticatedError(absl::StrCat(
          method, " needs ", AccessName(access), ": give a token (RANNC_TOKEN or "
          "RANNC_TOKEN_FILE; the CLI's --token-file), sent as 'authorization: Bearer <token>'"));
    case Caller::Kind::kInvalid:
      return absl::UnauthenticatedError(absl::StrCat(
          method, ": the token given is neither the admin token nor a live job's (a job's token "
          "ends with its job)"));
    case Caller::Kind::kAdmin:
      return absl::OkStatus();
    case Caller::Kind::kPeer:
      if (access == Access::kJob || access == Access::kJobName) {
        // Daemons forward their clients' calls only with the client's token.
        return absl::PermissionDeniedError(absl::StrCat(
            method, ": a daemon's certificate (", caller.peer, ") does not stand for a job's "
            "client; it needs ", AccessName(access)));
      }
      return absl::OkStatus();
    case Caller::Kind::kJob:
      switch (access) {
        case Access::kAuthenticated:
          return absl::OkStatus();
        case Access::kJob:
          if (job_id == caller.job_id) return absl::OkStatus();
          // A request naming the job by name only (checkpoints of a finished job).
          if (job_id.empty() && !job_name.empty() && job_name == caller.job_name) {
            return absl::OkStatus();
          }
          return absl::PermissionDeniedError(absl::StrCat(
              method, ": the token given is job ", caller.job_id, "'s; this call names job '",
              job_id, "'"));
        case Access::kJobName:
          if (!caller.job_name.empty() && job_name == caller.job_name) return absl::OkStatus();
          return absl::PermissionDeniedError(absl::StrCat(
              method, ": the token given is that of job ", caller.job_id, " ('",
              caller.job_name, "'); this call names '", job_name, "'"));
        case Access::kAdmin:
        case Access::kPeer:
          return absl::PermissionDeniedError(
              absl::StrCat(method, " needs ", AccessName(access), "; a job's token is not it"));
      }
  }
  return absl::PermissionDeniedError(absl::StrCat(method, ": refused"));
}

std::shared_ptr<grpc::Channel> TokenChannel(const std::string& target,
                                            const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                            const grpc::ChannelArguments& args,
                                            const std::string& token) {
  if (token.empty()) return grpc::CreateCustomChannel(target, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<TokenInterceptorFactory>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(factories));
}

void SetPeerToken(std::string token) {
  std::lock_guard<std::mutex> lock(peer_token_mu);
  PeerTokenSlot() = std::move(token);
}

std::shared_ptr<grpc::Channel> PeerChannel(const std::string& target,
                                           const grpc::ChannelArguments& args) {
  std::string token;
  {
    std::lock_guard<std::mutex> lock(peer_token_mu);
    token = PeerTokenSlot();
  }
  return TokenChannel(target, PeerCredentials(), args, token);
}

std::shared_ptr<grpc::Channel> PeerChannel(const std::string& target) {
  return PeerChannel(target, grpc::ChannelArguments());
}

}  // namespace security
}  // namespace rannc
