// Checks on an archive from outside (torch.jit.save's or torch.save's zip: a client's model or
// optimizer update, a dataset file, a checkpoint's tensor file) before LibTorch reads it.
// LibTorch trusts the sizes an archive states: a zip record's uncompressed size, and a length in
// a pickle (BINBYTES, BINUNICODE, ...) are allocated as they are, so a few kilobytes can make
// the daemon allocate gigabytes (found by fuzz/torchscript_import_fuzzer.cc). These checks bound
// every such size by the bytes actually there.
//
//   absl::Status ok = CheckTorchArchive(bytes, "the model archive");  // INVALID_ARGUMENT
#ifndef RANNC_DAEMON_COMMON_TORCH_ARCHIVE_H_
#define RANNC_DAEMON_COMMON_TORCH_ARCHIVE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rannc {

// One record of a zip's central directory.
struct ZipRecord {
  std::string name;
  uint16_t method = 0;  // 0 stored, 8 deflated
  uint64_t compressed = 0;
  uint64_t size = 0;  // uncompressed
  uint64_t offset = 0;  // of its local header
};

// The records of the zip in `bytes` (zip64 included), each checked against the archive: within
// it, stored or deflated, and an uncompressed size deflate could produce from its compressed
// one. INVALID_ARGUMENT beginning with `what` otherwise.
absl::StatusOr<std::vector<ZipRecord>> ReadZipDirectory(absl::string_view bytes,
                                                        absl::string_view what);

// Walks a pickle's opcodes (protocols 0-5) without running them: every opcode known, every
// length within the bytes that follow it, every memo index one the pickle has put, and a STOP.
// INVALID_ARGUMENT beginning with `what` and naming the offset otherwise.
absl::Status CheckPickle(absl::string_view data, absl::string_view what);

// Checks TorchScript source (an archive's code/ files) for what crashes LibTorch 1.13's
// importer: nesting deeper than 500 levels (its parser recurses per level and overflows the
// thread's stack; over-estimated per statement from indentation, brackets, operators and
// conditionals), and a class constant without a type annotation (`foo = []` in a class body:
// the importer reads the absent annotation). INVALID_ARGUMENT beginning with `what` otherwise.
absl::Status CheckTorchScriptCode(absl::string_view code, absl::string_view what);

// Checks a code file's debug information (its .debug_pkl, after CheckPickle): TorchScript maps
// the code's source ranges to the client's Python source through it without checking its text
// indices or offsets, and an error message's traceback reads past the texts (a SIGSEGV). Each
// range's texts must be in its string table and its [start, end) within them (its end may be
// one past them, as torch.jit.save writes ranges of no source).
absl::Status CheckDebugInfo(absl::string_view pickle, absl::string_view what);

// ReadZipDirectory, then CheckPickle on each pickle of the archive (data.pkl, constants.pkl,
// the code's debug_pkl files, then CheckDebugInfo on those) and CheckTorchScriptCode on its
// code. torch.jit.save deflates the
// code and its debug_pkl files: those are inflated first, up to 256 MiB each.
absl::Status CheckTorchArchive(absl::string_view bytes, absl::string_view what);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_TORCH_ARCHIVE_H_
