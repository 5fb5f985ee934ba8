// Checkpoints on disk (docs/checkpoints.md): one directory per checkpoint,
// `<checkpoint_dir>/<job name>/step-<N>/`, holding tensor files that plain torch.load opens
// (each a dict from key to tensor) and `manifest.json` (rannc.v1.CheckpointManifest in
// protobuf's JSON form), which names every tensor, its slice of the whole and the file's CRC.
//
// Commit: a checkpoint is written into a hidden directory beside the others (its manifest
// last, everything fsync'ed), which is then renamed into place; a crash at any point leaves the
// previous checkpoints whole, and at most a hidden directory that Prune removes.
//
//   Snapshot s;  // the job's facts in s.manifest, its tensors in s.files
//   absl::StatusOr<v1::CheckpointManifest> m = WriteCheckpoint(JobDir(dir, "gpt"), s);
//   absl::StatusOr<v1::CheckpointManifest> latest = FindCheckpoint(JobDir(dir, "gpt"), 0);
//   absl::StatusOr<Contents> c = ReadCheckpoint(JobDir(dir, "gpt"), *latest);
//
// Over several daemons each writes its own share (WriteShare) into the directory the leading
// daemon began (BeginCheckpoint), and the leader commits it with every share's files and
// entries in its manifest (CommitCheckpoint).
//
// Free functions over the filesystem; thread-compatible (one writer per job directory).
#ifndef RANNC_DAEMON_CHECKPOINT_CHECKPOINT_H_
#define RANNC_DAEMON_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <google/protobuf/message.h>

#include "absl/status/statusor.h"
#include "rannc/v1/checkpoint.pb.h"

namespace rannc {
namespace checkpoint {

// One tensor of a snapshot: a whole parameter, buffer or optimizer state tensor, or a slice of
// one (elements [offset, offset + value.numel()) of the whole, flattened).
struct Piece {
  v1::CheckpointEntry::Kind kind = v1::CheckpointEntry::PARAM;
  std::string name;       // the parameter's or buffer's
  std::string state_key;  // optimizer state only
  at::Tensor value;       // on the host
  std::vector<int64_t> shape;  // the whole's; empty: value's own shape (a whole tensor)
  int64_t offset = 0;
};

// What a checkpoint holds, on the host: the manifest's facts (files and entries are filled by
// WriteCheckpoint) and the tensors, one list per daemon (each daemon's share).
struct Snapshot {
  v1::CheckpointManifest manifest;
  std::vector<std::vector<Piece>> files;
};

// `<checkpoint_dir>/<job_name>`. INVALID_ARGUMENT for an empty or path-like job name.
absl::StatusOr<std::string> JobDir(const std::string& checkpoint_dir, const std::string& job_name);
// The directory of checkpoint `step` in `job_dir` ("step-0000000040").
std::string StepDir(const std::string& job_dir, int64_t step);

// Writes `snapshot` as checkpoint manifest.step and commits it, replacing a committed one of the
// same step (BeginCheckpoint, WriteShare for each daemon's, CommitCheckpoint). Returns the
// manifest written. An error names the file (an unwritable directory, a full disk) and leaves
// every committed checkpoint as it was.
absl::StatusOr<v1::CheckpointManifest> WriteCheckpoint(const std::string& job_dir,
                                                       const Snapshot& snapshot);

// The steps of WriteCheckpoint, for a checkpoint written by several daemons at once. Begin
// creates checkpoint `step`'s hidden directory in `job_dir` (creating job_dir first) and returns
// its path. WriteShare writes `pieces` into it as files `<prefix>.pt` (or `<prefix>-<i>.pt`, one
// per ~64 MiB, on parallel threads), each fsync'ed; it may run on any daemon that sees the
// directory. Commit writes the manifest (`manifest`'s facts with every share's files and
// entries), fsyncs it and renames the directory into place; on failure, and by Abandon, the
// directory is removed (Prune would remove it too).
absl::StatusOr<std::string> BeginCheckpoint(const std::string& job_dir, int64_t step);
absl::StatusOr<v1::CheckpointShare> WriteShare(const std::string& dir, const std::string& prefix,
                                               const std::vector<Piece>& pieces);
absl::StatusOr<v1::CheckpointManifest> CommitCheckpoint(
    const std::string& job_dir, const std::string& dir, v1::CheckpointManifest manifest,
    const std::vector<v1::CheckpointShare>& shares);
void AbandonCheckpoint(const std::string& dir);

// The committed checkpoints of `job_dir`, oldest first (none when it does not exist); a
// checkpoint whose manifest does not parse is left out.
std::vector<v1::CheckpointManifest> ListCheckpoints(const std::string& job_dir);
// Checkpoint `step`, or the newest when step <= 0. NOT_FOUND naming the directory and the steps
// it has.
absl::StatusOr<v1::CheckpointManifest> FindCheckpoint(const std::string& job_dir, int64_t step);
// Deletes the committed checkpoints but the newest `keep` (0: keeps all) and the leftovers of
// writes that never committed.
absl::Status PruneCheckpoints(const std::string& job_dir, int keep);
// PruneCheckpoints in two halves, so that a writer can answer between them. Retire takes the
// committed checkpoints but the newest `keep` out of the listing at once (each is renamed to a
// hidden name) and returns their new paths with those of the leftovers; RemoveRetired deletes
// them, which takes long for large checkpoints. A directory begun after Retire returned is not
// among them.
absl::StatusOr<std::vector<std::string>> RetireCheckpoints(const std::string& job_dir, int keep);
absl::Status RemoveRetired(const std::vector<std::string>& paths);
// Whether the filesystem of `job_dir` (or of the nearest directory above it that exists) has
// room for `bytes` more, with a margin (10% and 1 GiB): then a write need not wait for an older
// checkpoint's deletion.
bool HasRoomFor(const std::string& job_dir, uint64_t bytes);

// A checkpoint's tensors, whole (slices assembled), after checking each file's size and CRC
// (DATA_LOSS naming the file) and each entry against its file.
struct Contents {
  std::map<std::string, at::Tensor> tensors;  // parameters and buffers, by entry name
  struct State {
    std::string param;
    std::string key;
    at::Tensor value;
  };
  std::vector<State> optimizer;  // in the manifest's order
};
absl::StatusOr<Contents> ReadCheckpoint(const std::string& job_dir,
                                        const v1::CheckpointManifest& manifest);

// One file plain PyTorch loads: torch.load gives {'model': state_dict (aliases included, in
// PyTorch's order), 'optimizer': torch.optim's state_dict ('state' by parameter index in the
// param groups' order, 'param_groups' with the last step's hyper-parameters)}.
absl::StatusOr<std::vector<char>> ExportCheckpoint(const v1::CheckpointManifest& manifest,
                                                   const Contents& contents);

// A message in protobuf's JSON form, as manifests and job records are kept (field names as in
// the .proto, indented); and one read back from the file at `path` (unknown fields, from a newer
// ranncd, ignored): NOT_FOUND when it cannot be read, DATA_LOSS naming it when it does not parse.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message);
absl::Status ReadJsonFile(const std::string& path, google::protobuf::Message* message);

}  // namespace checkpoint
}  // namespace rannc

#endif  // RANNC_DAEMON_CHECKPOINT_CHECKPOINT_H_
