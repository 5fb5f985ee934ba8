// Runs one pipeline stage (a Subgraph of the model's IR) on one device with LibTorch's
// interpreter and autograd, one micro-batch at a time: Forward keeps what that micro-batch's
// backward needs, Backward takes the gradients of the stage's outputs and returns those of its
// activation inputs (what the previous stage needs), accumulating parameter gradients into the
// device's parameter leaves. Micro-batches are independent, so a schedule may interleave them
// (1F1B) or run all forwards first (GPipe).
//
// With StageOptions::recompute (the plan's `recompute` for the stage), a forward with gradients
// runs without autograd and keeps only the micro-batch's data inputs; Backward reruns the forward
// with autograd from them, then backpropagates. Both runs execute the same ops in the same order,
// so outputs and gradients are bitwise those of a run without recomputation. Buffers the stage
// updates in place (BatchNorm statistics) are copied before each such forward and the replay
// runs on the copies, so they are updated once, as without recomputation.
//
// Random ops (dropout, bernoulli, rand*, ...): the devices of one daemon share each device's
// default generator (the CPU one for every CPU device thread). A random stage with recompute
// runs each forward holding one process-wide RNG lock exclusively, so no other random stage draws
// in between (other random forwards hold it shared and run at once); it saves the generators'
// state before the forward, and the recomputed forward replays from that state (under the same
// lock) and then puts the generators back where they were, so the dropout masks match and
// recomputation leaves the random stream unchanged.
// Code outside StageExecutor that draws from the same generator concurrently breaks the replay.
//
//   absl::StatusOr<std::unique_ptr<StageExecutor>> stage =
//       StageExecutor::Create(ir, std::move(subgraph), device_tensors, {/*recompute=*/true});
//   auto out = (*stage)->Forward(/*micro_batch=*/0, inputs, /*requires_grad=*/true);
//   auto input_grads = (*stage)->Backward(0, output_grads);
//
// Blocks (CreateBlocked; offload's streaming, runtime/pipeline_engine_offload.cc): the stage's
// nodes split into consecutive ranges, each run by an executor of its own in turn, the values
// that cross a block boundary detached there as between stages. Hooks run before and after
// each block's forward and backward (the engine uploads a block's parameters just before it
// runs and frees them after), and a block's parameter gradients are complete when its backward
// returns. Outputs and gradients are those of the whole stage, up to the order in which the
// gradients of a value read by several blocks are summed.
//
// Grouped casts (StageOptions::cast_group_bytes): at amp_level O2 every parameter is read
// through one cast to bf16, a copy kernel each in every forward, and autograd's backward of the
// cast widens its gradient with another. With groups, the trainable parameters' casts are made
// before the graph runs, one multi-tensor copy a group (torch._foreach_copy_, batched across
// dtypes on CUDA since PyTorch 2.4; one copy each where LibTorch has no such op), and the graph's
// own casts then return what they are given. The group's autograd node widens the gradients of
// all of its parameters at once when the last of them is computed: the same values, summed into
// the same fp32 leaves in the same order. Groups bound what that delays: a group's gradients
// reach its leaves (and the replicas' all-reduce) when its last one is computed, its bf16 ones
// held until then. Every copy is made before the forward's first op, which a forward keeping
// them for its backward holds by its end anyway; not with recompute, whose forward without
// autograd frees each copy after its one use. ShareCasts lets the micro-batches of a step use
// one set of copies (below).
//
// Not thread-safe: the stage's device worker owns it (executors on different threads may run at
// once). The tensors it is given (parameters and buffers of the device) must outlive it.
#ifndef RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_
#define RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/subgraph.h"
#include "daemon/runtime/autocast.h"

namespace torch {
namespace jit {
struct Code;
}  // namespace jit
}  // namespace torch

namespace rannc {

struct StageOptions {
  // Keep only the data inputs of a micro-batch between its forward and backward, and rerun the
  // forward in Backward (less memory, one more forward per micro-batch). Default: off.
  bool recompute = false;
  // Forwards (and their replays) run under autocast to this dtype (runtime/autocast.h); the
  // backward follows what they recorded. Default: full precision.
  AmpDtype amp;
  // Where the stage runs. On a CUDA device `amp` is CUDA's autocast (CPU's otherwise), and the
  // graph's host constants are placed there (PlaceOnDevice, graph/subgraph.h).
  c10::Device device{c10::kCPU};
  // amp_level O2's casts of the parameters (graph/ir.h LowPrecisionRead) made together before
  // the stage's ops run, in groups of at most this many bytes of masters in the order the
  // forward reads them: each group one multi-tensor copy, and one autograd node whose backward
  // widens the group's gradients back with one more (see "Grouped casts" above). 0, or with
  // `recompute`: each cast where the graph has it.
  int64_t cast_group_bytes = 0;
};

// CreateBlocked's hooks, called on the executor's thread with the block's index; any of them
// may be empty. A non-OK status fails the Forward or Backward that called it (the micro-batch's
// forward is then dropped from every block; a failed backward leaves it to Release).
struct StageBlockHooks {
  std::function<absl::Status(int block)> before_forward, after_forward;
  std::function<absl::Status(int block)> before_backward, after_backward;
};

class StageExecutor {
 public:
  // `lifted`: the device's tensor for each of the IR's lifted inputs (IrGraph::tensor_names
  // order); the stage keeps the ones its subgraph reads.
  static absl::StatusOr<std::unique_ptr<StageExecutor>> Create(
      const IrGraph& ir, Subgraph subgraph, const std::vector<at::Tensor>& lifted,
      StageOptions options = {});
  // The stage `subgraph` (the atomic nodes [first, end), BuildSubgraph) run as blocks starting
  // at `block_starts` (ascending, the first one `first`, each block at least one node), each
  // with `options`. The same interface as Create's; see "Blocks" above.
  static absl::StatusOr<std::unique_ptr<StageExecutor>> CreateBlocked(
      const IrGraph& ir, Subgraph subgraph, const std::vector<int>& block_starts,
      const std::vector<at::Tensor>& lifted, StageOptions options, StageBlockHooks hooks);
  ~StageExecutor();

  // Blocks: their number (1 for Create's), and the lifted indices each one reads.
  int num_blocks() const { return blocks_.empty() ? 1 : static_cast<int>(blocks_.size()); }
  std::vector<int> block_lifted(int block) const;

  // The IR values the stage reads that are not parameters or buffers (client inputs and other
  // stages' activations), in the order Forward takes them; and the values it produces.
  const std::vector<int>& data_inputs() const { return data_inputs_; }
  const std::vector<int>& outputs() const { return subgraph_.outputs; }

  // Whether the subgraph has random ops (decided once, at Create).
  bool is_random() const { return random_; }

  // StageOptions::cast_group_bytes: the groups the parameters' casts are made in (blocks: all
  // of theirs); 0 where the graph makes each.
  int num_cast_groups() const;
  // Grouped casts shared by the forwards that follow, until ShareCasts(false): a forward casts
  // a group again only when one of its parameters changed since the group's last casts (its
  // memory or its version counter, which every in-place update moves), else its copies are
  // those casts'. So the micro-batches of one step cast the parameters once, not once each,
  // and hold one set of copies between them, not one each. The engine shares them for the
  // micro-batches of one call (runtime/pipeline_engine_step.cc); off, each forward casts anew
  // and the copies go with its graph. Not for a blocked executor (streamed parameters are
  // uploaded again for each micro-batch, and their copies would outlive their block).
  void ShareCasts(bool share);

  // FAILED_PRECONDITION when `micro_batch` already has a forward pending. With recompute, the
  // outputs of a forward with gradients do not require grad (Backward recomputes them).
  absl::StatusOr<std::vector<at::Tensor>> Forward(int micro_batch,
                                                  const std::vector<at::Tensor>& inputs,
                                                  bool requires_grad);
  // One gradient per output (undefined: the output gets none). Returns one gradient per data
  // input (undefined for inputs that are not differentiable or got none). Releases the
  // micro-batch unless `retain_graph` (a second backward over the same forward). With
  // recompute, reruns the forward first (replaying its random draws).
  absl::StatusOr<std::vector<at::Tensor>> Backward(int micro_batch,
                                                   const std::vector<at::Tensor>& output_grads,
                                                   bool retain_graph = false);
  // Drops a pending micro-batch (a forward without gradients, or an abandoned step).
  void Release(int micro_batch);
  size_t pending() const { return blocks_.empty() ? pending_.size() : blocks_[0]->pending(); }
  // Bytes (elements x element size; a view counts its own elements, not its storage) of the
  // tensors this executor holds for pending micro-batches: their data inputs and, with
  // recompute, the copies of buffers the stage writes and the saved generator states; without
  // recompute also their outputs. Not counted: the tensors autograd saves inside the outputs'
  // graph (LibTorch does not expose them), which are what recompute avoids keeping. Blocks: the
  // sum of theirs (a value crossing a boundary counts in both blocks).
  int64_t PendingBytes() const;

 private:
  StageExecutor() = default;

  struct RngState {
    at::Generator generator;
    at::Tensor state;  // generator.get_state() before the micro-batch's forward
  };
  struct Pending {
    // Data inputs: as leaves where differentiable; with recompute, detached.
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> outputs;  // empty with recompute
    // With recompute: the mutated buffers (mutated_buffers_ order) before the forward, and the
    // generators' states for a random stage.
    std::vector<at::Tensor> buffers;
    std::vector<RngState> rng;
  };

  // Runs the subgraph on `inputs` (data inputs, in data_inputs() order) and, where given, on
  // `buffers` in place of the device's mutated buffers; the parameters of `cast_groups_` cast
  // first.
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& inputs,
                              const std::vector<at::Tensor>& buffers = {}) const;
  // With recompute: reruns `pending`'s forward with autograd from its saved inputs, replaying
  // its random draws; fills its leaves and outputs.
  absl::Status Recompute(Pending* pending) const;
  // Leaves for autograd: differentiable inputs detached and requiring grad.
  static std::vector<at::Tensor> AsLeaves(const std::vector<at::Tensor>& inputs);
  // The default generators the stage's ops may draw from: the CPU one, and each accelerator's
  // that holds one of its tensors.
  std::vector<at::Generator> Generators(const std::vector<at::Tensor>& inputs) const;

  // Blocked: one run after another (see CreateBlocked).
  absl::StatusOr<std::vector<at::Tensor>> ForwardBlocks(int micro_batch,
                                                        const std::vector<at::Tensor>& inputs,
                                                        bool requires_grad);
  absl::StatusOr<std::vector<at::Tensor>> BackwardBlocks(
      int micro_batch, const std::vector<at::Tensor>& output_grads, bool retain_graph);

  Subgraph subgraph_;
  std::vector<std::unique_ptr<StageExecutor>> blocks_;  // CreateBlocked's; else empty
  StageBlockHooks hooks_;
  std::vector<int> lifted_index_;  // per subgraph input: its lifted index, or -1
  std::shared_ptr<torch::jit::Module> module_;  // keeps call stacks alive (see ImportedModel)
  std::shared_ptr<torch::jit::Code> code_;
  std::vector<int> data_inputs_;
  // Per subgraph input: index into the data inputs, or -1 for a lifted tensor.
  std::vector<int> input_slot_;
  std::vector<at::Tensor> lifted_;  // per subgraph input (undefined for data inputs)
  // Subgraph inputs that are lifted buffers the subgraph updates in place (BatchNorm
  // statistics). A recomputed forward must neither update them a second time nor read values
  // that later forwards wrote, so it runs on copies taken before the micro-batch's forward.
  std::vector<size_t> mutated_buffers_;
  // StageOptions::cast_group_bytes: subgraph input slots of parameters read only through a cast
  // to `low` from `wide`, grouped in the order the forward reads them.
  struct CastGroup {
    std::vector<size_t> slots;
    at::ScalarType wide, low;
  };
  std::vector<CastGroup> cast_groups_;
  // ShareCasts: per cast group, the copies of its last casts and what they were made from.
  struct SharedCast {
    std::vector<size_t> slots;          // the parameters cast (frozen ones are not)
    std::vector<const void*> data;      // their memory then,
    std::vector<int64_t> versions;      // and their version counters
    std::vector<at::Tensor> copies;     // detached
    bool Matches(const std::vector<size_t>& now_slots,
                 const std::vector<at::Tensor>& params) const;
    void Keep(const std::vector<size_t>& now_slots, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& made);
  };
  bool share_casts_ = false;
  // Filled by Run, which is const (Recompute's too) but never shares: a recomputed stage has
  // no cast groups.
  mutable std::vector<SharedCast> shared_casts_;
  StageOptions options_;
  bool random_ = false;
  std::map<int, Pending> pending_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_STAGE_EXECUTOR_H_
