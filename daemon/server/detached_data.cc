#include "daemon/server/detached_data.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/common/files.h"
#include "daemon/common/status.h"
#include "daemon/common/token_file.h"
#include "daemon/common/torch_archive.h"

namespace rannc {
namespace {

class TokenWindows : public BatchSource {
 public:
  TokenWindows(TokenFile tokens, std::string field, std::string path, int64_t batch,
               int64_t seq, uint64_t seed)
      : tokens_(std::move(tokens)), field_(std::move(field)), path_(std::move(path)),
        batch_(batch), seq_(seq), seed_(seed),
        gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  std::vector<at::Tensor> Next() override {
    const at::Tensor starts = Starts();
    at::Tensor x = at::empty({batch_, seq_}, at::kLong);
    at::Tensor y = at::empty({batch_, seq_}, at::kLong);
    int64_t* xp = x.data_ptr<int64_t>();
    int64_t* yp = y.data_ptr<int64_t>();
    const int64_t* sp = starts.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch_; ++b) {
      for (int64_t t = 0; t < seq_; ++t) {
        xp[b * seq_ + t] = tokens_.at(static_cast<size_t>(sp[b] + t));
        yp[b * seq_ + t] = tokens_.at(static_cast<size_t>(sp[b] + t + 1));
      }
    }
    return {x, y};
  }
  void Skip(int64_t n) override {
    for (int64_t i = 0; i < n; ++i) (void)Starts();
  }
  void Reset() override { gen_ = at::make_generator<at::CPUGeneratorImpl>(seed_); }
  std::vector<std::string> InputNames() const override { return {"input_ids", "targets"}; }
  int64_t TokensPerBatch() const override { return batch_ * seq_; }
  std::string Describe() const override {
    return absl::StrCat(path_, " (", tokens_.size(), " tokens)");
  }
  absl::Status CheckRange(int input, int64_t limit, std::optional<int64_t> ignore,
                          const std::string& what) const override {
    if (input > 1) return absl::OkStatus();  // inputs and targets are both the file's ids
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const int64_t v = tokens_.at(i);
      if ((v < 0 || v >= limit) && (!ignore || v != *ignore)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field_, ": ", path_, " holds token id ", v, " at position ", i, ", outside ", what,
            " (ids in [0, ", limit, "))"));
      }
    }
    return absl::OkStatus();
  }

 private:
  at::Tensor Starts() {
    return at::randint(0, static_cast<int64_t>(tokens_.size()) - seq_, {batch_}, gen_);
  }

  TokenFile tokens_;
  std::string field_, path_;
  int64_t batch_, seq_;
  uint64_t seed_;
  at::Generator gen_;
};

class TensorDataset : public BatchSource {
 public:
  TensorDataset(std::vector<at::Tensor> tensors, std::vector<std::string> names,
                std::string field, std::string path, int64_t batch, uint64_t seed, bool shuffle)
      : tensors_(std::move(tensors)), names_(std::move(names)), field_(std::move(field)),
        path_(std::move(path)), batch_(batch), seed_(seed), shuffle_(shuffle) {
    Reset();
  }

  std::vector<at::Tensor> Next() override {
    const at::Tensor rows = Rows();
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : tensors_) out.push_back(t.index_select(0, rows));
    return out;
  }
  void Skip(int64_t n) override {
    for (int64_t i = 0; i < n; ++i) (void)Rows();
  }
  void Reset() override {
    gen_ = at::make_generator<at::CPUGeneratorImpl>(seed_);
    order_ = at::Tensor();
    next_ = 0;
  }
  std::vector<std::string> InputNames() const override { return names_; }
  int64_t TokensPerBatch() const override {
    return batch_ * (tensors_[0].numel() / std::max<int64_t>(1, samples()));
  }
  std::string Describe() const override {
    return absl::StrCat(path_, " (", samples(), " samples)");
  }
  absl::Status CheckRange(int input, int64_t limit, std::optional<int64_t> ignore,
                          const std::string& what) const override {
    if (input >= static_cast<int>(tensors_.size())) return absl::OkStatus();
    const at::Tensor& t = tensors_[input];
    if (at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool) {
      return absl::OkStatus();
    }
    at::Tensor bad = t.lt(0).logical_or(t.ge(limit));
    if (ignore) bad = bad.logical_and(t.ne(*ignore));
    if (!bad.any().item<bool>()) return absl::OkStatus();
    const int64_t flat = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
    const int64_t value = t.reshape(-1)[flat].item<int64_t>();
    const int64_t row = flat / std::max<int64_t>(1, t.numel() / t.size(0));
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", path_, "'s '", names_[input], "' holds ", value, " in sample ", row,
        ", outside ", what, " (values in [0, ", limit, "))"));
  }

  int64_t samples() const { return tensors_[0].size(0); }
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  // The next batch's rows: an epoch is the whole batches of one order (drop_last), a new one
  // drawn at its start.
  at::Tensor Rows() {
    if (!order_.defined() || next_ + batch_ > samples()) {
      order_ = shuffle_ ? at::randperm(samples(), gen_) : at::arange(samples(), at::kLong);
      next_ = 0;
    }
    at::Tensor rows = order_.narrow(0, next_, batch_);
    next_ += batch_;
    return rows;
  }

  std::vector<at::Tensor> tensors_;
  std::vector<std::string> names_;
  std::string field_, path_;
  int64_t batch_;
  uint64_t seed_;
  bool shuffle_;
  at::Generator gen_;
  at::Tensor order_;
  int64_t next_ = 0;
};

absl::StatusOr<std::unique_ptr<BatchSource>> OpenTokens(const std::string& field,
                                                        const std::string& path,
                                                        const v1::DetachedJobSpec& spec,
                                                        uint64_t seed) {
  const std::string dtype = spec.token_dtype().empty() ? "uint16" : spec.token_dtype();
  if (spec.seq() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq (", spec.seq(), ") must be positive"));
  }
  absl::StatusOr<TokenFile> tokens = TokenFile::Open(path, dtype);
  if (!tokens.ok()) return Annotate(tokens.status(), field);
  if (tokens->size() < static_cast<size_t>(spec.seq()) + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s holds %d tokens; seq %d needs at least %d", field, path, tokens->size(),
        spec.seq(), spec.seq() + 1));
  }
  return std::unique_ptr<BatchSource>(
      new TokenWindows(std::move(*tokens), field, path, spec.batch(), spec.seq(), seed));
}

absl::StatusOr<std::unique_ptr<TensorDataset>> OpenDataset(const std::string& field,
                                                           const std::string& path,
                                                           const v1::DetachedJobSpec& spec,
                                                           bool shuffle) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) return Annotate(bytes.status(), field);
  std::vector<at::Tensor> tensors;
  std::vector<std::string> names;
  auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, " ", why, "; a dataset is what torch.save wrote of a tuple, list or "
        "dict of tensors with one sample per row"));
  };
  // Sizes the file states, checked before LibTorch allocates them.
  if (absl::Status checked = CheckTorchArchive(*bytes, absl::StrCat(field, ": ", path));
      !checked.ok()) {
    return checked;
  }
  try {
    const c10::IValue value =
        torch::jit::pickle_load(std::vector<char>(bytes->begin(), bytes->end()));
    if (value.isTuple() || value.isList()) {
      const std::vector<c10::IValue> items =
          value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec();
      for (size_t i = 0; i < items.size(); ++i) {
        if (!items[i].isTensor()) return invalid(absl::StrCat("holds a non-tensor at ", i));
        tensors.push_back(items[i].toTensor());
        names.push_back(absl::StrCat("input_", i));
      }
    } else if (value.isGenericDict()) {
      for (const auto& item : value.toGenericDict()) {
        if (!item.key().isString() || !item.value().isTensor()) {
          return invalid("holds a dict entry that is not a name and a tensor");
        }
        names.push_back(item.key().toStringRef());
        tensors.push_back(item.value().toTensor());
      }
    } else {
      return invalid(absl::StrCat("holds a ", value.tagKind()));
    }
  } catch (const std::exception& e) {
    return invalid(absl::StrCat("does not load (", e.what(), ")"));
  }
  if (tensors.empty()) return invalid("holds no tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].dim() == 0 || tensors[i].size(0) != tensors[0].size(0)) {
      return invalid(absl::StrCat("has tensor '", names[i], "' of shape ",
                                  c10::str(tensors[i].sizes()), ", not one row per sample of ",
                                  tensors[0].size(0)));
    }
    tensors[i] = tensors[i].contiguous();
  }
  if (tensors[0].size(0) < spec.batch()) {
    return invalid(absl::StrCat("holds ", tensors[0].size(0), " samples, fewer than a batch (",
                                spec.batch(), ")"));
  }
  return std::make_unique<TensorDataset>(std::move(tensors), std::move(names), field, path,
                                         spec.batch(), spec.seed(), shuffle);
}

}  // namespace

absl::StatusOr<std::unique_ptr<BatchSource>> OpenTrainingData(const v1::DetachedJobSpec& spec) {
  const bool tokens = !spec.tokens_path().empty(), dataset = !spec.dataset_path().empty();
  if (tokens == dataset) {
    return absl::InvalidArgumentError(
        "name the training data: tokens (a token file) or dataset (a torch.save file of "
        "tensors), one of them");
  }
  if (tokens) return OpenTokens("tokens", spec.tokens_path(), spec, spec.seed());
  absl::StatusOr<std::unique_ptr<TensorDataset>> data =
      OpenDataset("dataset", spec.dataset_path(), spec, /*shuffle=*/true);
  if (!data.ok()) return data.status();
  return std::unique_ptr<BatchSource>(std::move(*data));
}

absl::StatusOr<std::unique_ptr<BatchSource>> OpenEvalData(const v1::DetachedJobSpec& spec,
                                                          const BatchSource& training) {
  const bool tokens = !spec.eval_tokens_path().empty();
  const bool dataset = !spec.eval_dataset_path().empty();
  if (!tokens && !dataset) return std::unique_ptr<BatchSource>();
  if (tokens != spec.dataset_path().empty() || tokens == dataset) {
    return absl::InvalidArgumentError(
        "the held-out data is of the training data's kind: eval_tokens with tokens, "
        "eval_dataset with dataset");
  }
  if (tokens) return OpenTokens("eval_tokens", spec.eval_tokens_path(), spec, spec.seed() + 1);
  absl::StatusOr<std::unique_ptr<TensorDataset>> eval =
      OpenDataset("eval_dataset", spec.eval_dataset_path(), spec, /*shuffle=*/false);
  if (!eval.ok()) return eval.status();
  const auto& train = static_cast<const TensorDataset&>(training).tensors();
  const std::vector<at::Tensor>& held = (*eval)->tensors();
  const std::vector<std::string> names = (*eval)->InputNames();
  bool same = held.size() == train.size() && names == training.InputNames();
  for (size_t i = 0; same && i < held.size(); ++i) {
    same = held[i].scalar_type() == train[i].scalar_type() &&
           held[i].sizes().slice(1).equals(train[i].sizes().slice(1));
  }
  if (!same) {
    auto describe = [](const std::vector<at::Tensor>& ts) {
      std::vector<std::string> out;
      for (const at::Tensor& t : ts) {
        out.push_back(absl::StrCat(c10::toString(t.scalar_type()), c10::str(t.sizes().slice(1))));
      }
      return absl::StrJoin(out, ", ");
    };
    return absl::InvalidArgumentError(absl::StrCat(
        "eval_dataset: ", spec.eval_dataset_path(), "'s samples (", describe(held),
        ") are not the dataset's (", describe(train), ")"));
  }
  return std::unique_ptr<BatchSource>(std::move(*eval));
}

int64_t EvalBatches(const v1::DetachedJobSpec& spec, const BatchSource& eval) {
  if (spec.eval_dataset_path().empty()) return spec.eval_batches();
  const int64_t whole = static_cast<const TensorDataset&>(eval).samples() / spec.batch();
  return std::min<int64_t>(spec.eval_batches(), whole);
}

BatchPrefetcher::BatchPrefetcher(std::unique_ptr<BatchSource> source, size_t depth)
    : source_(std::move(source)), depth_(std::max<size_t>(1, depth)),
      thread_([this] { Run(); }) {}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void BatchPrefetcher::Run() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return stop_ || ready_.size() < depth_; });
      if (stop_) return;
    }
    std::vector<at::Tensor> batch = source_->Next();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(batch));
    }
    changed_.notify_all();
  }
}

std::vector<at::Tensor> BatchPrefetcher::Next() {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return !ready_.empty(); });
  std::vector<at::Tensor> batch = std::move(ready_.front());
  ready_.pop_front();
  changed_.notify_all();
  return batch;
}

}  // namespace rannc
