// A minimal HTTP/1.x server for one read-only page: the metrics endpoint's /metrics. One thread
// accepts and answers connections one at a time (Prometheus scrapes a target serially); each
// connection gets `timeout` to send its request line and headers (8 KiB at most) and to take the
// answer, then is closed, so a client that stalls holds the page back for at most that long.
// GET or HEAD of `path` (a query string is ignored) answers 200 with body(); another path 404,
// another method 405, a malformed or oversized request 400.
//
//   absl::StatusOr<std::unique_ptr<HttpEndpoint>> e = HttpEndpoint::Start(
//       "127.0.0.1:9400", "/metrics", "text/plain; version=0.0.4", [] { return Text(); });
//
// Thread-safe; the destructor stops the thread (a connection in progress ends first).
#ifndef RANNC_DAEMON_METRICS_HTTP_ENDPOINT_H_
#define RANNC_DAEMON_METRICS_HTTP_ENDPOINT_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace rannc {
namespace metrics {

class HttpEndpoint {
 public:
  // `listen`: HOST:PORT (an IPv4 address, a name resolving to one, or [IPv6]); port 0 picks a
  // free one. INVALID_ARGUMENT for an address that does not parse or resolve, UNAVAILABLE when
  // it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(
      const std::string& listen, std::string path, std::string content_type,
      std::function<std::string()> body,
      std::chrono::milliseconds timeout = std::chrono::seconds(5));
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  HttpEndpoint() = default;
  void Serve();
  void Answer(int fd);

  int listener_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: the destructor writes to stop Serve's poll
  int port_ = 0;
  std::string path_;
  std::string content_type_;
  std::function<std::string()> body_;
  std::chrono::milliseconds timeout_{5000};
  std::thread thread_;
};

}  // namespace metrics
}  // namespace rannc

#endif  // RANNC_DAEMON_METRICS_HTTP_ENDPOINT_H_
