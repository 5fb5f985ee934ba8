// The parameters and buffers of one job on one device: each distinct tensor once, under every
// name the module gives it (tied weights, e.g. an embedding reused as the LM head, are one
// tensor with two names — so one leaf, one gradient, one optimizer update, as in PyTorch).
//
// Tensors are stable objects: loading a state_dict copies into them in place, so graphs and
// optimizers may keep references. Not thread-safe; the owning Job serializes access.
#ifndef RANNC_DAEMON_RUNTIME_PARAM_STORE_H_
#define RANNC_DAEMON_RUNTIME_PARAM_STORE_H_

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/graph/torchscript_import.h"

namespace rannc {

class ParamStore {
 public:
  struct Entry {
    std::string name;                  // first name in named_parameters() order
    std::vector<std::string> aliases;  // the other names of the same tensor
    at::Tensor tensor;
    bool is_parameter = false;
    bool dropped = false;  // see Drop
  };

  // Deduplicates `tensors` (state_dict order) by identity or shared storage; parameters become
  // autograd leaves that require grad, buffers do not.
  static ParamStore FromModuleTensors(const std::vector<ModuleTensor>& tensors);

  // Unique tensors: parameters first (named_parameters order), then buffers.
  const std::vector<Entry>& entries() const { return entries_; }
  // Every state_dict key, aliases included, in PyTorch's order.
  const std::vector<std::string>& state_keys() const { return state_keys_; }

  // The entry a name or alias refers to; nullptr if none.
  const Entry* Find(const std::string& name) const;
  std::vector<at::Tensor> Parameters() const;
  int64_t NumParameterElements() const;

  // Copies `state` into the stored tensors. Shapes are checked for every key before anything is
  // copied, so a failed load changes nothing. With `strict`, missing or unexpected keys are
  // INVALID_ARGUMENT; otherwise they are returned in the out-params.
  // A dropped entry it writes is restored first.
  absl::Status Load(const std::map<std::string, at::Tensor>& state, bool strict,
                    std::vector<std::string>* missing, std::vector<std::string>* unexpected);

  // While a deployed engine holds a tensor in memory of its own, the store's copy is dead weight
  // (for parameters, the whole model again in host memory). Drop frees it and keeps the entry's
  // shape, dtype, gradient and identity: the tensor object stays, over one element (NaN for a
  // floating dtype) that every position reads and no write may reach (copy_ into it throws).
  // Restore gives the entry memory of its own again, uninitialized: the caller writes it.
  void Drop(size_t entry);
  void Restore(size_t entry);

 private:
  std::vector<Entry> entries_;
  std::vector<std::string> state_keys_;
  std::unordered_map<std::string, size_t> index_;  // name or alias -> entries_ index
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_PARAM_STORE_H_
