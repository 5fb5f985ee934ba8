#include "daemon/comm/ucx/ucx_communicator.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/comm/ucx/ring.h"

namespace rannc {
namespace comm {
namespace {

// A failed store call during setup, with its code kept.
absl::Status StoreError(const absl::Status& s, const char* what) {
  return absl::Status(s.code(), absl::StrCat("ucx: ", what, " through the store: ", s.message()));
}

using Clock = std::chrono::steady_clock;

constexpr uint64_t kCollectiveBit = uint64_t{1} << 63;
constexpr uint64_t kControlBit = uint64_t{1} << 47;
constexpr int kRankShift = 48;
constexpr int kMaxRanks = 1 << 15;
constexpr uint64_t kFullMask = ~uint64_t{0};

uint64_t P2pTag(int src, uint32_t user_tag) {
  return (uint64_t(src) << kRankShift) | user_tag;
}
uint64_t CollectiveTag(int src, uint64_t ring_tag) {
  return kCollectiveBit | (uint64_t(src) << kRankShift) | ring_tag;
}
uint64_t GoodbyeTag(int src) { return (uint64_t(src) << kRankShift) | kControlBit; }

// What a Work waits on; completed once from the engine thread.
class WorkState {
 public:
  void Complete(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
    cv_.notify_all();
  }
  absl::Status Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout == kNoTimeout) {
      cv_.wait(lock, [&] { return done_; });
    } else if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
      return absl::DeadlineExceededError(
          absl::StrCat("ucx: operation not complete after ", timeout.count(),
                       " ms; it keeps running (wait again) or destroy the communicator"));
    }
    return status_;
  }
  bool IsCompleted() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

class UcxWork : public Work {
 public:
  explicit UcxWork(std::shared_ptr<WorkState> state) : state_(std::move(state)) {}
  absl::Status Wait(std::chrono::milliseconds timeout) override { return state_->Wait(timeout); }
  bool IsCompleted() override { return state_->IsCompleted(); }

 private:
  std::shared_ptr<WorkState> state_;
};

std::unique_ptr<Work> Failed(absl::Status status) {
  auto state = std::make_shared<WorkState>();
  state->Complete(std::move(status));
  return std::make_unique<UcxWork>(state);
}

class Engine;

// One UCX send or receive; lives until its completion callback (or until its P2pRequest is
// destroyed, whichever is later). Touched only on the engine thread.
struct Op {
  Engine* engine = nullptr;
  void* request = nullptr;  // the UCX request while in flight
  bool recv = false;
  int peer = 0;
  size_t bytes = 0;
  bool done = false;
  absl::Status status;
  std::shared_ptr<WorkState> work;  // user p2p: completed with the op
  bool held = false;                // a P2pRequest still points here
  bool posting = false;             // inside ucp_*_nbx: the poster deletes, not the callback
};

struct EpErrorArg {
  Engine* engine;
  int peer;
};

class Engine {
 public:
  Engine(const std::string& group, int rank, int size, const UcxOptions& options)
      : group_(group), rank_(rank), size_(size), options_(options) {}

  ~Engine() {
    if (thread_.joinable()) {
      stop_.store(true);
      ucp_worker_signal(worker_);
      thread_.join();
    } else if (worker_ != nullptr) {
      Shutdown();  // Init failed before the engine started: still close its endpoints
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init(Store* store, std::chrono::milliseconds timeout);

  // Runs `post` on the engine thread, soon.
  void Submit(std::function<void()> post) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitted_.push_back({std::move(post), nullptr, nullptr});
      has_submitted_.store(true);
    }
    ucp_worker_signal(worker_);
  }
  // Runs `collective` on the engine thread after earlier collectives; completes `work`.
  void SubmitCollective(std::function<absl::Status()> collective,
                        std::shared_ptr<WorkState> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitted_.push_back({nullptr, std::move(collective), std::move(work)});
      has_submitted_.store(true);
    }
    ucp_worker_signal(worker_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& group() const { return group_; }
  RingScratch* scratch() { return &scratch_; }
  const UcxOptions& options() const { return options_; }

  // Engine thread only, below.
  Op* PostSend(const void* data, size_t bytes, int dst, uint64_t tag,
               std::shared_ptr<WorkState> work, bool held);
  Op* PostRecv(void* data, size_t bytes, int src, uint64_t tag,
               std::shared_ptr<WorkState> work, bool held);
  // Progress once; sleeps when nothing happened for a while.
  void Progress();
  // Why an op on `peer` cannot complete now, if it cannot (destroyed communicator, lost peer).
  absl::Status Blocked(int peer) const {
    if (stop_.load()) return Destroyed();
    if (!gone_[peer].empty()) return PeerGone(peer);
    return absl::OkStatus();
  }
  void Release(Op* op);  // a P2pRequest lets go

 private:
  // Makes context_ and worker_, again while the host's interfaces change under UCX.
  absl::Status OpenWorker();
  struct Task {
    std::function<void()> post;
    std::function<absl::Status()> collective;
    std::shared_ptr<WorkState> work;
  };

  static void SendCallback(void* request, ucs_status_t status, void* user_data);
  static void RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data);
  static void EpErrorCallback(void* arg, ucp_ep_h ep, ucs_status_t status);

  void Loop();
  void Drain();
  void Finish(Op* op, ucs_status_t status);
  void HandleGone();
  void Shutdown();
  absl::Status ToStatus(const Op& op, ucs_status_t status) const;
  absl::Status Destroyed() const {
    return absl::CancelledError(absl::StrCat("ucx: communicator of group '", group_, "' rank ",
                                             rank_, " was destroyed before the operation ended"));
  }
  absl::Status PeerGone(int peer) const {
    return absl::UnavailableError(absl::StrCat("ucx: peer rank ", peer, " of group '", group_,
                                               "' is gone (", gone_[peer],
                                               "); recreate the group without it"));
  }
  void CloseEp(int peer);

  const std::string group_;
  const int rank_, size_;
  const UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<ucp_ep_h> eps_;
  std::vector<EpErrorArg> ep_args_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex mu_;
  std::deque<Task> submitted_;  // guarded by mu_
  std::atomic<bool> has_submitted_{false};

  // Engine thread only.
  std::deque<Task> collectives_;
  std::unordered_set<Op*> in_flight_;
  std::vector<std::string> gone_;                     // per peer: why it is gone, or ""
  std::vector<std::pair<int, std::string>> newly_gone_;  // from callbacks, handled after them
  std::vector<void*> closing_;                        // ucp_ep_close_nbx requests
  RingScratch scratch_;
  Clock::time_point idle_since_;
  bool idle_ = false;
};

absl::Status UcxError(const char* what, ucs_status_t status) {
  return absl::InternalError(absl::StrCat("ucx: ", what, " failed: ", ucs_status_string(status)));
}

absl::Status Engine::OpenWorker() {
  // UCX lists the host's network interfaces when the context is made and opens them when the
  // worker is: an interface that goes away in between (a container's veth on a Kubernetes node,
  // another test's namespace link) fails the worker, with UCS_ERR_NO_DEVICE or, when it went
  // while its socket was being set up, UCS_ERR_IO_ERROR. A new context lists them again; a
  // failure that is not of this kind fails each attempt alike, within ~1.3 s. (Five attempts
  // within 0.2 s were not enough under ASan while ucx_interfaces_test's flappers changed the
  // interfaces ~50 times a second: 2 ranks of 164 failed in one CI run.)
  constexpr int kAttempts = 12;
  for (int attempt = 1;; ++attempt) {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return UcxError("ucp_config_read", st);
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) {
      context_ = nullptr;
      return UcxError("ucp_init", st);
    }
    ucp_worker_params_t wparams = {};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the engine thread touches it
    st = ucp_worker_create(context_, &wparams, &worker_);
    if (st == UCS_OK) return absl::OkStatus();
    worker_ = nullptr;
    ucp_cleanup(context_);
    context_ = nullptr;
    if (attempt == kAttempts) {
      return UcxError(absl::StrCat("ucp_worker_create (", kAttempts, " attempts)").c_str(), st);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * std::min(attempt, 10)));
  }
}

absl::Status Engine::Init(Store* store, std::chrono::milliseconds timeout) {
  gone_.assign(size_, "");
  if (absl::Status opened = OpenWorker(); !opened.ok()) return opened;
  ucs_status_t st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return UcxError("ucp_worker_get_efd", st);

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(worker_, &address, &address_length);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  std::string mine(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker_, address);

  // A group re-created under the same store (after a failure, or in a loop) must not read the
  // previous incarnation's addresses.
  absl::StatusOr<int64_t> incarnation =
      store->Add(absl::StrCat(group_, "/ucx/incarnation/", rank_), 1);
  if (!incarnation.ok()) return StoreError(incarnation.status(), "rendezvous");
  const std::string prefix = *incarnation == 1 ? absl::StrCat(group_, "/ucx")
                                               : absl::StrCat(group_, "/ucx/", *incarnation);
  if (absl::Status s = store->Set(absl::StrCat(prefix, "/addr/", rank_), mine); !s.ok()) {
    return StoreError(s, "publishing the worker address");
  }

  eps_.assign(size_, nullptr);
  ep_args_.resize(size_);
  const Clock::time_point deadline = Clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  for (int peer = 0; peer < size_; ++peer) {
    absl::StatusOr<std::string> theirs =
        store->Get(absl::StrCat(prefix, "/addr/", peer), left());
    if (!theirs.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ucx: rank ", peer, " of group '", group_, "' did not publish its address within ",
          timeout.count(), " ms (is it started with the same group name and size?): ",
          theirs.status().message()));
    }
    ep_args_[peer] = {this, peer};
    ucp_ep_params_t ep_params = {};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(theirs->data());
    if (options_.peer_error_handling) {
      ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep_params.err_handler.cb = &Engine::EpErrorCallback;
      ep_params.err_handler.arg = &ep_args_[peer];
    }
    st = ucp_ep_create(worker_, &ep_params, &eps_[peer]);
    if (st != UCS_OK) {
      return absl::UnavailableError(absl::StrCat("ucx: cannot connect to rank ", peer,
                                                 " of group '", group_,
                                                 "': ", ucs_status_string(st)));
    }
  }
  // A goodbye from each peer marks it gone.
  static char goodbye_sink;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) PostRecv(&goodbye_sink, 0, peer, GoodbyeTag(peer), nullptr, false);
  }
  thread_ = std::thread([this] { Loop(); });

  if (absl::Status s = store->Set(absl::StrCat(prefix, "/ready/", rank_), "1"); !s.ok()) {
    return StoreError(s, "rendezvous");
  }
  std::vector<std::string> missing;
  for (int peer = 0; peer < size_; ++peer) {
    if (!store->Get(absl::StrCat(prefix, "/ready/", peer), left()).ok()) {
      missing.push_back(std::to_string(peer));
    }
  }
  if (!missing.empty()) {
    std::string ranks;
    for (const auto& m : missing) absl::StrAppend(&ranks, ranks.empty() ? "" : ", ", m);
    return absl::DeadlineExceededError(absl::StrCat("ucx: ranks ", ranks, " of group '", group_,
                                                    "' did not connect within ", timeout.count(),
                                                    " ms"));
  }
  return absl::OkStatus();
}

Op* Engine::PostSend(const void* data, size_t bytes, int dst, uint64_t tag,
                     std::shared_ptr<WorkState> work, bool held) {
  Op* op = new Op;
  op->engine = this;
  op->peer = dst;
  op->bytes = bytes;
  op->work = std::move(work);
  op->held = held;
  // The goodbye goes out while stopping; nothing else may.
  const bool goodbye = tag == GoodbyeTag(rank_);
  absl::Status blocked = goodbye ? absl::OkStatus() : Blocked(dst);
  if (!blocked.ok() || eps_[dst] == nullptr || !gone_[dst].empty()) {
    op->done = true;
    op->status = blocked.ok() ? PeerGone(dst) : blocked;
    if (op->work) op->work->Complete(op->status);
    if (!held) delete op;
    return op;
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &Engine::SendCallback;
  param.user_data = op;
  ucs_status_ptr_t request = ucp_tag_send_nbx(eps_[dst], data, bytes, tag, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    Finish(op, UCS_PTR_STATUS(request));
  } else {
    op->request = request;
    in_flight_.insert(op);
  }
  return op;
}

Op* Engine::PostRecv(void* data, size_t bytes, int src, uint64_t tag,
                     std::shared_ptr<WorkState> work, bool held) {
  Op* op = new Op;
  op->engine = this;
  op->recv = true;
  op->peer = src;
  op->bytes = bytes;
  op->work = std::move(work);
  op->held = held;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv = &Engine::RecvCallback;
  param.user_data = op;
  // UCX 1.13 does not fill recv_info when an already-arrived message completes the receive
  // inside the call, so the length could not be checked; have it call back instead.
  param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  op->posting = true;
  ucs_status_ptr_t request = ucp_tag_recv_nbx(worker_, data, bytes, tag, kFullMask, &param);
  op->posting = false;
  if (UCS_PTR_IS_ERR(request)) {
    Finish(op, UCS_PTR_STATUS(request));
  } else if (op->done) {  // called back inside the call
    if (!op->held) delete op;
  } else {
    op->request = request;
    in_flight_.insert(op);
    // A message the peer sent before leaving may still match (it was queued); anything else
    // from a gone peer never comes.
    if (!gone_[src].empty()) ucp_request_cancel(worker_, request);
  }
  return op;
}

void Engine::SendCallback(void* request, ucs_status_t status, void* user_data) {
  Op* op = static_cast<Op*>(user_data);
  ucp_request_free(request);
  op->engine->Finish(op, status);
}

void Engine::RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data) {
  Op* op = static_cast<Op*>(user_data);
  ucp_request_free(request);
  if (status == UCS_OK && info->length != op->bytes) status = UCS_ERR_MESSAGE_TRUNCATED;
  op->engine->Finish(op, status);
}

void Engine::EpErrorCallback(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<EpErrorArg*>(arg);
  a->engine->newly_gone_.push_back({a->peer, ucs_status_string(status)});
}

absl::Status Engine::ToStatus(const Op& op, ucs_status_t status) const {
  if (status == UCS_OK) return absl::OkStatus();
  if (!gone_[op.peer].empty()) return PeerGone(op.peer);
  if (status == UCS_ERR_CANCELED && stop_.load()) return Destroyed();
  if (status == UCS_ERR_MESSAGE_TRUNCATED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx: the message from rank ", op.peer, " does not have the receive buffer's ", op.bytes,
        " bytes; sender and receiver must agree on count and dtype"));
  }
  if (status == UCS_ERR_CONNECTION_RESET || status == UCS_ERR_ENDPOINT_TIMEOUT ||
      status == UCS_ERR_UNREACHABLE) {
    return absl::UnavailableError(absl::StrCat("ucx: peer rank ", op.peer, " of group '", group_,
                                               "' is unreachable: ", ucs_status_string(status)));
  }
  return absl::InternalError(absl::StrCat("ucx: ", op.recv ? "receive from" : "send to",
                                          " rank ", op.peer, " failed: ",
                                          ucs_status_string(status)));
}

void Engine::Finish(Op* op, ucs_status_t status) {
  in_flight_.erase(op);
  op->request = nullptr;
  op->done = true;
  op->status = ToStatus(*op, status);
  if (op->work) op->work->Complete(op->status);
  if (op->recv && status == UCS_OK && op->work == nullptr && !op->held) {
    // The only unheld, work-less receives are the goodbyes.
    newly_gone_.push_back({op->peer, "it closed its communicator"});
  }
  if (!op->held && !op->posting) delete op;
}

void Engine::Release(Op* op) {
  if (op->done) {
    delete op;
    return;
  }
  // Still in flight (an early error return): the callback deletes it.
  op->held = false;
  if (op->recv) ucp_request_cancel(worker_, op->request);
}

void Engine::CloseEp(int peer) {
  if (eps_[peer] == nullptr) return;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // the peer may be gone: do not wait for it
  ucs_status_ptr_t request = ucp_ep_close_nbx(eps_[peer], &param);
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing_.push_back(request);
  eps_[peer] = nullptr;
}

void Engine::HandleGone() {
  while (!newly_gone_.empty()) {
    auto [peer, why] = newly_gone_.back();
    newly_gone_.pop_back();
    if (!gone_[peer].empty()) continue;
    gone_[peer] = why;
    // Closing the endpoint fails sends to it; receives match by tag, so cancel them here.
    if (peer != rank_) CloseEp(peer);
    std::vector<void*> cancel;
    for (Op* op : in_flight_) {
      if (op->recv && op->peer == peer) cancel.push_back(op->request);
    }
    for (void* request : cancel) ucp_request_cancel(worker_, request);
  }
}

void Engine::Drain() {
  if (!has_submitted_.load()) return;
  std::deque<Task> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(submitted_);
    has_submitted_.store(false);
  }
  for (Task& task : tasks) {
    if (task.post) {
      task.post();
    } else {
      collectives_.push_back(std::move(task));
    }
  }
}

void Engine::Progress() {
  Drain();
  const bool progressed = ucp_worker_progress(worker_) != 0;
  HandleGone();
  if (progressed) {
    idle_ = false;
    return;
  }
  const Clock::time_point now = Clock::now();
  if (!idle_) {
    idle_ = true;
    idle_since_ = now;
  }
  // Spinning keeps latency low inside a transfer; beyond that, sleep so idle ranks leave the
  // CPU to busy ones (ranks of a host share cores).
  if (now - idle_since_ < std::chrono::microseconds(50)) return;
  if (ucp_worker_arm(worker_) != UCS_OK) return;  // BUSY: events are pending
  if (has_submitted_.load() || stop_.load()) return;
  pollfd fd = {efd_, POLLIN, 0};
  poll(&fd, 1, in_flight_.empty() ? 100 : 10);  // the timeouts only guard against lost events
  idle_ = false;
}

void Engine::Loop() {
  while (!stop_.load()) {
    Progress();
    while (!collectives_.empty() && !stop_.load()) {
      Task task = std::move(collectives_.front());
      collectives_.pop_front();
      task.work->Complete(task.collective());
    }
  }
  Shutdown();
}

void Engine::Shutdown() {
  Drain();
  if (eps_.size() != size_t(size_)) return;  // setup failed before connecting
  for (Task& task : collectives_) task.work->Complete(Destroyed());
  collectives_.clear();
  // Tell live peers first, so their operations with this rank fail now rather than time out.
  std::vector<Op*> goodbyes;
  static const char nothing = 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && eps_[peer] != nullptr && gone_[peer].empty()) {
      goodbyes.push_back(PostSend(&nothing, 0, peer, GoodbyeTag(rank_), nullptr, true));
    }
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
  auto all_done = [&] {
    for (Op* op : goodbyes) {
      if (!op->done) return false;
    }
    return true;
  };
  while (!all_done() && Clock::now() < deadline) ucp_worker_progress(worker_);
  for (Op* op : goodbyes) Release(op);
  std::vector<void*> cancel;
  for (Op* op : in_flight_) {
    if (op->recv) cancel.push_back(op->request);
  }
  for (void* request : cancel) ucp_request_cancel(worker_, request);
  for (int peer = 0; peer < size_; ++peer) CloseEp(peer);  // fails the sends still in flight
  const Clock::time_point close_deadline = Clock::now() + std::chrono::seconds(2);
  auto closed = [&] {
    for (void* request : closing_) {
      if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
    }
    return in_flight_.empty();
  };
  while (!closed() && Clock::now() < close_deadline) ucp_worker_progress(worker_);
  for (void* request : closing_) {
    if (ucp_request_check_status(request) != UCS_INPROGRESS) ucp_request_free(request);
  }
  closing_.clear();
}

// ring.h's transport: collective traffic on the engine thread, waiting by progressing.
class RingRequest : public P2pRequest {
 public:
  explicit RingRequest(Op* op) : op_(op) {}
  ~RingRequest() override { op_->engine->Release(op_); }
  absl::Status Wait() override {
    Engine* engine = op_->engine;
    while (!op_->done) {
      if (absl::Status blocked = engine->Blocked(op_->peer); !blocked.ok()) return blocked;
      engine->Progress();
    }
    return op_->status;
  }

 private:
  Op* op_;
};

class RingTransport : public P2p {
 public:
  explicit RingTransport(Engine* engine) : engine_(engine) {}
  int rank() const override { return engine_->rank(); }
  int size() const override { return engine_->size(); }
  std::unique_ptr<P2pRequest> StartSend(const void* data, size_t bytes, int dst,
                                        uint64_t tag) override {
    return std::make_unique<RingRequest>(engine_->PostSend(
        data, bytes, dst, CollectiveTag(engine_->rank(), tag), nullptr, true));
  }
  std::unique_ptr<P2pRequest> StartRecv(void* data, size_t bytes, int src,
                                        uint64_t tag) override {
    return std::make_unique<RingRequest>(
        engine_->PostRecv(data, bytes, src, CollectiveTag(src, tag), nullptr, true));
  }

 private:
  Engine* engine_;
};

class UcxCommunicator : public Communicator {
 public:
  explicit UcxCommunicator(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}

  int rank() const override { return engine_->rank(); }
  int size() const override { return engine_->size(); }
  const char* backend() const override { return "ucx"; }

  std::unique_ptr<Work> Send(const Buffer& buffer, int dst, const SendOptions& options) override {
    if (absl::Status s = Check(buffer, dst, "send"); !s.ok()) return Failed(s);
    auto work = std::make_shared<WorkState>();
    Engine* engine = engine_.get();
    engine->Submit([engine, buffer, dst, tag = options.tag, work] {
      engine->PostSend(buffer.data, buffer.bytes(), dst, P2pTag(engine->rank(), tag), work,
                       false);
    });
    return std::make_unique<UcxWork>(work);
  }

  std::unique_ptr<Work> Recv(const Buffer& buffer, int src, const RecvOptions& options) override {
    if (absl::Status s = Check(buffer, src, "recv"); !s.ok()) return Failed(s);
    auto work = std::make_shared<WorkState>();
    Engine* engine = engine_.get();
    engine->Submit([engine, buffer, src, tag = options.tag, work] {
      engine->PostRecv(buffer.data, buffer.bytes(), src, P2pTag(src, tag), work, false);
    });
    return std::make_unique<UcxWork>(work);
  }

  std::unique_ptr<Work> AllReduce(const Buffer& buffer, const AllReduceOptions& options) override {
    if (absl::Status s = Check(buffer, rank(), "all_reduce"); !s.ok()) return Failed(s);
    return Collective([buffer, op = options.op](P2p& p2p, uint32_t seq, Engine* engine) {
      return RingAllReduce(p2p, seq, buffer, op, engine->scratch(), Config(engine));
    });
  }

  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      const ReduceScatterOptions& options) override {
    if (absl::Status s = Check(input, rank(), "reduce_scatter"); !s.ok()) return Failed(s);
    if (absl::Status s = Check(output, rank(), "reduce_scatter"); !s.ok()) return Failed(s);
    return Collective([input, output, op = options.op](P2p& p2p, uint32_t seq, Engine* engine) {
      return RingReduceScatter(p2p, seq, input, output, op, engine->scratch(), Config(engine));
    });
  }

  std::unique_ptr<Work> AllGather(const Buffer& input, const Buffer& output,
                                  const AllGatherOptions&) override {
    if (absl::Status s = Check(input, rank(), "all_gather"); !s.ok()) return Failed(s);
    if (absl::Status s = Check(output, rank(), "all_gather"); !s.ok()) return Failed(s);
    return Collective([input, output](P2p& p2p, uint32_t seq, Engine* engine) {
      return RingAllGather(p2p, seq, input, output, Config(engine));
    });
  }

  std::unique_ptr<Work> Broadcast(const Buffer& buffer, const BroadcastOptions& options) override {
    if (absl::Status s = Check(buffer, rank(), "broadcast"); !s.ok()) return Failed(s);
    return Collective([buffer, root = options.root](P2p& p2p, uint32_t seq, Engine* engine) {
      return ChainBroadcast(p2p, seq, buffer, root, Config(engine));
    });
  }

  std::unique_ptr<Work> Barrier(const BarrierOptions&) override {
    return Collective([](P2p& p2p, uint32_t seq, Engine*) {
      return DisseminationBarrier(p2p, seq);
    });
  }

 private:
  static RingConfig Config(Engine* engine) { return {engine->options().chunk_bytes}; }

  absl::Status Check(const Buffer& buffer, int peer, const char* what) const {
    if (buffer.device != DeviceKind::kCpu) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ucx: ", what, " needs host memory; CUDA buffers go through the NCCL backend"));
    }
    if (buffer.data == nullptr && buffer.count > 0) {
      return absl::InvalidArgumentError(absl::StrCat("ucx: ", what, " of ", buffer.count,
                                                     " elements from a null pointer"));
    }
    if (peer < 0 || peer >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("ucx: ", what, " with rank ", peer,
                                                     ", outside the group of ", size()));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<Work> Collective(std::function<absl::Status(P2p&, uint32_t, Engine*)> body) {
    auto work = std::make_shared<WorkState>();
    Engine* engine = engine_.get();
    const uint32_t seq = next_seq_++;
    engine->SubmitCollective(
        [engine, seq, body = std::move(body)] {
          RingTransport transport(engine);
          return body(transport, seq, engine);
        },
        work);
    return std::make_unique<UcxWork>(work);
  }

  std::unique_ptr<Engine> engine_;
  uint32_t next_seq_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(
    Store* store, const std::string& group, int rank, int size,
    std::chrono::milliseconds setup_timeout, const UcxOptions& ucx) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("ucx: GroupOptions.store is null; rendezvous needs one");
  }
  if (size < 1 || size > kMaxRanks || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: rank ", rank, " of size ", size,
                                                   " is invalid (size 1..", kMaxRanks,
                                                   ", 0 <= rank < size)"));
  }
  auto engine = std::make_unique<Engine>(group, rank, size, ucx);
  if (absl::Status s = engine->Init(store, setup_timeout); !s.ok()) return s;
  return std::unique_ptr<Communicator>(new UcxCommunicator(std::move(engine)));
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(const GroupOptions& options,
                                                                  const UcxOptions& ucx) {
  return MakeUcxCommunicator(options.store, options.group, options.rank, options.size,
                             options.setup_timeout, ucx);
}

}  // namespace comm
}  // namespace rannc
