// Exactly-once calls (training.proto's CallId): each client's last call and its answer, so that
// a retried call (the same client id and sequence number, after its response was lost) is
// answered from the record instead of being applied twice.
//
//   CallLedger::Ticket t = ledger.Begin(client_id, seq);   // waits while that call still runs
//   if (t.kind == CallLedger::kReplay) return {t.status, t.response};
//   if (t.kind == CallLedger::kStale) return FAILED_PRECONDITION;
//   ... run the call ...
//   ledger.Finish(client_id, seq, status, serialized_response);
//
// Bounded: the clients heard from least recently are forgotten beyond `max_clients`. gRPC-free;
// thread-safe.
#ifndef RANNC_DAEMON_SERVER_CALL_LEDGER_H_
#define RANNC_DAEMON_SERVER_CALL_LEDGER_H_

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"

namespace rannc {

class CallLedger {
 public:
  explicit CallLedger(size_t max_clients = 4096) : max_clients_(max_clients) {}

  enum Kind { kRun, kReplay, kStale };
  struct Ticket {
    Kind kind = kRun;
    absl::Status status;   // kReplay: the first attempt's answer
    std::string response;  // kReplay: its serialized response
    uint64_t last = 0;     // kStale: the client's last sequence number
  };
  // Whether call `seq` of `client` runs (a new call), is answered from the record (the last
  // call again; waits until its first attempt finishes), or is older than the last (kStale).
  Ticket Begin(const std::string& client, uint64_t seq);
  // Records the answer of the call Begin let run.
  void Finish(const std::string& client, uint64_t seq, const absl::Status& status,
              std::string response);

  size_t clients() const;

 private:
  struct Entry {
    uint64_t seq = 0;
    bool running = false;
    absl::Status status;
    std::string response;
    std::list<std::string>::iterator recency;
  };
  void Touch(Entry& entry, const std::string& client);  // needs mu_

  const size_t max_clients_;
  mutable std::mutex mu_;
  std::condition_variable finished_;
  std::map<std::string, Entry> entries_;
  std::list<std::string> recency_;  // most recent first
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_CALL_LEDGER_H_
