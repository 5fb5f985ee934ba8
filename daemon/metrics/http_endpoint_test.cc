#include "daemon/metrics/http_endpoint.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>

#include <catch2/catch.hpp>

#include "daemon/metrics/http_testing.h"

namespace rannc {
namespace metrics {
namespace {

using Catch::Contains;
using Catch::StartsWith;

TEST_CASE("HttpEndpoint: answers GET and HEAD of its path, refuses the rest", "[metrics]") {
  std::atomic<int> calls{0};
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> e = HttpEndpoint::Start(
      "127.0.0.1:0", "/metrics", "text/plain; version=0.0.4", [&] {
        ++calls;
        return std::string("a 1\n");
      });
  REQUIRE(e.ok());
  const int port = (*e)->port();
  REQUIRE(port > 0);
  std::string ok = HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK_THAT(ok, StartsWith("HTTP/1.1 200 OK\r\n"));
  CHECK_THAT(ok, Contains("Content-Type: text/plain; version=0.0.4\r\n"));
  CHECK_THAT(ok, Contains("Content-Length: 4\r\n"));
  CHECK_THAT(ok, Contains("\r\n\r\na 1\n"));
  CHECK_THAT(HttpExchange(port, "GET /metrics?x=1 HTTP/1.0\n\n"), Contains("\r\n\r\na 1\n"));
  std::string head = HttpExchange(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  CHECK_THAT(head, StartsWith("HTTP/1.1 200 OK"));
  CHECK(head.substr(head.find("\r\n\r\n")) == "\r\n\r\n");
  CHECK_THAT(HttpExchange(port, "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 Not Found"));
  CHECK_THAT(HttpExchange(port, "POST /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 405"));
  CHECK_THAT(HttpExchange(port, "garbage\r\n\r\n"), StartsWith("HTTP/1.1 400"));
  CHECK_THAT(HttpExchange(port, "GET /" + std::string(10000, 'a')), StartsWith("HTTP/1.1 400"));
  CHECK(calls == 3);
}

TEST_CASE("HttpEndpoint: a client that stalls holds the page back only until the timeout",
          "[metrics]") {
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> e = HttpEndpoint::Start(
      "127.0.0.1:0", "/metrics", "text/plain", [] { return std::string("x\n"); },
      std::chrono::milliseconds(300));
  REQUIRE(e.ok());
  const int stalled = HttpConnect((*e)->port());  // sends nothing
  const auto start = std::chrono::steady_clock::now();
  CHECK_THAT(HttpExchange((*e)->port(), "GET /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 200"));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(waited < 5.0);
  // The stalled connection was dropped without an answer.
  char c;
  CHECK(read(stalled, &c, 1) == 0);
  close(stalled);
}

TEST_CASE("HttpEndpoint: addresses that cannot be served", "[metrics]") {
  auto body = [] { return std::string(); };
  CHECK(HttpEndpoint::Start("9400", "/m", "t", body).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(HttpEndpoint::Start("no.such.host.invalid:9400", "/m", "t", body).status().code() ==
        absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> first =
      HttpEndpoint::Start("127.0.0.1:0", "/m", "t", body);
  REQUIRE(first.ok());
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> busy = HttpEndpoint::Start(
      "127.0.0.1:" + std::to_string((*first)->port()), "/m", "t", body);
  CHECK(busy.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(busy.status().message()), Contains("Address already in use"));
  // IPv6 loopback, where the machine has it.
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> v6 = HttpEndpoint::Start("[::1]:0", "/m", "t", body);
  if (v6.ok()) CHECK((*v6)->port() > 0);
}

}  // namespace
}  // namespace metrics
}  // namespace rannc
