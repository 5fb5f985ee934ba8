#include "daemon/runtime/grad_reducer.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"
#include "daemon/runtime/tensor_buffer.h"

namespace rannc {
namespace {

using torch::autograd::variable_list;

}  // namespace

class GradReducer::Impl {
 public:
  ~Impl();
  absl::Status Init(std::vector<at::Tensor> params, comm::Communicator* comm, Options options);
  void BeginFinalBackward();
  absl::Status BindGrads();
  absl::Status Finish(const WaitFn& wait, std::vector<at::Tensor>* shards);
  absl::Status Rebind();
  // The AccumulateGrad post-hook of param `index` (the backward's thread).
  void OnAccumulated(int index);

  int buckets() const { return static_cast<int>(buckets_.size()); }
  int buckets_started_early() const { return last_started_early_; }
  int64_t buffer_bytes() const {
    int64_t bytes = 0;
    for (const Bucket& b : buckets_) bytes += b.flat.defined() ? b.flat.nbytes() : 0;
    return bytes;
  }

 private:
  struct Param {
    at::Tensor tensor;
    int64_t numel = 0;  // Options::numels, or the tensor's at Create
    int bucket = 0;
    int64_t offset = 0;  // elements into the bucket's flat buffer
    bool ready = false;  // its gradient is in the flat buffer for this step
    // Held so that every forward links this node (and our hook) to the parameter: autograd
    // keeps only a weak reference and makes a fresh node once no graph holds the old one.
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t hook_key = 0;
  };
  struct Bucket {
    at::TensorOptions options;  // its params' dtype and device
    at::Tensor flat;  // before `work`: a work in flight is destroyed before its buffer
    comm::Buffer buffer;
    // Options::wire_dtype: `flat` cast, what the all-reduce sums (undefined: `flat` itself).
    at::Tensor wire;
    std::vector<int> params;
    size_t bytes = 0;  // of `flat`, with reduce-scatter's padding
    int pending = 0;  // params not ready yet this step
    // Reduce-scatter mode: this rank's chunk of the sum, written by `work`. Kept here until a
    // Finish succeeds, so that a failed one leaves it alive with the reducer (see the header).
    at::Tensor out;
    std::unique_ptr<comm::Work> work;
  };

  // Copies param `index`'s gradient (zeros when undefined) into its bucket. Holds mu_.
  void MarkReady(int index);
  // Starts, in bucket order, every bucket whose params are all ready. Holds mu_.
  void LaunchReady(bool early);
  std::string Describe(int bucket) const;
  // Allocates the buckets' flat buffers (once, or every step when transient); zeroed in
  // reduce-scatter mode, whose padding is summed too.
  void AllocateBuckets();
  // Reduce-scatter mode: lays out Options::scatter_buckets.
  absl::Status LayOutScatter(const std::vector<at::Tensor>& params,
                             const std::vector<std::vector<int>>& buckets);

  comm::Communicator* comm_ = nullptr;  // null: the reducer is a no-op
  bool transient_ = false;
  bool scatter_ = false;  // reduce-scatter mode
  std::optional<at::ScalarType> wire_dtype_;  // Options::wire_dtype
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;

  std::mutex mu_;
  bool armed_ = false;     // between BeginFinalBackward and Finish
  int next_launch_ = 0;    // the first bucket not started this step
  int started_early_ = 0;  // this step's buckets started by hooks
  int last_started_early_ = 0;
  absl::Status hook_error_;  // the first error a hook met this step
  absl::Status broken_;      // the failure that broke the reducer (OK: usable)
};

namespace {

class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  AccumulatedHook(GradReducer::Impl* impl, int index) : impl_(impl), index_(index) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    impl_->OnAccumulated(index_);
    return outputs;
  }

 private:
  GradReducer::Impl* impl_;
  int index_;
};

}  // namespace

GradReducer::Impl::~Impl() {
  for (Param& p : params_) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

absl::Status GradReducer::Impl::Init(std::vector<at::Tensor> params, comm::Communicator* comm,
                                     Options options) {
  std::set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& t = params[i];
    if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat("param ", i, " is undefined"));
    if (!t.requires_grad() || !t.is_leaf()) {
      return absl::InvalidArgumentError(
          absl::StrCat("param ", i, " is not a leaf that requires grad"));
    }
    if (!seen.insert(t.unsafeGetTensorImpl()).second) {
      return absl::InvalidArgumentError(absl::StrCat("param ", i, " is passed twice"));
    }
    if (!at::isFloatingType(t.scalar_type()) || !CommDataType(t.scalar_type()).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param ", i, ": no all-reduce for gradients of dtype ", c10::toString(t.scalar_type())));
    }
    if (!t.device().is_cpu() && !t.device().is_cuda()) {
      return absl::InvalidArgumentError(
          absl::StrCat("param ", i, " is on ", t.device().str(), ", neither CPU nor CUDA"));
    }
  }
  if (!options.numels.empty() && options.numels.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(options.numels.size(), " element counts for ",
                                                   params.size(), " params"));
  }
  if (!options.scatter_buckets.empty()) {
    if (comm == nullptr) {
      return absl::InvalidArgumentError("a reduce-scatter reducer needs a group");
    }
    comm_ = comm;
    scatter_ = true;
    transient_ = true;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t numel = options.numels.empty() ? params[i].numel() : options.numels[i];
      params_.push_back({params[i], numel});
    }
    absl::Status laid = LayOutScatter(params, options.scatter_buckets);
    if (!laid.ok()) return laid;
    return Rebind();
  }
  if (comm == nullptr || comm->size() == 1) return absl::OkStatus();
  comm_ = comm;
  transient_ = options.transient;
  wire_dtype_ = options.wire_dtype;

  // Layout: reverse parameter order, one open bucket per (dtype, device), closed once full.
  params_.resize(params.size());
  std::vector<int> open;  // bucket indices still accepting params
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    const at::Tensor& t = params[i];
    const int64_t numel = options.numels.empty() ? t.numel() : options.numels[i];
    const size_t bytes = static_cast<size_t>(numel) * t.element_size();
    int b = -1;
    for (auto it = open.begin(); it != open.end(); ++it) {
      const Bucket& ob = buckets_[*it];
      if (ob.options.dtype() != t.dtype() || ob.options.device() != t.device()) continue;
      if (ob.bytes + bytes > options.bucket_bytes) {
        open.erase(it);
      } else {
        b = *it;
      }
      break;
    }
    if (b < 0) {
      b = static_cast<int>(buckets_.size());
      buckets_.emplace_back();
      buckets_[b].options = at::TensorOptions().dtype(t.dtype()).device(t.device());
      open.push_back(b);
    }
    Bucket& bucket = buckets_[b];
    params_[i].tensor = t;
    params_[i].numel = numel;
    params_[i].bucket = b;
    params_[i].offset = static_cast<int64_t>(bucket.bytes / t.element_size());
    bucket.params.push_back(i);
    bucket.bytes += bytes;
    if (bucket.bytes >= options.bucket_bytes) open.erase(std::find(open.begin(), open.end(), b));
  }
  if (!transient_) AllocateBuckets();
  return Rebind();
}

absl::Status GradReducer::Impl::LayOutScatter(const std::vector<at::Tensor>& params,
                                              const std::vector<std::vector<int>>& buckets) {
  const int n = static_cast<int>(params.size());
  std::vector<bool> placed(params.size(), false);
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("bucket ", b, " is empty"));
    }
    Bucket& bucket = buckets_.emplace_back();
    int64_t elements = 0;
    for (int i : buckets[b]) {
      if (i < 0 || i >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat("bucket ", b, " names param ", i, " of ", n));
      }
      if (placed[i]) {
        return absl::InvalidArgumentError(absl::StrCat("param ", i, " is in two buckets"));
      }
      if (bucket.params.empty()) {
        bucket.options = at::TensorOptions().dtype(params[i].dtype()).device(params[i].device());
      } else if (params[i].dtype() != bucket.options.dtype() ||
          params[i].device() != bucket.options.device()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bucket ", b, " mixes dtypes or devices (param ", i, ")"));
      }
      placed[i] = true;
      params_[i].bucket = static_cast<int>(b);
      params_[i].offset = elements;
      elements += params_[i].numel;
      bucket.params.push_back(i);
    }
    // Padded so that the group's ranks get equal chunks.
    const int64_t size = comm_->size();
    elements = (elements + size - 1) / size * size;
    bucket.bytes = static_cast<size_t>(elements) * bucket.options.dtype().itemsize();
  }
  for (int i = 0; i < n; ++i) {
    if (!placed[i]) {
      return absl::InvalidArgumentError(absl::StrCat("param ", i, " is in no bucket"));
    }
  }
  return absl::OkStatus();
}

absl::Status GradReducer::Impl::Rebind() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    std::shared_ptr<torch::autograd::Node> now = torch::autograd::impl::grad_accumulator(p.tensor);
    if (!now) {
      return absl::InternalError(absl::StrCat("param ", i, " has no gradient accumulator"));
    }
    if (now == p.accumulator) continue;
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    p.accumulator = std::move(now);
    p.hook_key = p.accumulator->add_post_hook(
        std::make_unique<AccumulatedHook>(this, static_cast<int>(i)));
  }
  return absl::OkStatus();
}

void GradReducer::Impl::AllocateBuckets() {
  for (Bucket& b : buckets_) {
    const int64_t element_size = static_cast<int64_t>(b.options.dtype().itemsize());
    const int64_t elements = static_cast<int64_t>(b.bytes) / element_size;
    b.flat = scatter_ ? at::zeros({elements}, b.options) : at::empty({elements}, b.options);
    b.buffer = *BufferOf(b.flat);  // a dtype and device Create has checked
  }
}

void GradReducer::Impl::BeginFinalBackward() {
  std::lock_guard<std::mutex> lock(mu_);
  // A second call before Finish would reset buckets whose all-reduce may be in flight.
  if (comm_ == nullptr || !broken_.ok() || armed_) return;
  // Reduce-scatter mode: BindGrads has allocated them (where a backward ran before).
  if (transient_ && (buckets_.empty() || !buckets_.front().flat.defined())) AllocateBuckets();
  for (Param& p : params_) p.ready = false;
  for (Bucket& b : buckets_) b.pending = static_cast<int>(b.params.size());
  next_launch_ = 0;
  started_early_ = 0;
  hook_error_ = absl::OkStatus();
  armed_ = true;
}

absl::Status GradReducer::Impl::BindGrads() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!scatter_ || !broken_.ok() || armed_) return absl::OkStatus();
  at::NoGradGuard no_grad;
  // Fresh buffers: a step that failed before its Finish may have left stale sums in the old.
  AllocateBuckets();
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (p.tensor.numel() != p.numel) {
      return absl::FailedPreconditionError(absl::StrCat(
          "param ", i, " has ", p.tensor.numel(), " elements, not ", p.numel));
    }
    p.tensor.mutable_grad() =
        buckets_[p.bucket].flat.narrow(0, p.offset, p.numel).view(p.tensor.sizes());
  }
  return absl::OkStatus();
}

void GradReducer::Impl::OnAccumulated(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_ || params_[index].ready || !hook_error_.ok()) return;
  // Throwing here would surface as an error of the backward, far from its cause; Finish
  // reports it instead.
  hook_error_ = TorchCall(absl::StatusCode::kInternal, "copying a gradient into its bucket", [&] {
    MarkReady(index);
    return absl::OkStatus();
  });
  if (hook_error_.ok()) LaunchReady(/*early=*/true);
}

void GradReducer::Impl::MarkReady(int index) {
  Param& p = params_[index];
  Bucket& b = buckets_[p.bucket];
  at::NoGradGuard no_grad;
  at::Tensor slot = b.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
  const at::Tensor& grad = p.tensor.grad();
  if (grad.defined() && grad.data_ptr() == slot.data_ptr() && grad.strides() == slot.strides()) {
    // Bound by BindGrads, and autograd accumulated in place: already there.
  } else if (grad.defined()) {
    slot.copy_(grad);  // any layout: copy_ follows the grad's strides
  } else {
    slot.zero_();
  }
  p.ready = true;
  --b.pending;
}

void GradReducer::Impl::LaunchReady(bool early) {
  // Strictly in bucket order: every rank must issue the group's collectives in the same order,
  // and autograd's order of parameters may differ between ranks.
  while (next_launch_ < static_cast<int>(buckets_.size()) && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    if (scatter_) {
      b.out = at::empty({b.flat.numel() / comm_->size()}, b.options);
      b.work = comm_->ReduceScatter(b.buffer, *BufferOf(b.out), {comm::ReduceOp::kSum});
    } else if (wire_dtype_ && *wire_dtype_ != b.flat.scalar_type() &&
               b.flat.is_floating_point()) {
      b.wire = b.flat.to(*wire_dtype_);
      b.work = comm_->AllReduce(*BufferOf(b.wire), {comm::ReduceOp::kSum});
    } else {
      b.work = comm_->AllReduce(b.buffer, {comm::ReduceOp::kSum});
    }
    if (early) ++started_early_;
    ++next_launch_;
  }
}

std::string GradReducer::Impl::Describe(int bucket) const {
  const Bucket& b = buckets_[bucket];
  return absl::StrCat(scatter_ ? "reduce-scattering" : "all-reducing", " gradient bucket ", bucket,
                      " of ", buckets_.size(), " (", b.params.size(), " params, #",
                      b.params.back(), "..#", b.params.front(), ", ", b.bytes, " bytes of ",
                      c10::toString(c10::typeMetaToScalarType(b.options.dtype())), ")");
}

absl::Status GradReducer::Impl::Finish(const WaitFn& wait, std::vector<at::Tensor>* shards) {
  if (scatter_ && shards == nullptr) {
    return absl::InvalidArgumentError("a reduce-scatter Finish needs somewhere for the shards");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("an earlier gradient reduction failed: ", broken_.message()));
    }
    if (comm_ == nullptr) return absl::OkStatus();
    if (!armed_) return absl::FailedPreconditionError("Finish without BeginFinalBackward");
    armed_ = false;
    absl::Status s = hook_error_;
    if (s.ok()) {
      s = TorchCall(absl::StatusCode::kInternal, "copying gradients into their buckets", [&] {
        for (size_t i = 0; i < params_.size(); ++i) {
          if (!params_[i].ready) MarkReady(static_cast<int>(i));
        }
        return absl::OkStatus();
      });
    }
    if (!s.ok()) {
      broken_ = s;
      return s;
    }
    LaunchReady(/*early=*/false);
    last_started_early_ = started_early_;
  }
  // Hooks do nothing until the next BeginFinalBackward, so the buckets are ours alone.
  for (size_t k = 0; k < buckets_.size(); ++k) {
    Bucket& b = buckets_[k];
    absl::Status s = wait(std::move(b.work), b.wire.defined() ? b.wire : b.flat,
                          Describe(static_cast<int>(k)));
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = s;
      return s;
    }
  }
  if (scatter_) {
    shards->clear();
    for (Bucket& b : buckets_) {
      shards->push_back(std::move(b.out));
      b.out = at::Tensor();
      b.flat.reset();
    }
    // The gradients were views of the flat buffers; their sums now live in the shards.
    for (Param& p : params_) p.tensor.mutable_grad().reset();
    return absl::OkStatus();
  }
  absl::Status s = TorchCall(absl::StatusCode::kInternal, "copying reduced gradients back", [&] {
    at::NoGradGuard no_grad;
    for (Bucket& b : buckets_) {
      if (!b.wire.defined()) continue;
      b.flat.copy_(b.wire);
      b.wire.reset();
    }
    for (Param& p : params_) {
      at::Tensor sum =
          buckets_[p.bucket].flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
      if (p.tensor.grad().defined()) {
        p.tensor.mutable_grad().copy_(sum);
      } else {
        // A copy: the flat buffer is reused next step.
        p.tensor.mutable_grad() = at::empty_like(p.tensor).copy_(sum);
      }
    }
    if (transient_) {
      for (Bucket& b : buckets_) b.flat.reset();
    }
    return absl::OkStatus();
  });
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = s;
  }
  return s;
}

absl::StatusOr<std::unique_ptr<GradReducer>> GradReducer::Create(std::vector<at::Tensor> params,
                                                                 comm::Communicator* comm,
                                                                 Options options) {
  auto impl = std::make_unique<Impl>();
  absl::Status s = TorchCall(absl::StatusCode::kInternal, "creating the gradient reducer", [&] {
    return impl->Init(std::move(params), comm, options);
  });
  if (!s.ok()) return s;
  return std::unique_ptr<GradReducer>(new GradReducer(std::move(impl)));
}

GradReducer::GradReducer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GradReducer::~GradReducer() = default;

void GradReducer::BeginFinalBackward() { impl_->BeginFinalBackward(); }
absl::Status GradReducer::Finish(const WaitFn& wait, std::vector<at::Tensor>* shards) {
  return impl_->Finish(wait, shards);
}
absl::Status GradReducer::BindGrads() {
  return TorchCall(absl::StatusCode::kInternal, "binding gradients to their buckets",
                   [&] { return impl_->BindGrads(); });
}
int GradReducer::buckets() const { return impl_->buckets(); }
int GradReducer::buckets_started_early() const { return impl_->buckets_started_early(); }
int64_t GradReducer::buffer_bytes() const { return impl_->buffer_bytes(); }
absl::Status GradReducer::Rebind() {
  return TorchCall(absl::StatusCode::kInternal, "hooking the gradient accumulators",
                   [&] { return impl_->Rebind(); });
}

}  // namespace rannc
