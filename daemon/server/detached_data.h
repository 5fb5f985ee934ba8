// The data a detached job reads itself (DetachedJobSpec), batch after batch:
//  - token windows: `batch` random windows of seq + 1 tokens of a token file
//    (daemon/common/token_file.h), inputs and next-token targets, the starts drawn as
//    torch.randint(0, n - seq, (batch,), generator) from one generator seeded with the job's
//    seed (evaluation: a generator seeded with seed + 1, again at each evaluation);
//  - a tensor dataset: a file torch.save wrote of a tuple or list of tensors (or a dict of them:
//    the keys name the model's inputs) with one sample per row, in batches of `batch` rows,
//    shuffled per epoch: epoch e takes its rows in the order of the e-th
//    torch.randperm(n, generator=g) of one g = torch.Generator().manual_seed(seed), batch after
//    batch, the rows left over (fewer than a batch) dropped (evaluation: in order, from the
//    first row, again at each evaluation). (DataLoader(shuffle=True, generator=g) draws more
//    from g than that: a worker seed per epoch, and PyTorch 1.13 one more permutation at each
//    epoch's end.)
// A BatchPrefetcher draws the next batches on a thread of its own while the job trains.
//
//   absl::StatusOr<std::unique_ptr<BatchSource>> train = OpenTrainingData(spec);
//   (*train)->Skip(resumed_steps);          // a resumed job sees the batches it would have
//   BatchPrefetcher next(std::move(*train));
//   std::vector<at::Tensor> batch = next.Next();
#ifndef RANNC_DAEMON_SERVER_DETACHED_DATA_H_
#define RANNC_DAEMON_SERVER_DETACHED_DATA_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "rannc/v1/training.pb.h"

namespace rannc {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The next batch: the model's inputs, in order.
  virtual std::vector<at::Tensor> Next() = 0;
  // Advances past `n` batches without making them.
  virtual void Skip(int64_t n) = 0;
  // Back to the first batch (evaluation, before each).
  virtual void Reset() = 0;
  // The model's input names, one per tensor of a batch.
  virtual std::vector<std::string> InputNames() const = 0;
  // The elements of a batch's first tensor (tokens, for token data): what tokens/s counts.
  virtual int64_t TokensPerBatch() const = 0;
  // For logs: "train.bin (1000000 tokens)", "data.pt (60000 samples)".
  virtual std::string Describe() const = 0;
  // OK when every value the data gives input `input` (all of it, not one batch) is in
  // [0, limit) or equals `ignore`; else INVALID_ARGUMENT naming the field, the value, where it
  // is and `what` it indexes. Floating inputs index nothing: OK.
  virtual absl::Status CheckRange(int input, int64_t limit, std::optional<int64_t> ignore,
                                  const std::string& what) const = 0;
};

// The training data: `spec.tokens_path` or `spec.dataset_path` (exactly one). NOT_FOUND for a
// file that does not open; INVALID_ARGUMENT naming the field for data that is not what it says
// (a dataset that is no tuple, list or dict of tensors, rows that differ in number, fewer
// samples or tokens than one batch).
absl::StatusOr<std::unique_ptr<BatchSource>> OpenTrainingData(const v1::DetachedJobSpec& spec);
// The held-out data (eval_tokens_path or eval_dataset_path, the kind the training data is);
// null when the spec has none. A dataset's tensors must match the training set's in number,
// dtype and per-sample shape.
absl::StatusOr<std::unique_ptr<BatchSource>> OpenEvalData(const v1::DetachedJobSpec& spec,
                                                          const BatchSource& training);
// Evaluation's batches per evaluation: eval_batches, at most what a held-out dataset holds.
int64_t EvalBatches(const v1::DetachedJobSpec& spec, const BatchSource& eval);

// Draws `source`'s batches on a thread of its own, `depth` ahead of the caller; the order is
// the source's. The destructor stops the thread.
class BatchPrefetcher {
 public:
  explicit BatchPrefetcher(std::unique_ptr<BatchSource> source, size_t depth = 2);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  std::vector<at::Tensor> Next();

 private:
  void Run();

  std::unique_ptr<BatchSource> source_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<std::vector<at::Tensor>> ready_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is constructed
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_DETACHED_DATA_H_
