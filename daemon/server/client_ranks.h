// The client processes ("client ranks", RaNNC's multi-process model) of one job meet at each
// collective call: the n-th Forward of every rank meets the n-th Forward of the others, and so on
// per operation. The last rank to arrive runs the operation once on every rank's payload; its
// result (or error) is every rank's. A rank that does not arrive within the timeout fails the
// round for all with DEADLINE_EXCEEDED naming the missing ranks.
//
//   ClientRendezvous ranks(/*world=*/2, std::chrono::seconds(300));
//   absl::StatusOr<Out> out = ranks.Meet<In, Out>("forward", rank, std::move(in),
//       [&](std::vector<In>& all) -> absl::StatusOr<Out> { ... run once ... });
//
// Thread-safe: each rank calls from its own RPC thread.
#ifndef RANNC_DAEMON_SERVER_CLIENT_RANKS_H_
#define RANNC_DAEMON_SERVER_CLIENT_RANKS_H_

#include <any>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rannc {

class ClientRendezvous {
 public:
  ClientRendezvous(int world, std::chrono::milliseconds timeout)
      : world_(world), timeout_(timeout) {}

  int world() const { return world_; }
  // Rounds some rank still waits in or has not taken its answer from (tests).
  size_t rounds_held() {
    std::lock_guard<std::mutex> lock(mu_);
    return rounds_.size();
  }

  template <typename In, typename Out>
  absl::StatusOr<Out> Meet(const std::string& op, int rank, In payload,
                           const std::function<absl::StatusOr<Out>(std::vector<In>&)>& run) {
    if (rank < 0 || rank >= world_) {
      return absl::InvalidArgumentError(absl::StrCat("client rank ", rank, " is outside the job's ",
                                                     world_, " client ranks"));
    }
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<int64_t>& next = next_[op];
    next.resize(world_, 0);
    const std::pair<std::string, int64_t> key{op, next[rank]++};
    Round& round = rounds_[key];
    if (round.payloads.empty()) round.payloads.resize(world_);
    round.payloads[rank] = std::move(payload);
    round.arrived.resize(world_, false);
    round.arrived[rank] = true;
    ++round.count;
    if (round.count == world_ && !round.done) {
      std::vector<In> all;
      for (std::any& p : round.payloads) all.push_back(std::move(std::any_cast<In&>(p)));
      lock.unlock();
      absl::StatusOr<Out> result = run(all);
      lock.lock();
      round.done = true;
      round.status = result.status();
      if (result.ok()) round.result = std::move(*result);
      changed_.notify_all();
    } else {
      const bool met = changed_.wait_for(lock, timeout_, [&] { return round.done; });
      if (!met) {
        std::vector<int> missing;
        for (int r = 0; r < world_; ++r) {
          if (!round.arrived[r]) missing.push_back(r);
        }
        round.done = true;
        round.status = absl::DeadlineExceededError(absl::StrCat(
            op, ": client rank(s) ", absl::StrJoin(missing, ", "), " of ", world_,
            " did not call it within ", timeout_.count(), " ms; every client rank of a job must "
            "make the same calls"));
        changed_.notify_all();
      }
    }
    absl::Status status = round.status;
    Out out{};
    if (status.ok()) out = std::any_cast<Out>(round.result);
    // Gone once every rank that came has its answer: all of them, or, for a round that timed
    // out, those that arrived (a rank arriving later starts a round of its own, and times out
    // there: the job's ranks are out of step either way).
    if (++round.taken == (round.count == world_ ? world_ : round.count)) rounds_.erase(key);
    if (!status.ok()) return status;
    return out;
  }

 private:
  struct Round {
    std::vector<std::any> payloads;
    std::vector<bool> arrived;
    int count = 0, taken = 0;
    bool done = false;
    absl::Status status;
    std::any result;
  };

  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<int64_t>> next_;
  std::map<std::pair<std::string, int64_t>, Round> rounds_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_CLIENT_RANKS_H_
