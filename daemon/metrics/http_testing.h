// Test helpers: plain HTTP/1.x over a loopback socket, to talk to an HttpEndpoint (and the
// metrics server on it) as Prometheus does.
#ifndef RANNC_DAEMON_METRICS_HTTP_TESTING_H_
#define RANNC_DAEMON_METRICS_HTTP_TESTING_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include <catch2/catch.hpp>

namespace rannc {
namespace metrics {

// A connection to 127.0.0.1:port (the caller closes it).
inline int HttpConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

// Sends `request` and reads the whole answer, headers and body (the server closes the
// connection).
inline std::string HttpExchange(int port, const std::string& request) {
  const int fd = HttpConnect(port);
  REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  return response;
}

}  // namespace metrics
}  // namespace rannc

#endif  // RANNC_DAEMON_METRICS_HTTP_TESTING_H_
