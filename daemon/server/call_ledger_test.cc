#include "daemon/server/call_ledger.h"

#include <chrono>
#include <thread>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("a retried call is answered from the record, never run twice") {
  CallLedger ledger;
  REQUIRE(ledger.Begin("a", 1).kind == CallLedger::kRun);
  ledger.Finish("a", 1, absl::OkStatus(), "first");
  CallLedger::Ticket retry = ledger.Begin("a", 1);
  CHECK(retry.kind == CallLedger::kReplay);
  CHECK(retry.response == "first");
  CHECK(retry.status.ok());

  REQUIRE(ledger.Begin("a", 2).kind == CallLedger::kRun);
  ledger.Finish("a", 2, absl::InvalidArgumentError("bad"), "");
  CHECK(ledger.Begin("a", 2).status.code() == absl::StatusCode::kInvalidArgument);
  CallLedger::Ticket stale = ledger.Begin("a", 1);
  CHECK(stale.kind == CallLedger::kStale);
  CHECK(stale.last == 2);
  // Clients are apart.
  CHECK(ledger.Begin("b", 1).kind == CallLedger::kRun);
}

TEST_CASE("a retry that arrives while the first attempt runs waits for its answer") {
  CallLedger ledger;
  REQUIRE(ledger.Begin("a", 7).kind == CallLedger::kRun);
  CallLedger::Ticket retry;
  std::thread waiter([&] { retry = ledger.Begin("a", 7); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ledger.Finish("a", 7, absl::OkStatus(), "done");
  waiter.join();
  CHECK(retry.kind == CallLedger::kReplay);
  CHECK(retry.response == "done");
}

TEST_CASE("the ledger forgets the least recent clients beyond its bound") {
  CallLedger ledger(2);
  for (const char* c : {"a", "b", "c"}) {
    REQUIRE(ledger.Begin(c, 1).kind == CallLedger::kRun);
    ledger.Finish(c, 1, absl::OkStatus(), c);
  }
  CHECK(ledger.clients() == 2);
  CHECK(ledger.Begin("c", 1).kind == CallLedger::kReplay);
  CHECK(ledger.Begin("a", 1).kind == CallLedger::kRun);  // forgotten: a new client
}

}  // namespace
}  // namespace rannc
