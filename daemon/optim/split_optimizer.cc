#include "daemon/optim/split_optimizer.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "daemon/optim/optimizer_internal.h"

namespace rannc {
namespace {

// A part's LoadNamedState error with the param it names ("... of param 3 lacks ...", numbered
// across the part's groups) renumbered across all the groups.
absl::Status Renumbered(const absl::Status& status, const std::vector<int64_t>& index_of) {
  const std::string message(status.message());
  const std::string word = "param ";
  std::string out;
  size_t from = 0;
  for (size_t at = message.find(word); at != std::string::npos; at = message.find(word, from)) {
    size_t end = at + word.size();
    while (end < message.size() && std::isdigit(static_cast<unsigned char>(message[end]))) ++end;
    out += message.substr(from, at + word.size() - from);
    const std::string digits = message.substr(at + word.size(), end - at - word.size());
    const size_t local =
        digits.empty() || digits.size() > 18 ? index_of.size() : std::stoull(digits);
    out += local < index_of.size() ? std::to_string(index_of[local]) : digits;
    from = end;
  }
  out += message.substr(from);
  return absl::Status(status.code(), out);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SplitOptimizer>> SplitOptimizer::Make(
    OptimizerKind kind, std::vector<ParamGroup> groups,
    const std::vector<std::vector<int>>& part_of, int parts,
    std::shared_ptr<const ScriptedUpdate> scripted) {
  absl::Status checked = optim_internal::CheckGroups(kind, groups);
  if (!checked.ok()) return checked;
  if (parts < 1 || part_of.size() != groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a split optimizer of ", parts, " parts got ",
                                                   part_of.size(), " groups of parts for ",
                                                   groups.size(), " param groups"));
  }
  std::unique_ptr<SplitOptimizer> split(new SplitOptimizer());
  split->kind_ = kind;
  split->index_of_.resize(parts);
  std::vector<std::vector<ParamGroup>> part_groups(parts);
  for (auto& pg : part_groups) pg.resize(groups.size());
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (part_of[g].size() != groups[g].params.size()) {
      return absl::InvalidArgumentError(absl::StrCat("param group ", g, " has ",
                                                     groups[g].params.size(), " params but ",
                                                     part_of[g].size(), " parts given"));
    }
    for (int p = 0; p < parts; ++p) part_groups[p][g].hyper = groups[g].hyper;
    for (size_t i = 0; i < groups[g].params.size(); ++i, ++index) {
      const int p = part_of[g][i];
      if (p < 0 || p >= parts) {
        return absl::InvalidArgumentError(absl::StrCat("param group ", g, ", param ", i,
                                                       ": part ", p, " of ", parts));
      }
      split->where_.emplace_back(p, static_cast<int64_t>(split->index_of_[p].size()));
      split->index_of_[p].push_back(index);
      part_groups[p][g].params.push_back(groups[g].params[i]);
    }
  }
  for (int p = 0; p < parts; ++p) {
    absl::StatusOr<std::unique_ptr<Optimizer>> part =
        MakeOptimizer(kind, std::move(part_groups[p]), scripted);
    if (!part.ok()) return part.status();  // the checks above passed: not a param's error
    split->parts_.push_back(std::move(*part));
  }
  split->keys_ = kind == OptimizerKind::kScripted ? scripted->state_keys
                                                  : OptimizerStateKeys(kind);
  split->groups_ = std::move(groups);
  return split;
}

absl::Status SplitOptimizer::StepPart(int part, const std::vector<HyperParams>& hypers) {
  return parts_[part]->Step(hypers);
}

absl::Status SplitOptimizer::Step(const std::vector<HyperParams>& hypers) {
  absl::Status checked = optim_internal::CheckStepArgs(kind_, groups_, hypers);
  if (!checked.ok()) return checked;
  for (size_t p = 0; p < parts_.size(); ++p) {
    // The arguments passed above: what fails here is LibTorch's (out of memory, or a scripted
    // update's own error), which names no param.
    absl::Status stepped = parts_[p]->Step(hypers);
    if (!stepped.ok()) return stepped;
  }
  return absl::OkStatus();
}

int64_t SplitOptimizer::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& part : parts_) bytes += part->StateBytes();
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> SplitOptimizer::NamedState() const {
  // A part lists its params in its own order, which is theirs across the groups: one stable sort
  // by param merges the parts and keeps each param's keys in their order.
  std::vector<std::pair<int64_t, std::pair<std::string, at::Tensor>>> all;
  for (size_t p = 0; p < parts_.size(); ++p) {
    for (auto& [name, value] : parts_[p]->NamedState()) {
      const size_t dot = name.find('.');
      const int64_t index = index_of_[p][std::stoll(name.substr(0, dot))];
      all.push_back({index, {absl::StrCat(index, name.substr(dot)), std::move(value)}});
    }
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<std::string, at::Tensor>> named;
  named.reserve(all.size());
  for (auto& entry : all) named.push_back(std::move(entry.second));
  return named;
}

absl::Status SplitOptimizer::LoadNamedState(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::vector<int64_t> first_of_group;  // the number of each group's first param
  int64_t count = 0;
  for (const ParamGroup& group : groups_) {
    first_of_group.push_back(count);
    count += static_cast<int64_t>(group.params.size());
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> split(parts_.size());
  for (const auto& [name, value] : state) {
    absl::StatusOr<optim_internal::StateEntryRef> ref =
        optim_internal::ParseStateEntry(groups_, name, value, keys_);
    if (!ref.ok()) return ref.status();
    const auto [part, local] =
        where_[first_of_group[ref->group] + static_cast<int64_t>(ref->param)];
    split[part].emplace_back(absl::StrCat(local, ".", ref->key), value);
  }
  // The state replaced so far (each part loads copies, so these are the old tensors), loaded
  // back if a later part refuses its entries.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> before;
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (p + 1 < parts_.size()) before.push_back(parts_[p]->NamedState());
    absl::Status loaded = parts_[p]->LoadNamedState(split[p]);
    if (loaded.ok()) continue;
    for (size_t q = 0; q < p; ++q) {
      absl::Status back = parts_[q]->LoadNamedState(before[q]);
      if (!back.ok()) return back;  // only a failure of LibTorch's (out of memory) comes here
    }
    return Renumbered(loaded, index_of_[p]);
  }
  return absl::OkStatus();
}

}  // namespace rannc
