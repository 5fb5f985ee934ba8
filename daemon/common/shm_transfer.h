// Same-host tensor transfer through shared-memory files, which gRPC cannot match: a 64 MiB
// tensor as protobuf bytes crosses loopback at ~0.1-0.3 GB/s, a copy through /dev/shm at
// several GB/s. Clients name a region of a file they created ("rannc-*" directly under the
// offered directory); the daemon copies out of (requests) or into (replies) that region within
// the RPC, so it never holds a file open across calls.
//
// Only plain files named rannc-* directly in the offered directory are touched, so a client
// cannot make the daemon read or write elsewhere. Stateless apart from the directory; safe from
// any thread.
#ifndef RANNC_DAEMON_COMMON_SHM_TRANSFER_H_
#define RANNC_DAEMON_COMMON_SHM_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

class ShmDirectory {
 public:
  // `dir` "" disables the transfer: every ShmRef is then refused.
  explicit ShmDirectory(std::string dir);

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }

  // A checked region to read from: `ref` names a regular rannc-* file in the directory that
  // holds [offset, offset + size). Opening it first lets a caller refuse a bad reference before
  // it allocates the destination; a FIFO or device is refused, never waited on.
  class Reader {
   public:
    ~Reader();
    Reader(Reader&&) noexcept;
    Reader& operator=(Reader&&) = delete;
    // Copies the region's bytes to `dst` (room for the region's size).
    absl::Status Read(void* dst);

   private:
    friend class ShmDirectory;
    Reader(int fd, std::string path, uint64_t offset, size_t size);
    int fd_;
    std::string path_;
    uint64_t offset_;
    size_t size_;
  };
  // `ref`'s region, whose length must be `size`.
  absl::StatusOr<Reader> OpenRegion(const v1::ShmRef& ref, size_t size) const;

  // OpenRegion(ref, size), then its bytes to `dst`.
  absl::Status Read(const v1::ShmRef& ref, void* dst, size_t size) const;

  // An open reply region; writes land one after another, each 64-byte aligned.
  class Writer {
   public:
    ~Writer();
    Writer(Writer&&) noexcept;
    Writer& operator=(Writer&&) = delete;
    // Writes `size` bytes and fills `placed` with where they went; false (and nothing
    // written) when the region has no room left, so the caller sends them inline instead.
    bool Write(const void* src, size_t size, v1::ShmRef* placed);

   private:
    friend class ShmDirectory;
    Writer(int fd, std::string path, uint64_t next, uint64_t end);
    int fd_;
    std::string path_;
    uint64_t next_;
    uint64_t end_;
  };
  absl::StatusOr<Writer> OpenReply(const v1::ShmRef& region) const;

 private:
  absl::StatusOr<std::string> Resolve(const std::string& path) const;
  // `path` opened with `flags` (never blocking), which must be a regular file holding
  // [offset, offset + length); the descriptor, or why not.
  static absl::StatusOr<int> OpenRegular(const std::string& path, int flags, uint64_t offset,
                                         uint64_t length, const char* what);
  std::string dir_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_SHM_TRANSFER_H_
