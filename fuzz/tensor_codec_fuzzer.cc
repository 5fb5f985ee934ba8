// Fuzz target: the tensor codec as a client reaches it. The input is a sequence of frames, each a
// little-endian uint32 length and that many bytes. The first frame is a rannc.v1.Tensor (an input
// or a model tensor) for DecodeTensor, its shared-memory reference read through a ShmDirectory
// whose directory, /tmp/rannc-fuzz-shm, holds one 4 KiB file, rannc-fuzz. Every later frame is a
// rannc.v1.StateDictChunk of a streamed state_dict (StateDictAssembler: ChunkAssembler's checks,
// then Finish). Frames that are not those messages are skipped. Every path must end in a status:
// no crash, hang or leak.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "daemon/common/tensor_codec.h"
#include "daemon/common/wire_dtype.h"
#include "rannc/v1/training.pb.h"

namespace {

// Entries larger than this are skipped: the daemon admits a state_dict's tensors against its
// memory (an allocation, not a parser, question), and the fuzzer's own limit is 4 GiB.
constexpr size_t kMaxEntryBytes = size_t{64} << 20;

// /tmp/rannc-fuzz-shm: a fixed directory, so that the seeds' references name its file.
const rannc::ShmDirectory& Shm() {
  static const rannc::ShmDirectory* shm = [] {
    const std::string dir = "/tmp/rannc-fuzz-shm";
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) std::abort();
    std::string bytes(4096, '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131);
    // Written aside and renamed: fuzzers running at once each see a whole file.
    const std::string tmp = dir + "/.rannc-fuzz." + std::to_string(::getpid());
    std::ofstream(tmp, std::ios::binary) << bytes;
    if (std::rename(tmp.c_str(), (dir + "/rannc-fuzz").c_str()) != 0) std::abort();
    return new rannc::ShmDirectory(dir);  // the fuzzer's lifetime
  }();
  return *shm;
}

// The next frame of `data`, or false at the end (a short last frame is the rest).
bool NextFrame(const uint8_t*& data, size_t& size, std::string* frame) {
  if (size < 4) return false;
  uint32_t length;
  std::memcpy(&length, data, 4);
  data += 4;
  size -= 4;
  const size_t n = length < size ? length : size;
  frame->assign(reinterpret_cast<const char*>(data), n);
  data += n;
  size -= n;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs each string field that is not UTF-8: most mutated inputs, at a cost per run.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string frame;
  if (!NextFrame(data, size, &frame)) return 0;
  rannc::v1::Tensor tensor;
  if (tensor.ParseFromString(frame)) {
    (void)rannc::DecodeTensor(tensor, "input 'x' (#0)", &Shm());
  }
  rannc::StateDictAssembler assembler;
  while (NextFrame(data, size, &frame)) {
    rannc::v1::StateDictChunk chunk;
    if (!chunk.ParseFromString(frame)) continue;
    const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
    absl::StatusOr<size_t> bytes = rannc::DenseBytes(chunk.dtype(), shape, "entry");
    if (bytes.ok() && *bytes > kMaxEntryBytes) continue;
    if (!assembler.Add(chunk).ok()) return 0;
  }
  (void)assembler.Finish();
  return 0;
}
