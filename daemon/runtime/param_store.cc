#include "daemon/runtime/param_store.h"

#include <limits>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status.h"
#include "daemon/common/tensor_codec.h"

namespace rannc {
namespace {

// Tied weights may come back from torch.jit.load as two tensor objects over one storage; both
// must map to one leaf, so identity is the storage region, not the TensorImpl.
std::string IdentityKey(const at::Tensor& t) {
  return absl::StrCat(reinterpret_cast<uintptr_t>(t.storage().data()), ":", t.storage_offset(),
                      ":", absl::StrJoin(t.sizes(), ","), ":", absl::StrJoin(t.strides(), ","),
                      ":", static_cast<int>(t.scalar_type()));
}

std::string ListNames(const std::vector<std::string>& names) {
  const size_t shown = std::min<size_t>(names.size(), 10);
  std::string out = absl::StrJoin(names.begin(), names.begin() + shown, ", ");
  if (names.size() > shown) absl::StrAppend(&out, ", ... (", names.size(), " in all)");
  return out;
}

}  // namespace

ParamStore ParamStore::FromModuleTensors(const std::vector<ModuleTensor>& tensors) {
  ParamStore store;
  std::unordered_map<std::string, size_t> by_identity;
  // Parameters first so that a parameter's canonical name is its named_parameters() name.
  for (int pass = 0; pass < 2; ++pass) {
    for (const ModuleTensor& t : tensors) {
      if (t.is_parameter != (pass == 0)) continue;
      const std::string key = IdentityKey(t.tensor);
      auto found = by_identity.find(key);
      if (found != by_identity.end()) {
        store.entries_[found->second].aliases.push_back(t.name);
        store.index_[t.name] = found->second;
        continue;
      }
      Entry entry;
      entry.name = t.name;
      entry.is_parameter = t.is_parameter;
      entry.tensor = t.tensor.detach();
      // A frozen parameter (requires_grad=False) stays frozen, as in PyTorch.
      entry.tensor.set_requires_grad(t.is_parameter && t.tensor.requires_grad());
      by_identity[key] = store.entries_.size();
      store.index_[t.name] = store.entries_.size();
      store.entries_.push_back(std::move(entry));
    }
  }
  for (const ModuleTensor& t : tensors) store.state_keys_.push_back(t.name);
  return store;
}

const ParamStore::Entry* ParamStore::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::vector<at::Tensor> ParamStore::Parameters() const {
  std::vector<at::Tensor> params;
  for (const Entry& e : entries_) {
    if (e.is_parameter) params.push_back(e.tensor);
  }
  return params;
}

int64_t ParamStore::NumParameterElements() const {
  int64_t n = 0;
  for (const Entry& e : entries_) {
    if (e.is_parameter) n += e.tensor.numel();
  }
  return n;
}

absl::Status ParamStore::Load(const std::map<std::string, at::Tensor>& state, bool strict,
                              std::vector<std::string>* missing,
                              std::vector<std::string>* unexpected) {
  missing->clear();
  unexpected->clear();
  for (const std::string& key : state_keys_) {
    if (state.find(key) == state.end()) missing->push_back(key);
  }
  std::vector<std::string> mismatched;
  for (const auto& [key, value] : state) {
    const Entry* entry = Find(key);
    if (entry == nullptr) {
      unexpected->push_back(key);
    } else if (!value.sizes().equals(entry->tensor.sizes())) {
      mismatched.push_back(absl::StrCat(
          "size mismatch for ", key, ": copying a tensor of shape [",
          absl::StrJoin(value.sizes(), ", "), "] from the state_dict, the shape in the model is [",
          absl::StrJoin(entry->tensor.sizes(), ", "), "]"));
    }
  }
  if (!mismatched.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_state_dict: ", absl::StrJoin(mismatched, "; ")));
  }
  if (strict && (!missing->empty() || !unexpected->empty())) {
    std::string message = "load_state_dict (strict):";
    if (!missing->empty()) absl::StrAppend(&message, " missing keys: ", ListNames(*missing), ".");
    if (!unexpected->empty()) {
      absl::StrAppend(&message, " unexpected keys: ", ListNames(*unexpected), ".");
    }
    absl::StrAppend(&message, " Pass strict=False to load a partial state_dict.");
    return absl::InvalidArgumentError(message);
  }
  return TorchCall(absl::StatusCode::kInvalidArgument, "load_state_dict", [&] {
    at::NoGradGuard no_grad;
    for (const auto& [key, value] : state) {
      auto it = index_.find(key);
      if (it == index_.end()) continue;
      Restore(it->second);
      entries_[it->second].tensor.copy_(value);
    }
    return absl::OkStatus();
  });
}

void ParamStore::Drop(size_t entry) {
  Entry& e = entries_[entry];
  if (e.dropped) return;
  at::NoGradGuard no_grad;
  const std::vector<int64_t> sizes = e.tensor.sizes().vec();
  const at::Tensor one = at::empty({1}, e.tensor.options());
  if (at::isFloatingType(one.scalar_type()) || at::isComplexType(one.scalar_type())) {
    one.fill_(std::numeric_limits<double>::quiet_NaN());
  } else {
    one.zero_();
  }
  e.tensor.set_(one.storage(), /*storage_offset=*/0, sizes,
                std::vector<int64_t>(sizes.size(), 0));
  e.dropped = true;
}

void ParamStore::Restore(size_t entry) {
  Entry& e = entries_[entry];
  if (!e.dropped) return;
  at::NoGradGuard no_grad;
  e.tensor.set_(at::empty(e.tensor.sizes().vec(), e.tensor.options()));
  e.dropped = false;
}

}  // namespace rannc
