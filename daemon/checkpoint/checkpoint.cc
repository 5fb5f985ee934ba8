#include "daemon/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/checkpoint/crc32.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/files.h"
#include "daemon/common/tensor_codec.h"
#include "daemon/common/torch_archive.h"

namespace rannc {
namespace checkpoint {


namespace {

constexpr char kManifest[] = "manifest.json";
constexpr char kStepPrefix[] = "step-";

const char* KindPrefix(v1::CheckpointEntry::Kind kind) {
  switch (kind) {
    case v1::CheckpointEntry::PARAM: return "param";
    case v1::CheckpointEntry::BUFFER: return "buffer";
    case v1::CheckpointEntry::OPTIMIZER_STATE: return "optim";
    default: return "tensor";
  }
}

int64_t Numel(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A manifest comes from storage others may write: its shapes and slices are checked before the
// reader allocates or copies by them. The elements of `shape`, or an error when a dimension is
// negative or the product does not fit in int64.
absl::StatusOr<int64_t> CheckedNumel(const google::protobuf::RepeatedField<int64_t>& shape,
                                     const std::string& what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) {
      return absl::DataLossError(absl::StrCat(what, " has the impossible shape [",
                                              absl::StrJoin(shape, ", "), "]"));
    }
    n *= d;
  }
  return n;
}

// A tensor file's name in a manifest: a plain name in the checkpoint's directory.
absl::Status CheckFileName(const std::string& name, const std::string& dir) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos) {
    return absl::DataLossError(absl::StrCat("the manifest in ", dir, " names the file '", name,
                                            "', which is not a file name in that directory"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointManifest> ParseManifest(const std::string& path) {
  v1::CheckpointManifest manifest;
  absl::Status read = ReadJsonFile(path, &manifest);
  if (!read.ok()) return read;
  if (manifest.format_version() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " has format version ", manifest.format_version(), "; this ranncd reads 1"));
  }
  return manifest;
}

// The step of a committed checkpoint's directory name ("step-0000000040"), or -1.
int64_t StepOf(const std::string& name) {
  if (!absl::StartsWith(name, kStepPrefix)) return -1;
  int64_t step = -1;
  if (!absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step)) return -1;
  return step;
}

}  // namespace

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.preserve_proto_field_names = true;
  const auto printed = google::protobuf::util::MessageToJsonString(message, &json, print);
  if (!printed.ok()) {
    return absl::InternalError(absl::StrCat("writing a ", message.GetTypeName(), " as JSON: ",
                                            printed.message().as_string()));
  }
  return json;
}

absl::Status ReadJsonFile(const std::string& path, google::protobuf::Message* message) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // written by a newer ranncd
  const auto parsed = google::protobuf::util::JsonStringToMessage(*text, message, options);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat(path, " is not a ", message->GetTypeName(), ": ",
                                            parsed.message().as_string()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> JobDir(const std::string& checkpoint_dir,
                                   const std::string& job_name) {
  if (job_name.empty() || job_name == "." || job_name == ".." ||
      job_name.find('/') != std::string::npos || job_name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the job name '", job_name, "' cannot name a checkpoint directory under ", checkpoint_dir,
        "; name the job (RANNC_JOB) without '/'"));
  }
  return JoinPath(checkpoint_dir, job_name);
}

std::string StepDir(const std::string& job_dir, int64_t step) {
  return absl::StrFormat("%s/%s%010d", job_dir, kStepPrefix, step);
}

namespace {

// Tensor files of about this size are written in parallel.
constexpr int64_t kFileBytes = int64_t{64} << 20;

size_t Cores() { return std::max<unsigned>(1, std::thread::hardware_concurrency()); }

// fn(0), ..., fn(n - 1) on up to `cores` threads (0: one per core); returns when all have.
void ForEachInParallel(size_t n, const std::function<void(size_t)>& fn, size_t cores = 0) {
  if (cores == 0) cores = Cores();
  const size_t threads = std::max<size_t>(1, std::min<size_t>(n, cores));
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  for (size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++) fn(i);
    });
  }
  for (std::thread& w : workers) w.join();
}

struct TensorFile {
  std::string path;
  std::vector<const Piece*> pieces;
  // Results.
  absl::Status status;
  v1::CheckpointFile record;
  std::vector<v1::CheckpointEntry> entries;
  // Seconds spent: checksumming and writing into the page cache (the rest of serializing is the
  // zip format's framing and its own CRC of each record), and fsync.
  double write_s = 0;
  double sync_s = 0;
};

// The bytes serialization hands over are checksummed and written in pieces of this size: each
// is still in the CPU's cache when write(2) copies it.
constexpr size_t kWriteChunk = size_t{4} << 20;

void WriteTensorFile(const std::string& dir, TensorFile* file) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const Piece* piece : file->pieces) {
    std::string key = absl::StrCat(KindPrefix(piece->kind), "/", piece->name);
    if (!piece->state_key.empty()) absl::StrAppend(&key, "/", piece->state_key);
    const std::vector<int64_t> shape =
        piece->shape.empty() ? piece->value.sizes().vec() : piece->shape;
    int64_t whole_numel = 1;
    for (int64_t d : shape) whole_numel *= d;
    if (piece->offset != 0 || piece->value.numel() != whole_numel) {
      absl::StrAppend(&key, "@", piece->offset);
    }
    if (dict.contains(key)) continue;  // a tensor two names share is written once
    dict.insert(key, piece->value.contiguous());
    v1::CheckpointEntry& entry = file->entries.emplace_back();
    entry.set_kind(piece->kind);
    entry.set_name(piece->name);
    entry.set_state_key(piece->state_key);
    entry.set_file(file->path);
    entry.set_file_key(key);
    entry.set_dtype(DTypeName(piece->value.scalar_type()));
    for (int64_t d : shape) entry.add_shape(d);
    entry.set_offset(static_cast<uint64_t>(piece->offset));
    entry.set_numel(static_cast<uint64_t>(piece->value.numel()));
  }
  const std::string path = absl::StrCat(dir, "/", file->path);
  absl::StatusOr<DurableFile> out = DurableFile::Create(path);
  if (!out.ok()) {
    file->status = out.status();
    return;
  }
  // torch.save's format (what torch::jit::pickle_save makes in memory), serialized straight
  // into the file: the pickle first (small; the tensors in it are references), then the zip of
  // it and the tensors' bytes, which the zip writer hands over as they are. A write that fails
  // is remembered and the rest of the bytes dropped: the zip writer then finishes without
  // throwing (its destructor would, on a failed write).
  uint32_t crc = 0;
  uint64_t bytes = 0;
  absl::Status written;
  try {
    std::vector<char> pickled;
    torch::jit::Pickler pickler(
        [&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); });
    pickler.protocol();
    pickler.pushIValue(c10::IValue(dict));
    pickler.stop();
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, size_t size) -> size_t {
      const auto start = std::chrono::steady_clock::now();
      const char* p = static_cast<const char*>(data);
      for (size_t done = 0; done < size && written.ok(); done += kWriteChunk) {
        const size_t n = std::min(kWriteChunk, size - done);
        crc = Crc32(p + done, n, crc);
        written = out->Write(p + done, n);
      }
      bytes += size;
      file->write_s += SecondsSince(start);
      return size;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(),
                                       pickler.tensorData(), zip);
    zip.writeEndOfFile();
  } catch (const std::exception& e) {
    file->status = absl::InternalError(absl::StrCat("serializing ", path, ": ", e.what()));
    return;
  }
  if (written.ok()) {
    const auto start = std::chrono::steady_clock::now();
    written = out->Finish();
    file->sync_s = SecondsSince(start);
  }
  if (!written.ok()) {
    file->status = written;
    return;
  }
  file->record.set_path(file->path);
  file->record.set_bytes(bytes);
  file->record.set_crc32(crc);
}

}  // namespace

absl::StatusOr<std::string> BeginCheckpoint(const std::string& job_dir, int64_t step) {
  absl::Status made = MakeDirs(job_dir);
  if (!made.ok()) return made;
  const std::string unique = absl::StrCat(
      ::getpid(), "-", std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string dir = absl::StrFormat("%s/.%s%010d.tmp-%s", job_dir, kStepPrefix, step,
                                          unique);
  if (::mkdir(dir.c_str(), 0755) != 0) {
    return ErrnoStatus(errno, absl::StrCat("creating ", dir));
  }
  return dir;
}

void AbandonCheckpoint(const std::string& dir) { (void)RemoveTree(dir); }

bool HasRoomFor(const std::string& job_dir, uint64_t bytes) {
  std::string path = job_dir;
  while (!path.empty() && !PathExists(path) && path != "/") path = ParentPath(path);
  struct statvfs fs;
  if (path.empty() || ::statvfs(path.c_str(), &fs) != 0) return false;
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  return free_bytes >= bytes + bytes / 10 + (1ull << 30);
}

absl::StatusOr<v1::CheckpointShare> WriteShare(const std::string& dir, const std::string& prefix,
                                               const std::vector<Piece>& pieces) {
  // The share is cut into files of about kFileBytes, each serialized, checksummed and written
  // on a thread of its own: on one thread, the zip format's CRC and ours take longer than the
  // disk does.
  std::vector<std::vector<const Piece*>> groups(1);
  int64_t bytes = 0;
  for (const Piece& piece : pieces) {
    const int64_t n = static_cast<int64_t>(piece.value.nbytes());
    if (bytes > 0 && bytes + n > kFileBytes) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(&piece);
    bytes += n;
  }
  std::vector<TensorFile> files;
  for (size_t g = 0; g < groups.size(); ++g) {
    TensorFile file;
    file.path = groups.size() == 1 ? absl::StrCat(prefix, ".pt")
                                   : absl::StrCat(prefix, "-", g, ".pt");
    file.pieces = std::move(groups[g]);
    files.push_back(std::move(file));
  }
  const auto start = std::chrono::steady_clock::now();
  ForEachInParallel(files.size(), [&](size_t i) { WriteTensorFile(dir, &files[i]); });
  const double wall_s = SecondsSince(start);
  v1::CheckpointShare share;
  uint64_t written = 0;
  double write_s = 0, sync_s = 0;
  for (TensorFile& file : files) {
    if (!file.status.ok()) return file.status;
    written += file.record.bytes();
    write_s += file.write_s;
    sync_s += file.sync_s;
    for (v1::CheckpointEntry& entry : file.entries) *share.add_entries() = std::move(entry);
    *share.add_files() = std::move(file.record);
  }
  spdlog::info("checkpoint share {}: {} files, {} bytes on {} threads in {:.2f} s ({:.0f} MB/s); "
               "thread-seconds: checksum and write {:.2f}, fsync {:.2f}, the rest (the zip's "
               "framing and CRC) {:.2f}",
               prefix, files.size(), written, std::min<size_t>(files.size(), Cores()), wall_s,
               wall_s > 0 ? static_cast<double>(written) / wall_s / 1e6 : 0.0, write_s, sync_s,
               std::max(0.0, wall_s * std::min<size_t>(files.size(), Cores()) - write_s - sync_s));
  return share;
}

absl::StatusOr<v1::CheckpointManifest> CommitCheckpoint(
    const std::string& job_dir, const std::string& dir, v1::CheckpointManifest manifest,
    const std::vector<v1::CheckpointShare>& shares) {
  auto fail = [&](absl::Status status) {
    AbandonCheckpoint(dir);
    return status;
  };
  manifest.set_format_version(1);
  manifest.clear_files();
  manifest.clear_entries();
  for (const v1::CheckpointShare& share : shares) {
    manifest.mutable_files()->MergeFrom(share.files());
    manifest.mutable_entries()->MergeFrom(share.entries());
  }

  // Tests only (RANNC_TEST_CHECKPOINT_STALL_MS, unset in use): a window between the tensor
  // files and the manifest in which a test kills the daemon mid-write.
  if (const char* stall = std::getenv("RANNC_TEST_CHECKPOINT_STALL_MS")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(stall)));
  }

  absl::StatusOr<std::string> json = ToJson(manifest);
  if (!json.ok()) return fail(json.status());
  absl::Status written =
      WriteFileDurably(absl::StrCat(dir, "/", kManifest), json->data(), json->size());
  if (written.ok()) written = SyncDirectory(dir);
  if (!written.ok()) return fail(written);

  // The commit: the directory takes its place (a committed one of the same step moves aside
  // first, and goes once the new one is in).
  const int64_t step = manifest.step();
  const std::string final_dir = StepDir(job_dir, step);
  std::string old;
  if (PathExists(final_dir)) {
    old = absl::StrFormat("%s/.%s%010d.old-%s", job_dir, kStepPrefix, step,
                          dir.substr(dir.rfind(".tmp-") + 5));
    if (::rename(final_dir.c_str(), old.c_str()) != 0) {
      return fail(ErrnoStatus(errno, absl::StrCat("moving aside ", final_dir)));
    }
  }
  if (::rename(dir.c_str(), final_dir.c_str()) != 0) {
    return fail(ErrnoStatus(errno, absl::StrCat("committing ", final_dir)));
  }
  absl::Status synced = SyncDirectory(job_dir);
  if (!old.empty()) (void)RemoveTree(old);
  if (!synced.ok()) return synced;
  return manifest;
}

absl::StatusOr<v1::CheckpointManifest> WriteCheckpoint(const std::string& job_dir,
                                                       const Snapshot& snapshot) {
  absl::StatusOr<std::string> dir = BeginCheckpoint(job_dir, snapshot.manifest.step());
  if (!dir.ok()) return dir.status();
  std::vector<v1::CheckpointShare> shares;
  for (size_t f = 0; f < snapshot.files.size(); ++f) {
    absl::StatusOr<v1::CheckpointShare> share =
        WriteShare(*dir, absl::StrCat("daemon-", f), snapshot.files[f]);
    if (!share.ok()) {
      AbandonCheckpoint(*dir);
      return share.status();
    }
    shares.push_back(std::move(*share));
  }
  return CommitCheckpoint(job_dir, *dir, snapshot.manifest, shares);
}

std::vector<v1::CheckpointManifest> ListCheckpoints(const std::string& job_dir) {
  std::vector<v1::CheckpointManifest> out;
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(job_dir);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (StepOf(name) < 0) continue;
    absl::StatusOr<v1::CheckpointManifest> manifest =
        ParseManifest(JoinPath(JoinPath(job_dir, name), kManifest));
    if (manifest.ok()) out.push_back(std::move(*manifest));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.step() < b.step();
  });
  return out;
}

absl::StatusOr<v1::CheckpointManifest> FindCheckpoint(const std::string& job_dir, int64_t step) {
  std::vector<v1::CheckpointManifest> all = ListCheckpoints(job_dir);
  if (step <= 0 && !all.empty()) return all.back();
  for (v1::CheckpointManifest& m : all) {
    if (m.step() == step) return std::move(m);
  }
  std::vector<int64_t> steps;
  for (const v1::CheckpointManifest& m : all) steps.push_back(m.step());
  return absl::NotFoundError(absl::StrCat(
      step <= 0 ? std::string("no checkpoint") : absl::StrCat("no checkpoint of step ", step),
      " in ", job_dir,
      steps.empty() ? std::string(" (it holds none)")
                    : absl::StrCat(" (it holds steps ", absl::StrJoin(steps, ", "), ")")));
}

absl::StatusOr<std::vector<std::string>> RetireCheckpoints(const std::string& job_dir,
                                                           int keep) {
  std::vector<std::string> committed;
  std::vector<std::string> out;
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(job_dir);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (StepOf(name) >= 0 && PathExists(JoinPath(JoinPath(job_dir, name), kManifest))) {
      committed.push_back(name);
    } else if (absl::StartsWith(name, absl::StrCat(".", kStepPrefix))) {
      out.push_back(JoinPath(job_dir, name));  // a leftover, or one retired before
    }
  }
  std::sort(committed.begin(), committed.end());  // zero-padded: by step
  if (keep <= 0 || committed.size() <= static_cast<size_t>(keep)) return out;
  const std::string unique = absl::StrCat(
      ::getpid(), "-", std::chrono::steady_clock::now().time_since_epoch().count());
  for (auto name = committed.begin(); name != committed.end() - keep; ++name) {
    const std::string retired = JoinPath(job_dir, absl::StrCat(".", *name, ".retired-", unique));
    if (::rename(JoinPath(job_dir, *name).c_str(), retired.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("retiring ", JoinPath(job_dir, *name)));
    }
    out.push_back(retired);
  }
  return out;
}

absl::Status RemoveRetired(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    absl::Status removed = RemoveTree(path);
    if (!removed.ok()) return removed;
  }
  return absl::OkStatus();
}

absl::Status PruneCheckpoints(const std::string& job_dir, int keep) {
  absl::StatusOr<std::vector<std::string>> retired = RetireCheckpoints(job_dir, keep);
  if (!retired.ok()) return retired.status();
  return RemoveRetired(*retired);
}

namespace {

// One tensor file of a checkpoint, mapped read-only, checked against its manifest record and
// unpickled: its CRC reads the page cache's own pages, and its tensors are copied once, from
// them into their storage (a read into a buffer first cost a zeroing, a copy and a second pass
// of the CRC over memory).
class MappedFile : public caffe2::serialize::ReadAdapterInterface {
 public:
  MappedFile(const char* data, size_t size) : data_(data), size_(size) {}
  ~MappedFile() override { ::munmap(const_cast<char*>(data_), size_); }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const char* data() const { return data_; }
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = std::min<size_t>(n, size_ - pos);
    std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

absl::Status ReadTensorFile(const std::string& path, const v1::CheckpointFile& record,
                            std::map<std::string, at::Tensor>* tensors) {
  // O_NONBLOCK: a FIFO put there would otherwise hold the reader until someone writes to it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::DataLossError(ErrnoStatus(errno, "reading " + path).message());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::DataLossError(ErrnoStatus(err, "reading " + path).message());
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != record.bytes() || size == 0) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, " holds ", size, " bytes; its manifest says ",
                                            record.bytes(), " (truncated or overwritten)"));
  }
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (mapped == MAP_FAILED) {
    return absl::DataLossError(ErrnoStatus(map_error, "mapping " + path).message());
  }
  auto file = std::make_shared<MappedFile>(static_cast<const char*>(mapped), size);
  if (Crc32(file->data(), size) != record.crc32()) {
    return absl::DataLossError(absl::StrCat(path, " is corrupted: its CRC-32 differs from "
                                            "the manifest's"));
  }
  // Sizes the file states, checked before LibTorch allocates them (its CRC may have been made
  // for what it holds).
  if (absl::Status checked = CheckTorchArchive(absl::string_view(file->data(), size), path);
      !checked.ok()) {
    return absl::DataLossError(checked.message());
  }
  try {
    // What torch::jit::pickle_load does with a whole file's bytes, reading from the mapping.
    caffe2::serialize::PyTorchStreamReader reader(file);
    const c10::IValue value = torch::jit::readArchiveAndTensors(
        "data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", /*type_resolver=*/{},
        /*obj_loader=*/{}, /*device=*/{}, reader);
    for (const auto& item : value.toGenericDict()) {
      (*tensors)[item.key().toStringRef()] = item.value().toTensor();
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, " does not read as a tensor file: ",
                                            e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Contents> ReadCheckpoint(const std::string& job_dir,
                                        const v1::CheckpointManifest& manifest) {
  const std::string dir = StepDir(job_dir, manifest.step());
  // The files are read, checked and unpickled in parallel, as WriteShare writes them, on half
  // the cores: a resumed job reads its checkpoint while its model is imported and probed on the
  // host, and a copy from the page cache gains little from more threads than memory has
  // bandwidth for.
  std::map<std::string, std::map<std::string, at::Tensor>> files;
  for (const v1::CheckpointFile& f : manifest.files()) {
    if (absl::Status named = CheckFileName(f.path(), dir); !named.ok()) return named;
    if (!files.emplace(f.path(), std::map<std::string, at::Tensor>()).second) {
      return absl::DataLossError(absl::StrCat("the manifest in ", dir, " lists the file '",
                                              f.path(), "' twice"));
    }
  }
  std::vector<absl::Status> statuses(manifest.files_size());
  ForEachInParallel(
      statuses.size(),
      [&](size_t i) {
        const v1::CheckpointFile& f = manifest.files(static_cast<int>(i));
        statuses[i] = ReadTensorFile(absl::StrCat(dir, "/", f.path()), f, &files.at(f.path()));
      },
      std::max<size_t>(1, std::thread::hardware_concurrency() / 2));
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }

  // First every entry is checked against its file, and the pieces of each tensor against each
  // other: one shape and dtype, slices that tile it exactly. Only then is anything allocated by
  // the manifest's shapes (they are as large as the files' tensors together).
  struct Whole {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    std::vector<std::pair<uint64_t, uint64_t>> slices;  // [offset, offset + numel)
  };
  std::map<std::string, Whole> wholes;  // by tensor_id
  // Parameters and buffers are one namespace (Contents::tensors): a name may not be both.
  auto tensor_id = [](const v1::CheckpointEntry& e) {
    return e.kind() == v1::CheckpointEntry::OPTIMIZER_STATE
               ? absl::StrCat("state\n", e.name(), "\n", e.state_key())
               : absl::StrCat("tensor\n", e.name());
  };
  auto describe = [&](const v1::CheckpointEntry& e) {
    return absl::StrCat(dir, ": the pieces of '", e.name(), "'",
                        e.state_key().empty() ? "" : absl::StrCat(" state '", e.state_key(), "'"));
  };
  std::vector<const at::Tensor*> pieces;
  for (const v1::CheckpointEntry& e : manifest.entries()) {
    const std::string what = absl::StrCat(dir, "/", e.file(), " entry '", e.file_key(), "'");
    auto file = files.find(e.file());
    if (file == files.end() || !file->second.count(e.file_key())) {
      return absl::DataLossError(absl::StrCat(what, " is missing"));
    }
    const at::Tensor& piece = file->second.at(e.file_key());
    absl::StatusOr<int64_t> whole_numel = CheckedNumel(e.shape(), what);
    if (!whole_numel.ok()) return whole_numel.status();
    const uint64_t whole = static_cast<uint64_t>(*whole_numel);
    // offset + numel <= whole, written so that it cannot wrap.
    if (static_cast<uint64_t>(piece.numel()) != e.numel() || DTypeName(piece.scalar_type()) !=
        e.dtype() || e.numel() > whole || e.offset() > whole - e.numel()) {
      return absl::DataLossError(absl::StrCat(what, " does not match its manifest entry"));
    }
    const std::vector<int64_t> shape(e.shape().begin(), e.shape().end());
    auto [w, added] = wholes.emplace(tensor_id(e), Whole{shape, piece.scalar_type(), {}});
    if (!added && (w->second.shape != shape || w->second.dtype != piece.scalar_type())) {
      return absl::DataLossError(absl::StrCat(describe(e), " differ in shape or dtype"));
    }
    w->second.slices.emplace_back(e.offset(), e.offset() + e.numel());
    pieces.push_back(&piece);
  }
  for (const v1::CheckpointEntry& e : manifest.entries()) {
    Whole& w = wholes.at(tensor_id(e));
    if (w.slices.empty()) continue;  // checked already
    std::sort(w.slices.begin(), w.slices.end());
    uint64_t covered = 0;
    for (const auto& [from, to] : w.slices) {
      if (from != covered) {
        return absl::DataLossError(absl::StrCat(describe(e),
                                                from < covered ? " overlap" : " leave a gap",
                                                " at element ", std::min(from, covered)));
      }
      covered = to;
    }
    const int64_t numel = Numel(e.shape());
    if (covered != static_cast<uint64_t>(numel)) {
      return absl::DataLossError(absl::StrCat(describe(e), " cover ", covered, " of its ",
                                              numel, " elements"));
    }
    w.slices.clear();
  }

  Contents out;
  std::map<std::pair<std::string, std::string>, size_t> state_index;
  try {
    for (int i = 0; i < manifest.entries_size(); ++i) {
      const v1::CheckpointEntry& e = manifest.entries(i);
      const at::Tensor& piece = *pieces[i];
      const std::vector<int64_t> shape(e.shape().begin(), e.shape().end());
      at::Tensor* target = nullptr;
      if (e.kind() == v1::CheckpointEntry::OPTIMIZER_STATE) {
        auto [it, added] = state_index.emplace(std::make_pair(e.name(), e.state_key()),
                                               out.optimizer.size());
        if (added) out.optimizer.push_back({e.name(), e.state_key(), at::Tensor()});
        target = &out.optimizer[it->second].value;
      } else {
        target = &out.tensors[e.name()];
      }
      if (e.offset() == 0 && static_cast<int64_t>(e.numel()) == Numel(e.shape())) {
        *target = piece.reshape(shape);
      } else {
        if (!target->defined()) *target = at::zeros(shape, piece.options());
        target->view(-1).narrow(0, static_cast<int64_t>(e.offset()), piece.numel())
            .copy_(piece.reshape(-1));
      }
    }
  } catch (const std::exception& e) {  // host memory, say: the checks above leave nothing else
    return absl::ResourceExhaustedError(absl::StrCat("assembling the tensors of ", dir, ": ",
                                                     e.what()));
  }
  return out;
}

namespace {

c10::IValue Pair(double a, double b) {
  return c10::ivalue::Tuple::create({c10::IValue(a), c10::IValue(b)});
}

// A scripted optimizer's param group (HyperParams.named): its entries by the client's names,
// where `x_0`, `x_1`, ... join again into the tuple `x` that pyrannc flattened (when `x` is not
// an entry itself); numbers stay floats.
c10::IValue ScriptedGroupDict(const v1::HyperParams& h, const std::vector<int64_t>& params) {
  const std::map<std::string, double> named(h.named().begin(), h.named().end());
  c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
  std::set<std::string> joined;
  for (const auto& [key, value] : named) {
    const size_t underscore = key.rfind('_');
    const std::string base = underscore == std::string::npos ? "" : key.substr(0, underscore);
    if (!base.empty() && key.substr(underscore + 1) == "0" && !named.count(base)) {
      std::vector<c10::IValue> items;
      while (named.count(absl::StrCat(base, "_", items.size()))) {
        const std::string item = absl::StrCat(base, "_", items.size());
        items.push_back(named.at(item));
        joined.insert(item);
      }
      g.insert(base, c10::ivalue::Tuple::create(std::move(items)));
    }
  }
  for (const auto& [key, value] : named) {
    if (!joined.count(key)) g.insert(key, value);
  }
  g.insert("params", c10::List<int64_t>(params));
  return g;
}

// A param group as torch.optim's state_dict() has it for `optimizer` (its constructor's
// arguments, PyTorch's pairs joined again), with the indices of its parameters.
c10::IValue GroupDict(const std::string& optimizer, const v1::HyperParams& h,
                      const std::vector<int64_t>& params) {
  if (!h.named().empty()) return ScriptedGroupDict(h, params);
  c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
  g.insert("lr", h.lr());
  const bool adam_like = optimizer == "adam" || optimizer == "adamw" || optimizer == "adamax" ||
                         optimizer == "nadam" || optimizer == "radam";
  if (optimizer == "sgd") {
    g.insert("momentum", h.momentum());
    g.insert("dampening", h.dampening());
    g.insert("nesterov", h.nesterov());
  } else if (adam_like) {
    g.insert("betas", Pair(h.beta1(), h.beta2()));
    g.insert("eps", h.eps());
  } else if (optimizer == "rmsprop") {
    g.insert("alpha", h.alpha());
    g.insert("eps", h.eps());
    g.insert("momentum", h.momentum());
    g.insert("centered", h.centered());
  } else if (optimizer == "adagrad") {
    g.insert("lr_decay", h.lr_decay());
    g.insert("initial_accumulator_value", h.initial_accumulator_value());
    g.insert("eps", h.eps());
  } else if (optimizer == "adadelta") {
    g.insert("rho", h.rho());
    g.insert("eps", h.eps());
  } else if (optimizer == "asgd") {
    g.insert("lambd", h.lambd());
    g.insert("alpha", h.alpha());
    g.insert("t0", h.t0());
  } else if (optimizer == "rprop") {
    g.insert("etas", Pair(h.etaminus(), h.etaplus()));
    g.insert("step_sizes", Pair(h.step_size_min(), h.step_size_max()));
  }
  if (optimizer != "rprop") g.insert("weight_decay", h.weight_decay());
  if (optimizer == "adam" || optimizer == "adamw") {
    g.insert("amsgrad", h.amsgrad());
    g.insert("capturable", false);
    g.insert("fused", c10::IValue());
  }
  if (optimizer == "nadam") g.insert("momentum_decay", h.momentum_decay());
  if (optimizer == "nadam" || optimizer == "radam") {
    g.insert("decoupled_weight_decay", h.decoupled_weight_decay());
  }
  g.insert("maximize", h.maximize());
  g.insert("foreach", c10::IValue());
  g.insert("differentiable", false);
  g.insert("params", c10::List<int64_t>(params));
  return g;
}

}  // namespace

absl::StatusOr<std::vector<char>> ExportCheckpoint(const v1::CheckpointManifest& manifest,
                                                   const Contents& contents) {
  c10::Dict<std::string, at::Tensor> model;
  std::map<std::string, std::string> entry_of;  // state_dict key -> entry name
  for (int i = 0; i < manifest.state_keys_size() && i < manifest.state_entries_size(); ++i) {
    auto it = contents.tensors.find(manifest.state_entries(i));
    if (it == contents.tensors.end()) {
      return absl::DataLossError(absl::StrCat("the checkpoint of step ", manifest.step(),
                                              " has no tensor '", manifest.state_entries(i), "'"));
    }
    model.insert(manifest.state_keys(i), it->second);
    entry_of[manifest.state_keys(i)] = manifest.state_entries(i);
  }
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("model", model);
  if (!manifest.optimizer().empty()) {
    c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
    c10::impl::GenericList groups(c10::AnyType::get());
    int64_t index = 0;
    for (const v1::ParamGroup& group : manifest.param_groups()) {
      std::vector<int64_t> ids;
      for (const std::string& name : group.params()) {
        const std::string entry = entry_of.count(name) ? entry_of[name] : name;
        c10::Dict<std::string, at::Tensor> per_param;
        for (const Contents::State& s : contents.optimizer) {
          if (s.param == entry) per_param.insert(s.key, s.value);
        }
        if (per_param.size() > 0) state.insert(index, per_param);
        ids.push_back(index++);
      }
      groups.push_back(GroupDict(manifest.optimizer(), group.hyper(), ids));
    }
    c10::impl::GenericDict optimizer(c10::StringType::get(), c10::AnyType::get());
    optimizer.insert("state", state);
    optimizer.insert("param_groups", groups);
    top.insert("optimizer", optimizer);
  }
  try {
    return torch::jit::pickle_save(c10::IValue(top));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("exporting the checkpoint: ", e.what()));
  }
}

}  // namespace checkpoint
}  // namespace rannc
