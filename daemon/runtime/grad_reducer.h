// GradReducer sums one device's parameter gradients over a data-parallel replica group (a
// stage's replicas), in buckets, overlapping the communication with the backward pass that
// produces the gradients: as soon as autograd has accumulated the last gradient of a bucket's
// parameters, that bucket's all-reduce starts, while autograd goes on with earlier layers.
//
//   absl::StatusOr<std::unique_ptr<GradReducer>> r =
//       GradReducer::Create(params, replicas_comm, {});
//   ... backwards of the step's earlier micro-batches (the reducer ignores them) ...
//   (*r)->BeginFinalBackward();
//   torch::autograd::backward(...);   // the device's last micro-batch backward
//   absl::Status s = (*r)->Finish(wait);   // every param's .grad() is now the group's sum
//
// How: at Create the parameters are laid out, in reverse order (gradients arrive roughly in
// reverse), into buckets of at most Options::bucket_bytes, each of one dtype and device, each
// with a flat buffer allocated once and reused every step. A post-hook on each parameter's
// AccumulateGrad node copies the parameter's gradient into its bucket when the final backward
// accumulates it. Buckets are launched strictly in bucket order (a complete bucket waits for the
// buckets before it), so every rank issues the same collectives in the same order even when
// autograd visits parameters in a different order on different ranks; such a rank only
// overlaps less. Finish completes the buckets of parameters that got no gradient (zeros),
// waits for every bucket and copies the sums back into the parameters' .grad().
//
// Rules: every rank of the group creates its reducer with the same number of parameters, of the
// same shapes, dtypes and order, and options, and calls BeginFinalBackward/Finish once per step.
// Between BeginFinalBackward and Finish no one else may issue operations on `comm` (hooks issue
// them, from the thread that runs the backward). Methods are called from one thread at a time
// (a device's worker); the hooks take the reducer's lock, so autograd may run them on its own
// threads. A parameter's gradient accumulated outside an armed final backward (earlier
// micro-batches) is still part of what Finish reduces: Finish reduces each .grad() as it stands.
//
// Lifetimes: `comm` is not owned and must outlive the reducer. The reducer keeps each
// parameter's AccumulateGrad node alive (otherwise a later forward would create a fresh node
// without the hook) and removes its hooks when destroyed; destroy it only while no backward over
// its parameters runs. A Finish that fails (an operation's error or the waiter's timeout or
// abort) leaves the reducer broken: the group's collectives are out of step. Later
// BeginFinalBackward calls do nothing and Finish returns FAILED_PRECONDITION; operations not
// handed to the waiter are kept, with their buffers, until the reducer is destroyed. Destroying
// it with operations in flight (armed but not finished, or broken) frees their buffers, as the
// engine's teardown frees its abandoned operations': do so only once the group is failing or
// torn down, so that no peer completes them.
//
// Reduce-scatter mode (ZeRO; Options::scatter_buckets): the caller lays out the buckets, and
// each bucket's collective is a reduce-scatter that leaves rank r the r-th of comm->size()
// equal chunks of the bucket's sum, instead of an all-reduce. Rank r thereby owns chunk r of
// every bucket. The buckets' flat buffers are the parameters' gradients for the whole step:
//
//   options.scatter_buckets = {{2, 1}, {0}};   // bucket 0: params 2 then 1; bucket 1: param 0
//   r = GradReducer::Create(params, replicas_comm, options);
//   absl::Status s = (*r)->BindGrads();   // before the step's first backward
//   ... earlier micro-batch backwards accumulate into the buckets in place ...
//   (*r)->BeginFinalBackward();
//   torch::autograd::backward(...);       // complete buckets start reduce-scattering here
//   std::vector<at::Tensor> shards;
//   s = (*r)->Finish(wait, &shards);      // shards[b]: chunk rank() of bucket b's sum
//
// A bucket holds its parameters' gradients contiguously in the listed order, padded with zeros
// to a multiple of comm->size() elements. Its buffer exists from BindGrads (or
// BeginFinalBackward) until Finish, which drops the parameters' gradients: between steps the
// device holds only the shards the caller keeps.
#ifndef RANNC_DAEMON_RUNTIME_GRAD_REDUCER_H_
#define RANNC_DAEMON_RUNTIME_GRAD_REDUCER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/comm/communicator.h"

namespace rannc {

class GradReducer {
 public:
  struct Options {
    // Upper bound of a bucket's flat buffer, in bytes (PyTorch DDP's default cap, 25 MiB). A
    // parameter larger than this gets a bucket of its own.
    size_t bucket_bytes = 25u << 20;
    // The buckets' flat buffers exist only from BeginFinalBackward to the end of Finish
    // (parameter offload: the device keeps no gradient memory between steps). Default: allocated
    // once, at Create.
    bool transient = false;
    // Per parameter, its element count, for parameters whose storage is swapped out at Create
    // (offload: a device copy that exists only during steps; the tensor must have these
    // elements whenever a backward or Finish runs). Empty: each tensor's own numel().
    std::vector<int64_t> numels;
    // Reduce-scatter mode (see above): each bucket's parameter indices, in layout order; the
    // buckets start in this order. Every parameter is in exactly one bucket, and a bucket's
    // parameters share a dtype and device. Replaces the automatic layout (bucket_bytes and
    // transient are then unused: the buffers are always transient). Empty: all-reduce mode.
    std::vector<std::vector<int>> scatter_buckets;
    // All-reduce mode: floating buckets of another dtype travel as this one (cast before the
    // all-reduce, the sum cast back): half the bytes as bf16 or fp16, at their precision, as
    // RaNNC's allreduce_amp_master_params=False reduces Apex's fp16 model gradients. Undefined:
    // each bucket's own dtype.
    std::optional<at::ScalarType> wire_dtype;
  };

  // `params`: this device's parameter leaves (requires_grad) whose gradients are summed over
  // the replica group `comm`. comm == nullptr or comm->size() == 1: every call is a cheap no-op
  // (no hooks, no buffers). INVALID_ARGUMENT for an undefined tensor, a non-leaf or one not
  // requiring grad, the same tensor twice, or a dtype other than float32/64/16 and bfloat16;
  // in reduce-scatter mode also for a null `comm` (a group of one is fine: each shard is the
  // whole bucket) and for buckets that are not a partition of the parameters as said above.
  static absl::StatusOr<std::unique_ptr<GradReducer>> Create(std::vector<at::Tensor> params,
                                                             comm::Communicator* comm,
                                                             Options options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Arms the hooks for the backward after which every parameter's .grad() is final for this
  // step (the device's last micro-batch backward): from then on a parameter whose gradient
  // autograd has accumulated counts as ready, and a bucket whose parameters are all ready
  // starts its all-reduce (sum) at once, asynchronously, once the buckets before it have.
  void BeginFinalBackward();

  // Reduce-scatter mode: allocates the buckets' flat buffers, zeroed, and makes each
  // parameter's .grad() a view of its slot, so that autograd accumulates every backward of the
  // step there in place (no second copy of the gradients). Call before the step's first
  // backward, after the parameters' previous gradients were set aside (it replaces them).
  // Nothing in all-reduce mode or once broken. FAILED_PRECONDITION for a parameter whose
  // element count is not its Create-time count (offload: its storage is not swapped in).
  absl::Status BindGrads();

  // The engine's waiter: waits for `work`, enforcing its own timeout and abort flag; `keep` is
  // memory the operation may still write, to be kept alive if the waiter gives up on it.
  using WaitFn = std::function<absl::Status(std::unique_ptr<comm::Work> work, at::Tensor keep,
                                            const std::string& what)>;

  // Call after the armed backward returned. Parameters that got no gradient in it count as
  // ready (an undefined gradient counts as zeros), the remaining buckets start, each bucket is
  // waited for through `wait`, in order, and the sums are copied into each parameter's .grad()
  // (in place where it is defined; a new tensor otherwise). The first error stops it and is
  // returned annotated with the bucket (see above for what it leaves behind).
  // FAILED_PRECONDITION without a BeginFinalBackward since the last Finish.
  // Reduce-scatter mode: instead of copying sums back, sets `shards` to one tensor per bucket,
  // this rank's chunk of its sum, and drops every parameter's .grad() and the buckets' buffers;
  // INVALID_ARGUMENT when `shards` is null.
  absl::Status Finish(const WaitFn& wait, std::vector<at::Tensor>* shards = nullptr);

  // Hooks the parameters' current gradient accumulators. Call after their storage was swapped
  // with set_ (parameter offload), which makes autograd drop a leaf's accumulator, shaped as
  // the leaf was, and make a new one: without this the hooks stay on the old ones and no bucket
  // starts during the backward (Finish still reduces everything).
  absl::Status Rebind();

  // How many buckets each Finish reduces (fixed at Create), and how many of them the last
  // Finish found already started, i.e. overlapped with the backward. 0 for a no-op reducer.
  int buckets() const;
  int buckets_started_early() const;
  // Bytes of the buckets' flat buffers allocated now (not counting reduce-scatter outputs).
  int64_t buffer_bytes() const;

  class Impl;

 private:
  explicit GradReducer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_RUNTIME_GRAD_REDUCER_H_
