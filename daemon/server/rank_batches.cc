#include "daemon/server/rank_batches.h"

#include <algorithm>
#include <map>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/status.h"

namespace rannc {
namespace {

int BatchDim(const std::vector<int>& batch_dims, size_t i) {
  return i < batch_dims.size() ? batch_dims[i] : -1;
}

}  // namespace

absl::StatusOr<std::vector<at::Tensor>> GatherRankInputs(
    const std::vector<std::vector<at::Tensor>>& all, std::vector<int64_t>* rows) {
  const int world = static_cast<int>(all.size());
  std::vector<at::Tensor> gathered;
  rows->assign(world, 0);
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "gathering inputs", [&] {
    for (size_t j = 0; j < all[0].size(); ++j) {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world; ++r) {
        if (all[r].size() != all[0].size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "client rank ", r, " passed ", all[r].size(), " inputs, rank 0 ", all[0].size()));
        }
        parts.push_back(all[r][j]);
        if (j == 0) (*rows)[r] = all[r][j].dim() > 0 ? all[r][j].size(0) : 0;
      }
      gathered.push_back(at::cat(parts, 0));
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return gathered;
}

std::vector<std::vector<at::Tensor>> SplitRankOutputs(const std::vector<at::Tensor>& outputs,
                                                      const std::vector<int>& batch_dims,
                                                      const std::vector<int64_t>& rows) {
  const int world = static_cast<int>(rows.size());
  int64_t total = 0;
  for (int64_t n : rows) total += n;
  std::vector<std::vector<at::Tensor>> shares(world);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& o = outputs[i];
    const int bd = BatchDim(batch_dims, i);
    const bool batched = bd >= 0 && bd < o.dim() && total > 0 && o.size(bd) % total == 0;
    int64_t offset = 0;
    for (int r = 0; r < world; ++r) {
      if (!batched) {
        shares[r].push_back(o);
        continue;
      }
      const int64_t per_sample = o.size(bd) / total;
      shares[r].push_back(o.narrow(bd, offset * per_sample, rows[r] * per_sample).contiguous());
      offset += rows[r];
    }
  }
  return shares;
}

absl::StatusOr<OutputGrads> CombineRankGrads(const std::vector<OutputGrads>& all,
                                             const std::vector<int>& batch_dims,
                                             const std::vector<int64_t>& rows) {
  const int world = static_cast<int>(all.size());
  std::map<size_t, std::vector<at::Tensor>> by_output;  // output -> per rank (maybe undefined)
  for (int r = 0; r < world; ++r) {
    for (const auto& [index, grad] : all[r]) {
      std::vector<at::Tensor>& slot = by_output[index];
      slot.resize(world);
      slot[r] = grad;
    }
  }
  OutputGrads combined;
  absl::Status status = TorchCall(absl::StatusCode::kInvalidArgument, "combining gradients",
                                  [&] {
    for (auto& [index, grads] : by_output) {
      const int bd = BatchDim(batch_dims, index);
      at::Tensor any;
      int any_rank = 0;
      for (int r = 0; r < world; ++r) {
        if (grads[r].defined()) {
          any = grads[r];
          any_rank = r;
        }
      }
      if (bd >= 0 && rows.size() == grads.size()) {
        // Each rank's rows, in rank order; a rank that sent none contributes zeros.
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r) {
          if (grads[r].defined()) {
            parts.push_back(grads[r]);
          } else {
            std::vector<int64_t> shape = any.sizes().vec();
            shape[bd] = any.size(bd) / std::max<int64_t>(rows[any_rank], 1) * rows[r];
            parts.push_back(at::zeros(shape, any.options()));
          }
        }
        combined.emplace_back(index, at::cat(parts, bd));
      } else {
        at::Tensor sum;
        int n = 0;
        for (const at::Tensor& g : grads) {
          if (!g.defined()) continue;
          sum = sum.defined() ? sum + g : g.clone();
          ++n;
        }
        combined.emplace_back(index, sum / n);
      }
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return combined;
}

}  // namespace rannc
