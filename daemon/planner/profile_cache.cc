#include "daemon/planner/profile_cache.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/common/files.h"

namespace rannc {
namespace planner {
namespace {

constexpr absl::string_view kHeader = "rannc-profile-cache v1";
constexpr int kFields = 10;
constexpr const char* kFieldNames[kFields] = {
    "graph_hash", "micro_batch", "device_type", "options",     "fwd_ms",
    "bwd_ms",     "act_bytes",   "peak_bytes",  "param_bytes", "output_bytes",
};

absl::Status ErrnoError(int error, absl::string_view what, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat("profile cache ", path, ": cannot ", what, ": ",
                                   std::strerror(error)));
}

void AppendEscaped(absl::string_view s, std::string* out) {
  for (char c : s) {
    switch (c) {
      case '\\': out->append("\\\\"); break;
      case '\t': out->append("\\t"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      default: out->push_back(c);
    }
  }
}

bool Unescape(absl::string_view s, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out->push_back(s[i]);
      continue;
    }
    if (++i == s.size()) return false;
    switch (s[i]) {
      case '\\': out->push_back('\\'); break;
      case 't': out->push_back('\t'); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      default: return false;
    }
  }
  return true;
}

std::string FormatLine(const ProfileKey& key, const ProfileRecord& r) {
  std::string line;
  AppendEscaped(key.graph_hash, &line);
  absl::StrAppend(&line, "\t", key.micro_batch, "\t");
  AppendEscaped(key.device_type, &line);
  line.push_back('\t');
  AppendEscaped(key.options, &line);
  absl::StrAppendFormat(&line, "\t%.17g\t%.17g\t%d\t%d\t%d\t%d\n", r.fwd_ms, r.bwd_ms,
                        r.act_bytes, r.peak_bytes, r.param_bytes, r.output_bytes);
  return line;
}

// Parses one record line (without its newline); on failure returns what is wrong with it.
std::optional<std::string> ParseLine(absl::string_view line, ProfileKey* key,
                                     ProfileRecord* r) {
  std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
  if (f.size() != kFields) {
    return absl::StrCat("expected ", kFields, " tab-separated fields, found ", f.size());
  }
  auto bad = [&](int i, absl::string_view why) {
    return absl::StrCat("field ", i + 1, " (", kFieldNames[i], ") is \"", f[i], "\", ", why);
  };
  std::string* strings[] = {&key->graph_hash, nullptr, &key->device_type, &key->options};
  for (int i : {0, 2, 3}) {
    if (!Unescape(f[i], strings[i])) return bad(i, "which has a bad backslash escape");
  }
  if (!absl::SimpleAtoi(f[1], &key->micro_batch)) return bad(1, "not an integer");
  double* doubles[] = {&r->fwd_ms, &r->bwd_ms};
  for (int i : {4, 5}) {
    if (!absl::SimpleAtod(f[i], doubles[i - 4])) return bad(i, "not a number");
  }
  uint64_t* sizes[] = {&r->act_bytes, &r->peak_bytes, &r->param_bytes, &r->output_bytes};
  for (int i : {6, 7, 8, 9}) {
    if (!absl::SimpleAtoi(f[i], sizes[i - 6])) return bad(i, "not a byte count");
  }
  return std::nullopt;
}

const char* NonEmptyEnv(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' ? value : nullptr;
}

}  // namespace

ProfileCache::ProfileCache(std::string path) : path_(std::move(path)) {}

absl::Status ProfileCache::ReadFile(Map* into) const {
  std::FILE* file = std::fopen(path_.c_str(), "r");
  if (file == nullptr) {
    if (errno == ENOENT) return absl::OkStatus();  // never flushed yet
    return ErrnoError(errno, "open it for reading", path_);
  }
  Map records;
  absl::Status status;
  char* buffer = nullptr;
  size_t capacity = 0;
  int line_number = 0;
  for (;;) {
    errno = 0;
    const ssize_t n = getline(&buffer, &capacity, file);
    if (n < 0) {
      if (errno != 0) status = ErrnoError(errno, "read it", path_);
      break;
    }
    ++line_number;
    absl::string_view line(buffer, n);
    if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
    if (line_number == 1) {
      if (line != kHeader) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "profile cache ", path_, ": line 1 is \"", line.substr(0, 80), "\", expected \"",
            kHeader, "\" (written by another rannc version, or not a profile cache); it will be "
            "replaced on the next flush"));
        break;
      }
      continue;
    }
    if (line.empty()) continue;  // tolerated: hand edits leave them
    ProfileKey key;
    ProfileRecord record;
    if (std::optional<std::string> error = ParseLine(line, &key, &record)) {
      status = absl::DataLossError(absl::StrCat("profile cache ", path_, ": line ", line_number,
                                                ": ", *error, "; the file is corrupt and will "
                                                "be replaced on the next flush"));
      break;
    }
    records[std::move(key)] = record;
  }
  std::free(buffer);
  std::fclose(file);
  if (status.ok() && line_number == 0) {
    status = absl::DataLossError(absl::StrCat("profile cache ", path_, ": the file is empty, "
                                              "expected the header \"", kHeader, "\""));
  }
  if (!status.ok()) return status;
  into->merge(records);  // keeps what `into` already has
  return absl::OkStatus();
}

absl::Status ProfileCache::Load() {
  if (path_.empty()) return absl::OkStatus();
  Map from_file;
  if (absl::Status s = ReadFile(&from_file); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  records_.merge(from_file);
  return absl::OkStatus();
}

std::optional<ProfileRecord> ProfileCache::Find(const ProfileKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = records_.find(key);
  if (it == records_.end()) return std::nullopt;
  return it->second;
}

void ProfileCache::Insert(const ProfileKey& key, const ProfileRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  records_[key] = record;
  dirty_ = true;
}

size_t ProfileCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

absl::Status ProfileCache::Flush() {
  if (path_.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> flush_lock(flush_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dirty_) return absl::OkStatus();
  }
  // Another process's records, if the file still loads; a file that does not is overwritten,
  // since Load already reported it and nothing in it can be used.
  Map from_file;
  ReadFile(&from_file).IgnoreError();

  std::string text = absl::StrCat(kHeader, "\n");
  {
    std::lock_guard<std::mutex> lock(mu_);
    records_.merge(from_file);
    for (const auto& [key, record] : records_) text += FormatLine(key, record);
    dirty_ = false;
  }
  auto failed = [&](absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    dirty_ = true;  // what we could not write is still only in memory
    return status;
  };

  const std::string parent = ParentPath(path_);
  if (!parent.empty()) {
    absl::Status made = MakeDirs(parent);
    if (!made.ok()) return failed(absl::Status(made.code(), absl::StrCat(
        "profile cache ", path_, ": ", made.message())));
  }
  const std::string tmp = absl::StrCat(path_, ".tmp.", getpid());
  std::FILE* file = std::fopen(tmp.c_str(), "w");
  if (file == nullptr) return failed(ErrnoError(errno, "create " + tmp, path_));
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size() &&
                       std::fflush(file) == 0 && fsync(fileno(file)) == 0;
  const int write_errno = errno;
  const int close_result = std::fclose(file);
  const int close_errno = errno;
  if (!written || close_result != 0) {
    std::remove(tmp.c_str());
    return failed(ErrnoError(!written ? write_errno : close_errno, "write " + tmp, path_));
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(tmp.c_str());
    return failed(ErrnoError(rename_errno, "rename " + tmp + " over it", path_));
  }
  return absl::OkStatus();
}

std::string DefaultProfileCachePath() {
  if (const char* path = NonEmptyEnv("RANNC_PROFILE_CACHE")) return path;
  if (const char* xdg = NonEmptyEnv("XDG_CACHE_HOME")) {
    return JoinPath(JoinPath(xdg, "rannc"), "profiles.tsv");
  }
  if (const char* home = NonEmptyEnv("HOME")) {
    return JoinPath(JoinPath(JoinPath(home, ".cache"), "rannc"), "profiles.tsv");
  }
  return "";
}

}  // namespace planner
}  // namespace rannc
