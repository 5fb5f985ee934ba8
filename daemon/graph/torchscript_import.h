// Imports a serialized TorchScript module (torch.jit.save of a traced or scripted nn.Module)
// into the form the daemon executes: the forward graph, inlined, with every parameter and
// buffer it reads lifted from module attribute accesses (prim::GetAttr chains) to explicit
// graph inputs, plus the module's tensors by name.
//
// Lifting makes tensors plain values, so the daemon owns them (one copy per device, shared by
// the train/eval graphs of a job, tied weights deduplicated) and the planner can later cut the
// graph anywhere. Import is a pure function of the bytes; safe from any thread.
//
//   absl::StatusOr<ImportedModel> model = ImportTorchScript(bytes);
//   // run: stack = user inputs..., then tensor named model->graph_tensor_names[i] for each i.
#ifndef RANNC_DAEMON_GRAPH_TORCHSCRIPT_IMPORT_H_
#define RANNC_DAEMON_GRAPH_TORCHSCRIPT_IMPORT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace torch {
namespace jit {
struct Graph;
struct Module;
}  // namespace jit
}  // namespace torch

namespace rannc {

struct ModuleTensor {
  std::string name;  // dotted path as in PyTorch's state_dict ("encoder.0.weight")
  at::Tensor tensor;
  bool is_parameter = false;
};

struct ImportedModel {
  std::shared_ptr<torch::jit::Graph> graph;
  // Keeps the module's compilation unit alive: inlined nodes' call stacks point into its
  // functions, and the interpreter reads them to format an error raised inside the model.
  std::shared_ptr<torch::jit::Module> module;
  // Names of the forward's own arguments (self excluded), from the traced graph.
  std::vector<std::string> input_names;
  // One per graph input after the user inputs: the dotted name of the module tensor it reads.
  std::vector<std::string> graph_tensor_names;
  // Every parameter and buffer in PyTorch's state_dict order (each module's parameters, then
  // its buffers, then its children). Tied tensors appear under each name.
  std::vector<ModuleTensor> tensors;
};

// Module tensors sent apart from the archive, by dotted name (JobSpec.model_tensors).
using SentTensors = std::map<std::string, at::Tensor>;

// INVALID_ARGUMENT when the bytes are not a TorchScript archive, have no forward method, or use
// module attributes in a way that cannot be lifted.
//
// `sent` replaces the archive's stand-ins: each named tensor of the module (and every other
// name of the same tensor, tied weights) takes the sent value, which must have the stand-in's
// dtype and shape and gets its requires_grad. INVALID_ARGUMENT names a sent tensor the module
// lacks or one that does not match.
absl::StatusOr<ImportedModel> ImportTorchScript(const std::string& bytes,
                                                const SentTensors& sent = {});

// INVALID_ARGUMENT naming the first parameter or buffer of `model` that is still a stand-in
// (more than one element, all sharing one stored value: what a client writes in the archive for
// a tensor it sends in JobSpec.model_tensors) because no tensor was sent for it. A job created
// from such a module would train on one value per tensor. AddMode's archives are all stand-ins
// on purpose (the job already has the tensors), so only a job's first import checks this.
absl::Status CheckNoStandIns(const ImportedModel& model);

// The module with its sent tensors in place, serialized again (for daemons that take the whole
// archive: a cluster job's parts).
absl::StatusOr<std::string> SerializeModule(const ImportedModel& model);

// Replaces every parameter and buffer of `module` (and its submodules) with an empty tensor of
// its dtype, and empties model.tensors: once a job holds the model's tensors (ParamStore, which
// shares their memory), the lifted graph reads them as inputs and the module is kept only for
// its functions (call stacks), so its own references would only keep memory alive that the job
// has let go of (offload's host masters, which the store then shares). SerializeModule
// afterwards writes empty tensors.
void ReleaseModuleTensors(ImportedModel* model);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_TORCHSCRIPT_IMPORT_H_
