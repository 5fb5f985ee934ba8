#include "daemon/server/call_ledger.h"

namespace rannc {

void CallLedger::Touch(Entry& entry, const std::string& client) {
  recency_.erase(entry.recency);
  recency_.push_front(client);
  entry.recency = recency_.begin();
}

CallLedger::Ticket CallLedger::Begin(const std::string& client, uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = entries_.find(client);
  if (it == entries_.end()) {
    while (entries_.size() >= max_clients_ && !recency_.empty()) {
      auto oldest = entries_.find(recency_.back());
      if (oldest != entries_.end() && oldest->second.running) break;  // never one in flight
      if (oldest != entries_.end()) entries_.erase(oldest);
      recency_.pop_back();
    }
    recency_.push_front(client);
    Entry entry;
    entry.seq = seq;
    entry.running = true;
    entry.recency = recency_.begin();
    entries_.emplace(client, std::move(entry));
    return Ticket{};
  }
  Touch(it->second, client);
  // The client's previous call first (a client that gave up waiting on it may already send the
  // next one).
  finished_.wait(lock, [&] {
    auto found = entries_.find(client);
    return found == entries_.end() || !found->second.running;
  });
  it = entries_.find(client);
  if (it == entries_.end()) {  // forgotten meanwhile: a new client again
    lock.unlock();
    return Begin(client, seq);
  }
  Entry& entry = it->second;
  Ticket t;
  if (seq > entry.seq) {
    entry.seq = seq;
    entry.running = true;
    entry.response.clear();
    return t;  // kRun
  }
  if (seq == entry.seq) {
    t.kind = kReplay;  // a retry: the first attempt's answer
    t.status = entry.status;
    t.response = entry.response;
    return t;
  }
  t.kind = kStale;
  t.last = entry.seq;
  return t;
}

void CallLedger::Finish(const std::string& client, uint64_t seq, const absl::Status& status,
                        std::string response) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(client);
    if (it == entries_.end() || it->second.seq != seq) return;
    it->second.running = false;
    it->second.status = status;
    it->second.response = std::move(response);
  }
  finished_.notify_all();
}

size_t CallLedger::clients() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace rannc
