// Files clients send the daemon (TrainingService.UploadFile) for the jobs they submit: the model
// and data of a detached job submitted to a daemon on another host, which cannot read the
// client's file system. Each is kept under `dir` as "<unique>-<name>" until the job naming it
// ends (Release).
//
//   Uploads uploads(JoinPath(state_dir, "uploads"));
//   absl::StatusOr<std::unique_ptr<Uploads::Writer>> w = uploads.Begin("model.pt");
//   (*w)->Write(chunk.data(), chunk.size());      // as the chunks come
//   absl::StatusOr<std::string> path = (*w)->Commit(expected_size);
//   ...
//   uploads.Release(path);                        // the job ended
//   uploads.RemoveUnused(paths_jobs_name, ttl);   // now and then: what no submission took
//
// Thread-safe; a Writer is used by one thread.
#ifndef RANNC_DAEMON_SERVER_UPLOADS_H_
#define RANNC_DAEMON_SERVER_UPLOADS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rannc {

class Uploads {
 public:
  // `dir` is made at the first upload; a `temporary` one (a daemon without a state dir) is
  // removed with the Uploads.
  explicit Uploads(std::string dir, bool temporary = false);
  ~Uploads();
  Uploads(const Uploads&) = delete;
  Uploads& operator=(const Uploads&) = delete;
  const std::string& dir() const { return dir_; }

  class Writer {
   public:
    ~Writer();  // an upload not committed is removed
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    // An error names the file (a full disk: RESOURCE_EXHAUSTED).
    absl::Status Write(const char* data, size_t size);
    // fsyncs the file and gives it its name; DATA_LOSS when `expected` bytes (0: any) did not
    // all come. Returns its path.
    absl::StatusOr<std::string> Commit(uint64_t expected);

   private:
    friend class Uploads;
    Writer(int fd, std::string tmp, std::string path) : fd_(fd), tmp_(std::move(tmp)),
                                                        path_(std::move(path)) {}
    int fd_;
    std::string tmp_, path_;
    uint64_t written_ = 0;
    bool committed_ = false;
  };
  // A new upload of `name`: a file name (no directory part), kept as its last part.
  // INVALID_ARGUMENT for an empty name, "." or "..".
  absl::StatusOr<std::unique_ptr<Writer>> Begin(const std::string& name);

  // Whether `path` is an upload (a file directly under dir()).
  bool Holds(const std::string& path) const;
  // Removes `path` when it is an upload; leaves anything else alone.
  void Release(const std::string& path) const;
  // Removes the uploads (and uploads never committed) not in `in_use` whose file has not been
  // written for `unused_for`: files sent for a submission that never came (a client
  // interrupted between its uploads and its submission, or refused after them). Returns how
  // many went.
  int RemoveUnused(const std::set<std::string>& in_use, std::chrono::milliseconds unused_for);

 private:
  const std::string dir_;
  const bool temporary_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_UPLOADS_H_
