// Runs one job's model whole on one device with LibTorch's TorchScript interpreter and
// autograd: one lifted graph per mode (a traced graph bakes in train/eval and dropout), all
// reading the same ParamStore tensors. Forward keeps its outputs until Backward consumes them,
// so gradients flow into the store's parameter leaves exactly as in eager PyTorch.
//
// Not thread-safe: the owning Job serializes calls. Borrows the ParamStore, which must outlive
// the runner.
#ifndef RANNC_DAEMON_RUNTIME_MODEL_RUNNER_H_
#define RANNC_DAEMON_RUNTIME_MODEL_RUNNER_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/runtime/param_store.h"

namespace torch {
namespace jit {
struct Code;
struct Module;
}  // namespace jit
}  // namespace torch

namespace rannc {

// A model's behaviour switches (PyTorch's module.training and RaNNC's enable_dropout).
struct ModelMode {
  bool training = true;
  bool dropout = true;
  bool operator<(const ModelMode& o) const {
    return training != o.training ? training < o.training : dropout < o.dropout;
  }
  std::string ToString() const;
};

// A range an integer input's values must stay in (they index a table: graph/index_bounds.h).
struct IndexRange {
  int64_t limit = 0;              // [0, limit) ...
  std::optional<int64_t> ignore;  // ... or this value
  std::string what;               // what the values index, for messages
};

// The dtype and shape of one forward input; dimension 0 (the batch) may vary between calls.
// `ranges`: the ranges its values must stay in (checked with every batch, on the host).
struct InputSignature {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::vector<IndexRange> ranges;
};

class ModelRunner {
 public:
  explicit ModelRunner(ParamStore* store);
  ~ModelRunner();

  // Adds the graph for `mode`. Every tensor it reads must exist in the store with the same
  // shape (a retrace of the same model); INVALID_ARGUMENT otherwise.
  absl::Status AddMode(const ModelMode& mode, const ImportedModel& model);
  bool HasMode(const ModelMode& mode) const;

  // Inputs are checked against `signature` (count, dtype, rank, non-batch dims) first. With
  // `requires_grad`, the outputs are kept for Backward; otherwise no graph is recorded.
  absl::StatusOr<std::vector<at::Tensor>> Forward(const ModelMode& mode,
                                                  const std::vector<InputSignature>& signature,
                                                  const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad);

  // Gradients w.r.t. outputs of the last Forward, by output index. Without `retain_graph` the
  // outputs are released, so a second Backward is FAILED_PRECONDITION.
  absl::Status Backward(const std::vector<std::pair<size_t, at::Tensor>>& output_grads,
                        bool retain_graph);

  // Drops outputs (and the autograd graph they hold) of the last forward.
  void ReleaseOutputs() { outputs_.clear(); }
  // Whether the last forward's graph awaits a backward (it holds the store's tensors).
  bool holds_graph() const { return !outputs_.empty(); }

 private:
  struct ModeGraph {
    std::shared_ptr<torch::jit::Module> module;  // see ImportedModel::module
    std::shared_ptr<torch::jit::Code> code;
    std::vector<at::Tensor> tensor_args;  // store tensors, in the graph's input order
  };

  ParamStore* store_;
  std::map<ModelMode, ModeGraph> graphs_;
  std::vector<at::Tensor> outputs_;
};

// Checks `inputs` against `signature`; messages name the input and both shapes, or the first
// value out of one of its ranges, where it is and what it indexes.
absl::Status CheckInputs(const std::vector<InputSignature>& signature,
                         const std::vector<at::Tensor>& inputs);

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_MODEL_RUNNER_H_
