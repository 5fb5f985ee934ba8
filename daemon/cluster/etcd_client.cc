#include "daemon/cluster/etcd_client.h"

#include <algorithm>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace rannc {
namespace cluster {

namespace {

using Clock = std::chrono::steady_clock;

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  // A deadline the server meets first (a campaign still waiting) comes back as UNKNOWN.
  const bool deadline = s.error_code() == grpc::StatusCode::UNKNOWN &&
                        absl::StrContains(s.error_message(), "context deadline exceeded");
  return absl::Status(deadline ? absl::StatusCode::kDeadlineExceeded
                               : static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd: ", what, ": ", s.error_message()));
}

void SetDeadline(grpc::ClientContext* context, std::chrono::milliseconds timeout) {
  context->set_deadline(std::chrono::system_clock::now() + timeout);
}

KeyValue FromProto(const mvccpb::KeyValue& kv) {
  KeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.version = kv.version();
  out.lease = kv.lease();
  return out;
}

}  // namespace

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xFF) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, std::chrono::milliseconds timeout,
                       const std::shared_ptr<grpc::ChannelCredentials>& credentials)
    : endpoints_(std::move(endpoints)), timeout_(timeout) {
  for (const std::string& e : endpoints_) {
    channels_.push_back(grpc::CreateChannel(
        e, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials()));
  }
}

EtcdClient::~EtcdClient() = default;

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(
    std::vector<std::string> endpoints, std::chrono::milliseconds timeout,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  if (endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoints");
  std::unique_ptr<EtcdClient> client(
      new EtcdClient(std::move(endpoints), timeout, credentials));
  // Reachable at all: a member answering a read.
  absl::StatusOr<std::optional<KeyValue>> probe = client->Get("/rannc/");
  if (!probe.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "no etcd member of ", absl::StrJoin(client->endpoints_, ","), " answers: ",
        probe.status().message()));
  }
  return client;
}

std::shared_ptr<grpc::Channel> EtcdClient::Channel(size_t* index) {
  std::lock_guard<std::mutex> lock(mu_);
  *index = current_;
  return channels_[current_];
}

void EtcdClient::Failed(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ == index) current_ = (current_ + 1) % channels_.size();
}

absl::Status EtcdClient::Call(
    const std::string& what,
    const std::function<absl::Status(const std::shared_ptr<grpc::Channel>&)>& call) {
  absl::Status status;
  for (size_t attempt = 0; attempt < channels_.size(); ++attempt) {
    size_t index = 0;
    std::shared_ptr<grpc::Channel> channel = Channel(&index);
    status = call(channel);
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      // Perhaps applied: not retried, but the next call tries another member (one cut off from
      // the others' quorum answers nothing).
      Failed(index);
      return status;
    }
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    spdlog::debug("etcd {} unavailable for {}: {}", endpoints_[index], what, status.ToString());
    Failed(index);
  }
  return status;
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  int64_t revision = 0;
  absl::Status s = Call("put " + key, [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::PutRequest req;
    req.set_key(key);
    req.set_value(value);
    req.set_lease(lease);
    etcdserverpb::PutResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status = FromGrpc(etcdserverpb::KV::NewStub(ch)->Put(&ctx, req, &resp),
                                   "put " + key);
    revision = resp.header().revision();
    return status;
  });
  if (!s.ok()) return s;
  return revision;
}

absl::StatusOr<std::vector<KeyValue>> EtcdClient::Range(const std::string& key,
                                                        const std::string& end,
                                                        int64_t* revision) {
  std::vector<KeyValue> out;
  const std::string what = "get " + key + (end.empty() ? "" : "*");
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::RangeRequest req;
    req.set_key(key);
    if (!end.empty()) req.set_range_end(end);
    etcdserverpb::RangeResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status = FromGrpc(etcdserverpb::KV::NewStub(ch)->Range(&ctx, req, &resp), what);
    out.clear();
    for (const mvccpb::KeyValue& kv : resp.kvs()) out.push_back(FromProto(kv));
    if (revision != nullptr) *revision = resp.header().revision();
    return status;
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<std::optional<KeyValue>> EtcdClient::Get(const std::string& key,
                                                        int64_t* revision) {
  absl::StatusOr<std::vector<KeyValue>> found = Range(key, "", revision);
  if (!found.ok()) return found.status();
  if (found->empty()) return std::optional<KeyValue>();
  return std::optional<KeyValue>(std::move(found->front()));
}

absl::StatusOr<std::vector<KeyValue>> EtcdClient::GetPrefix(const std::string& prefix,
                                                            int64_t* revision) {
  return Range(prefix, PrefixEnd(prefix), revision);
}

absl::StatusOr<int64_t> EtcdClient::DeleteRange(const std::string& key,
                                                const std::string& end) {
  int64_t deleted = 0;
  const std::string what = "delete " + key + (end.empty() ? "" : "*");
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::DeleteRangeRequest req;
    req.set_key(key);
    if (!end.empty()) req.set_range_end(end);
    etcdserverpb::DeleteRangeResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status =
        FromGrpc(etcdserverpb::KV::NewStub(ch)->DeleteRange(&ctx, req, &resp), what);
    deleted = resp.deleted();
    return status;
  });
  if (!s.ok()) return s;
  return deleted;
}

absl::StatusOr<int64_t> EtcdClient::Delete(const std::string& key) {
  return DeleteRange(key, "");
}

absl::StatusOr<int64_t> EtcdClient::DeletePrefix(const std::string& prefix) {
  return DeleteRange(prefix, PrefixEnd(prefix));
}

absl::StatusOr<bool> EtcdClient::Txn(const std::string& what,
                                     const etcdserverpb::TxnRequest& req) {
  bool succeeded = false;
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::TxnResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status = FromGrpc(etcdserverpb::KV::NewStub(ch)->Txn(&ctx, req, &resp), what);
    succeeded = resp.succeeded();
    return status;
  });
  if (!s.ok()) return s;
  return succeeded;
}

absl::StatusOr<bool> EtcdClient::PutIfModRevision(const std::string& key,
                                                  const std::string& value,
                                                  int64_t mod_revision, int64_t lease) {
  etcdserverpb::TxnRequest req;
  etcdserverpb::Compare* cmp = req.add_compare();
  cmp->set_key(key);
  cmp->set_result(etcdserverpb::Compare::EQUAL);
  cmp->set_target(etcdserverpb::Compare::MOD);
  cmp->set_mod_revision(mod_revision);
  etcdserverpb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  return Txn("compare-and-put " + key, req);
}

namespace {

// The compare of a fenced write: `fence_key` exists, created at `fence_revision`.
void AddFence(etcdserverpb::TxnRequest* req, const std::string& fence_key,
              int64_t fence_revision) {
  etcdserverpb::Compare* cmp = req->add_compare();
  cmp->set_key(fence_key);
  cmp->set_result(etcdserverpb::Compare::EQUAL);
  cmp->set_target(etcdserverpb::Compare::CREATE);
  cmp->set_create_revision(fence_revision);
}

}  // namespace

absl::StatusOr<bool> EtcdClient::PutIfFenced(const std::string& key, const std::string& value,
                                             const std::string& fence_key,
                                             int64_t fence_revision) {
  etcdserverpb::TxnRequest req;
  AddFence(&req, fence_key, fence_revision);
  etcdserverpb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  return Txn(absl::StrCat("put ", key, " fenced by ", fence_key), req);
}

absl::StatusOr<bool> EtcdClient::DeleteIfFenced(const std::string& key,
                                                const std::string& fence_key,
                                                int64_t fence_revision) {
  etcdserverpb::TxnRequest req;
  AddFence(&req, fence_key, fence_revision);
  req.add_success()->mutable_request_delete_range()->set_key(key);
  return Txn(absl::StrCat("delete ", key, " fenced by ", fence_key), req);
}

absl::StatusOr<bool> EtcdClient::PutIfAbsent(const std::string& key, const std::string& value,
                                             int64_t lease) {
  // A key that does not exist compares as modified at revision 0.
  return PutIfModRevision(key, value, 0, lease);
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(std::chrono::seconds ttl) {
  int64_t id = 0;
  absl::Status s = Call("grant a lease", [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::LeaseGrantRequest req;
    req.set_ttl(ttl.count());
    etcdserverpb::LeaseGrantResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status = FromGrpc(
        etcdserverpb::Lease::NewStub(ch)->LeaseGrant(&ctx, req, &resp), "grant a lease");
    if (status.ok() && !resp.error().empty()) {
      status = absl::InternalError(absl::StrCat("etcd: grant a lease: ", resp.error()));
    }
    id = resp.id();
    return status;
  });
  if (!s.ok()) return s;
  return id;
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  const std::string what = absl::StrCat("revoke lease ", lease);
  return Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseRevokeResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    return FromGrpc(etcdserverpb::Lease::NewStub(ch)->LeaseRevoke(&ctx, req, &resp), what);
  });
}

absl::StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease, std::chrono::milliseconds timeout) {
  int64_t ttl = 0;
  const std::string what = absl::StrCat("keep lease ", lease, " alive");
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout.count() > 0 ? timeout : timeout_);
    auto stream = etcdserverpb::Lease::NewStub(ch)->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    const bool answered = stream->Write(req) && stream->Read(&resp);
    stream->WritesDone();
    grpc::Status finished = answered ? grpc::Status::OK : stream->Finish();
    if (answered) ctx.TryCancel();  // the stream's end is of no interest
    absl::Status status = FromGrpc(finished, what);
    if (status.ok() && !answered) status = absl::UnavailableError("etcd: " + what + ": no answer");
    ttl = resp.ttl();
    return status;
  });
  if (!s.ok()) return s;
  if (ttl <= 0) return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  return ttl;
}

absl::StatusOr<Leadership> EtcdClient::Campaign(const std::string& name, int64_t lease,
                                                const std::string& value,
                                                std::chrono::milliseconds timeout) {
  Leadership out;
  const std::string what = "campaign for " + name;
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    v3electionpb::CampaignRequest req;
    req.set_name(name);
    req.set_lease(lease);
    req.set_value(value);
    v3electionpb::CampaignResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout);
    absl::Status status =
        FromGrpc(v3electionpb::Election::NewStub(ch)->Campaign(&ctx, req, &resp), what);
    out.name = resp.leader().name();
    out.key = resp.leader().key();
    out.revision = resp.leader().rev();
    out.lease = resp.leader().lease();
    return status;
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<std::optional<Leadership>> EtcdClient::TryLead(const std::string& name,
                                                               int64_t lease,
                                                               const std::string& value) {
  const std::string prefix = name + "/";
  const std::string key = absl::StrFormat("%s%x", prefix, lease);
  absl::StatusOr<bool> created = PutIfAbsent(key, value, lease);
  if (!created.ok()) return created.status();
  absl::StatusOr<std::vector<KeyValue>> candidates = GetPrefix(prefix);
  if (!candidates.ok()) return candidates.status();
  const KeyValue* first = nullptr;
  const KeyValue* mine = nullptr;
  for (const KeyValue& kv : *candidates) {
    if (first == nullptr || kv.create_revision < first->create_revision) first = &kv;
    if (kv.key == key) mine = &kv;
  }
  if (mine == nullptr) {
    return absl::NotFoundError(absl::StrCat("etcd: campaign for ", name, ": lease ", lease,
                                            " has expired"));
  }
  if (first == mine) {
    if (!*created && mine->value != value) {  // this lease led already, announcing another value
      absl::StatusOr<bool> put = PutIfModRevision(key, value, mine->mod_revision, lease);
      if (!put.ok()) return put.status();
    }
    return Leadership{name, key, mine->create_revision, lease};
  }
  if (*created) {
    absl::StatusOr<int64_t> withdrawn = Delete(key);
    if (!withdrawn.ok()) return withdrawn.status();
  }
  return std::nullopt;
}

absl::Status EtcdClient::Resign(const Leadership& leadership) {
  const std::string what = "resign from " + leadership.name;
  return Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    v3electionpb::ResignRequest req;
    v3electionpb::LeaderKey* key = req.mutable_leader();
    key->set_name(leadership.name);
    key->set_key(leadership.key);
    key->set_rev(leadership.revision);
    key->set_lease(leadership.lease);
    v3electionpb::ResignResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    return FromGrpc(v3electionpb::Election::NewStub(ch)->Resign(&ctx, req, &resp), what);
  });
}

absl::StatusOr<KeyValue> EtcdClient::Leader(const std::string& name) {
  KeyValue out;
  const std::string what = "leader of " + name;
  absl::Status s = Call(what, [&](const std::shared_ptr<grpc::Channel>& ch) {
    v3electionpb::LeaderRequest req;
    req.set_name(name);
    v3electionpb::LeaderResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout_);
    absl::Status status =
        FromGrpc(v3electionpb::Election::NewStub(ch)->Leader(&ctx, req, &resp), what);
    out = FromProto(resp.kv());
    return status;
  });
  if (!s.ok()) {
    // etcd says "election: no leader" as UNKNOWN.
    if (absl::StrContains(s.message(), "no leader")) {
      return absl::NotFoundError(absl::StrCat("no daemon leads ", name));
    }
    return s;
  }
  return out;
}

std::unique_ptr<EtcdClient::Watch> EtcdClient::WatchPrefix(
    const std::string& prefix, int64_t start_revision,
    std::function<void(const WatchEvent&)> on_event,
    std::function<void(const absl::Status&)> on_error) {
  std::unique_ptr<Watch> watch(new Watch());
  watch->client_ = this;
  watch->prefix_ = prefix;
  watch->next_revision_ = start_revision;
  watch->on_event_ = std::move(on_event);
  watch->on_error_ = std::move(on_error);
  watch->thread_ = std::thread([w = watch.get()] { w->Run(); });
  return watch;
}

EtcdClient::Watch::~Watch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (context_) context_->TryCancel();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EtcdClient::Watch::Run() {
  int failures = 0;
  while (true) {
    size_t index = 0;
    std::shared_ptr<grpc::Channel> channel = client_->Channel(&index);
    auto context = std::make_shared<grpc::ClientContext>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      context_ = context;
    }
    auto stub = etcdserverpb::Watch::NewStub(channel);
    auto stream = stub->Watch(context.get());
    etcdserverpb::WatchRequest req;
    etcdserverpb::WatchCreateRequest* create = req.mutable_create_request();
    create->set_key(prefix_);
    create->set_range_end(PrefixEnd(prefix_));
    create->set_start_revision(next_revision_);
    bool healthy = stream->Write(req);
    etcdserverpb::WatchResponse resp;
    absl::Status ended;
    while (healthy && stream->Read(&resp)) {
      failures = 0;
      if (resp.created() && next_revision_ == 0) {
        // "From now": a reconnection goes on from here, not from its own now.
        next_revision_ = resp.header().revision() + 1;
      }
      if (resp.canceled()) {
        ended = absl::AbortedError(absl::StrCat(
            "etcd: the watch of ", prefix_, " was cancelled", resp.compact_revision() > 0
                ? absl::StrCat(" (revision ", next_revision_, " compacted; oldest kept ",
                               resp.compact_revision(), ")")
                : "", ": ", resp.cancel_reason()));
        break;
      }
      for (const mvccpb::Event& e : resp.events()) {
        WatchEvent event;
        event.type = e.type() == mvccpb::Event::DELETE ? WatchEvent::Type::kDelete
                                                       : WatchEvent::Type::kPut;
        event.kv = FromProto(e.kv());
        next_revision_ = std::max(next_revision_, e.kv().mod_revision() + 1);
        on_event_(event);
      }
    }
    context->TryCancel();
    grpc::Status finished = stream->Finish();
    {
      std::lock_guard<std::mutex> lock(mu_);
      context_.reset();
      if (stopping_) return;
    }
    if (!ended.ok()) {
      if (on_error_) on_error_(ended);
      return;
    }
    // The stream broke (the member went away): the next endpoint, after a pause that grows.
    client_->Failed(index);
    if (++failures >= 3 * static_cast<int>(client_->endpoints().size()) && on_error_) {
      on_error_(FromGrpc(finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                      "the stream ended")
                                       : finished,
                         "watch " + prefix_));
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(std::min(1000, 50 << std::min(failures, 4))),
                 [&] { return stopping_; });
    if (stopping_) return;
  }
}

LeaseKeeper::LeaseKeeper(EtcdClient* client, int64_t lease, std::chrono::seconds ttl,
                         std::function<void(const absl::Status&)> on_lost,
                         Clock::time_point granted)
    : client_(client), lease_(lease), ttl_(ttl), on_lost_(std::move(on_lost)) {
  const std::chrono::milliseconds whole = ttl_;
  valid_until_ns_ = (granted + whole - whole / 10).time_since_epoch().count();
  thread_ = std::thread([this] { Run(); });
}

LeaseKeeper::~LeaseKeeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Clock::time_point LeaseKeeper::valid_until() const {
  return Clock::time_point(Clock::duration(valid_until_ns_.load()));
}

bool LeaseKeeper::valid() const { return !lost_ && Clock::now() < valid_until(); }

void LeaseKeeper::Run() {
  const auto period = std::chrono::duration_cast<Clock::duration>(ttl_) / 3;
  const auto retry = std::min<Clock::duration>(period, std::chrono::milliseconds(500));
  Clock::time_point next = Clock::now() + period;
  absl::Status why = absl::DeadlineExceededError("no keep-alive was answered");
  while (true) {
    const Clock::time_point until = valid_until();
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_until(lock, std::min(next, until), [&] { return stopping_; })) return;
    }
    const Clock::time_point sent = Clock::now();
    if (sent >= until) break;
    // A keep-alive answered after the lease surely lives no longer would not help.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - sent);
    absl::StatusOr<int64_t> ttl =
        client_->KeepAlive(lease_, std::max(left, std::chrono::milliseconds(1)));
    if (ttl.ok()) {
      const std::chrono::milliseconds granted = std::chrono::seconds(*ttl);
      valid_until_ns_ = (sent + granted - granted / 10).time_since_epoch().count();
      next = Clock::now() + period;
      continue;
    }
    why = ttl.status();
    if (why.code() == absl::StatusCode::kNotFound) break;
    spdlog::warn("etcd lease {:x}: keep-alive failed ({}); retrying while it surely lives "
                 "({} ms more)", lease_, why.ToString(),
                 std::chrono::duration_cast<std::chrono::milliseconds>(valid_until() -
                                                                       Clock::now()).count());
    next = Clock::now() + retry;
  }
  lost_ = true;
  spdlog::error("etcd lease {:x} is lost: {}", lease_, why.ToString());
  if (on_lost_) on_lost_(why);
}

}  // namespace cluster
}  // namespace rannc
