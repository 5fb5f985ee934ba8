#include "daemon/metrics/http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rannc {
namespace metrics {
namespace {

constexpr size_t kMaxRequest = 8192;

using Clock = std::chrono::steady_clock;

int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Writes all of `data` before `deadline`; false when the peer went or stalled.
bool WriteAll(int fd, const std::string& data, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < data.size()) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, MillisLeft(deadline)) <= 0) return false;
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

std::string Response(int code, const char* reason, const std::string& type,
                     const std::string& body, bool head) {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                      head ? "" : body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const std::string& listen, std::string path, std::string content_type,
    std::function<std::string()> body, std::chrono::milliseconds timeout) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(listen, " is not HOST:PORT (e.g. 127.0.0.1:9400)"));
  }
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(listen, ": ", gai_strerror(rc), " (give HOST:PORT, e.g. 127.0.0.1:9400)"));
  }
  std::unique_ptr<HttpEndpoint> e(new HttpEndpoint());
  std::string why;
  for (addrinfo* a = found; a != nullptr && e->listener_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      e->listener_ = fd;
    } else {
      why = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (e->listener_ < 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, ": ", why));
  }
  sockaddr_storage bound{};
  socklen_t size = sizeof(bound);
  getsockname(e->listener_, reinterpret_cast<sockaddr*>(&bound), &size);
  e->port_ = ntohs(bound.ss_family == AF_INET6
                       ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (pipe2(e->wake_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  e->path_ = std::move(path);
  e->content_type_ = std::move(content_type);
  e->body_ = std::move(body);
  e->timeout_ = timeout;
  e->thread_ = std::thread([raw = e.get()] { raw->Serve(); });
  return e;
}

HttpEndpoint::~HttpEndpoint() {
  if (thread_.joinable()) {
    const char stop = 's';
    (void)!write(wake_[1], &stop, 1);
    thread_.join();
  }
  for (int fd : {listener_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void HttpEndpoint::Serve() {
  while (true) {
    pollfd p[2] = {{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    Answer(fd);
    close(fd);
  }
}

void HttpEndpoint::Answer(int fd) {
  const Clock::time_point deadline = Clock::now() + timeout_;
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() > kMaxRequest) {
      WriteAll(fd, Response(400, "Bad Request", "text/plain", "request too large\n", false),
               deadline);
      return;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, MillisLeft(deadline)) <= 0) return;  // stalled: dropped
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
  }
  // "METHOD TARGET HTTP/x.y"
  const size_t line_end = request.find_first_of("\r\n");
  const std::string line = request.substr(0, line_end);
  const size_t s1 = line.find(' ');
  const size_t s2 = s1 == std::string::npos ? s1 : line.find(' ', s1 + 1);
  if (s1 == std::string::npos || s2 == std::string::npos ||
      line.compare(s2 + 1, 5, "HTTP/") != 0) {
    WriteAll(fd, Response(400, "Bad Request", "text/plain", "malformed request\n", false),
             deadline);
    return;
  }
  const std::string method = line.substr(0, s1);
  std::string target = line.substr(s1 + 1, s2 - s1 - 1);
  target = target.substr(0, target.find('?'));
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    WriteAll(fd, Response(405, "Method Not Allowed", "text/plain", "GET only\n", false),
             deadline);
  } else if (target != path_) {
    WriteAll(fd, Response(404, "Not Found", "text/plain",
                          absl::StrCat("not here: ", path_, " is\n"), head),
             deadline);
  } else {
    WriteAll(fd, Response(200, "OK", content_type_, body_(), head), deadline);
  }
}

}  // namespace metrics
}  // namespace rannc
