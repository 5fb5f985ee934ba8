// Fuzz target: the model archive a client sends (JobSpec.torchscript: torch.jit.save of its
// traced module) through ImportTorchScript, the daemon's first reading of it (the zip, the
// pickled constants and tensors, TorchScript's own compiler for the code in it, then the lifting
// of module attributes into graph inputs), and CheckNoStandIns. Every path must end in a status:
// an exception LibTorch throws must not escape, and no crash or hang.
//
// Seeds: the test fixtures' traced models (tests/fixtures/*.pt, made by make_models.py), copied
// into fuzz/corpus/torchscript_import.
#include <cstdint>
#include <string>

#include "daemon/graph/torchscript_import.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<rannc::ImportedModel> model = rannc::ImportTorchScript(bytes);
  if (model.ok()) (void)rannc::CheckNoStandIns(*model);
  return 0;
}
