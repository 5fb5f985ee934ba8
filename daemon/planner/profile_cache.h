// A persistent cache of profiling results, so that planning a model the daemon has profiled
// before takes seconds instead of a profiling run.
//
// Defines ProfileKey (what was profiled: graph, micro-batch size, device type, options),
// ProfileRecord (what profiling measured) and ProfileCache, an in-memory map backed by a text
// file. Profiling results depend on the machine, so the file belongs to one host
// (DefaultProfileCachePath) and is not meant to be copied between machines.
//
// Usage:
//   ProfileCache cache(DefaultProfileCachePath());
//   if (absl::Status s = cache.Load(); !s.ok()) {
//     SPDLOG_WARN("{}; starting with an empty profile cache", s.message());
//   }
//   ProfileKey key{graph_hash, /*micro_batch=*/8, "cpu", "recompute=0"};
//   if (std::optional<ProfileRecord> hit = cache.Find(key)) { ... use *hit ... }
//   else { cache.Insert(key, Profile(...)); }
//   if (absl::Status s = cache.Flush(); !s.ok()) SPDLOG_WARN("{}", s.message());
//
// File format (v1): the first line is "rannc-profile-cache v1"; each further line is one record
// of 10 tab-separated fields: graph_hash, micro_batch, device_type, options, fwd_ms, bwd_ms,
// act_bytes, peak_bytes, param_bytes, output_bytes. Doubles are printed with "%.17g", so they
// read back bit for bit. In the three string fields a backslash, tab, newline and carriage return
// are written as \\, \t, \n and \r, so keys may hold any bytes.
//
// Thread-safety: all methods of ProfileCache are thread-safe (one internal mutex; Flush does its
// file I/O outside it, so lookups never wait for the disk). Find returns a copy. Several
// processes may share one file: Flush writes a new file and renames it over the old one, so a
// reader sees either the old or the new file, never half of one; and Flush first merges in what
// the file holds now, so records flushed by another process survive unless two processes flush
// at the same moment (then the last rename wins).
#ifndef RANNC_DAEMON_PLANNER_PROFILE_CACHE_H_
#define RANNC_DAEMON_PLANNER_PROFILE_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "absl/status/status.h"

namespace rannc {
namespace planner {

// What was profiled. All four fields take part in lookups.
struct ProfileKey {
  std::string graph_hash;   // content hash of the profiled (sub)graph; any bytes
  int64_t micro_batch = 0;  // per-device micro-batch size it ran at
  std::string device_type;  // e.g. "cpu", "cuda:H200"
  std::string options;      // anything else that changes the numbers, e.g. "recompute=0"

  bool operator<(const ProfileKey& o) const {
    return std::tie(graph_hash, micro_batch, device_type, options) <
           std::tie(o.graph_hash, o.micro_batch, o.device_type, o.options);
  }
  bool operator==(const ProfileKey& o) const {
    return std::tie(graph_hash, micro_batch, device_type, options) ==
           std::tie(o.graph_hash, o.micro_batch, o.device_type, o.options);
  }
};

// What profiling measured for one key (the fields of planner::BlockProfile plus sizes).
struct ProfileRecord {
  double fwd_ms = 0;          // forward time, milliseconds
  double bwd_ms = 0;          // backward time, milliseconds
  uint64_t act_bytes = 0;     // memory kept from forward until backward
  uint64_t peak_bytes = 0;    // transient working memory above act_bytes during fwd or bwd
  uint64_t param_bytes = 0;   // parameters and buffers the graph reads
  uint64_t output_bytes = 0;  // the graph's outputs (what a stage boundary after it sends)

  bool operator==(const ProfileRecord& o) const {
    return fwd_ms == o.fwd_ms && bwd_ms == o.bwd_ms && act_bytes == o.act_bytes &&
           peak_bytes == o.peak_bytes && param_bytes == o.param_bytes &&
           output_bytes == o.output_bytes;
  }
};

class ProfileCache {
 public:
  // `path` is the backing file; empty means in memory only (Load and Flush do nothing).
  explicit ProfileCache(std::string path);

  ProfileCache(const ProfileCache&) = delete;
  ProfileCache& operator=(const ProfileCache&) = delete;

  // Adds the file's records to the cache; records inserted before (newer) win. A missing file is
  // an empty cache. A wrong header (FailedPrecondition), a corrupt line (DataLoss, naming the
  // file and line) or an unreadable file leaves the cache unchanged; the caller is expected to
  // log the status and carry on without the file's records.
  absl::Status Load();

  std::optional<ProfileRecord> Find(const ProfileKey& key) const;

  // Adds or replaces the record of `key`.
  void Insert(const ProfileKey& key, const ProfileRecord& record);

  // Writes every record to the file atomically (path + ".tmp.<pid>", then rename), creating its
  // directory first. Records another process flushed in the meantime are merged in (and become
  // visible to Find); a file that no longer loads is replaced. Does nothing when nothing changed
  // since the last Load or Flush.
  absl::Status Flush();

  size_t size() const;
  const std::string& path() const { return path_; }

 private:
  using Map = std::map<ProfileKey, ProfileRecord>;

  // Records already in `into` are kept.
  absl::Status ReadFile(Map* into) const;

  const std::string path_;
  std::mutex flush_mu_;  // one Flush at a time: they share the temporary file's name
  mutable std::mutex mu_;
  Map records_;         // guarded by mu_
  bool dirty_ = false;  // guarded by mu_; true when records_ has what the file lacks
};

// Where the daemon keeps its profile cache: $RANNC_PROFILE_CACHE if set, else
// $XDG_CACHE_HOME/rannc/profiles.tsv, else $HOME/.cache/rannc/profiles.tsv (empty variables
// count as unset). Empty when none is set: then the cache lives in memory only.
std::string DefaultProfileCachePath();

}  // namespace planner
}  // namespace rannc

#endif  // RANNC_DAEMON_PLANNER_PROFILE_CACHE_H_
