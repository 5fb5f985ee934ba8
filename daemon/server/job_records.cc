#include "daemon/server/job_records.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>

#include <ATen/core/Dict.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "daemon/checkpoint/checkpoint.h"
#include "daemon/common/files.h"

namespace rannc {


namespace {

constexpr char kRecord[] = "record.json";
constexpr char kModel[] = "model.pt";
constexpr char kTensors[] = "tensors.pt";

}  // namespace

JobRecords::JobRecords(std::string state_dir)
    : dir_(state_dir.empty() ? "" : JoinPath(state_dir, "jobs")) {}

JobRecords::~JobRecords() { WaitForSaves(); }

void JobRecords::SaveInBackground(std::string job_id, v1::JobSpec spec, std::string model_bytes,
                                  std::vector<at::Tensor> example_inputs, SentTensors sent,
                                  v1::Deployment plan) {
  if (!enabled()) return;
  std::shared_future<void> done =
      std::async(std::launch::async, [this, job_id = std::move(job_id), spec = std::move(spec),
                                      model_bytes = std::move(model_bytes),
                                      example_inputs = std::move(example_inputs),
                                      sent = std::move(sent), plan = std::move(plan)] {
        absl::Status saved = Save(job_id, spec, model_bytes, example_inputs, sent, plan);
        if (!saved.ok()) {
          spdlog::warn("job {} runs, but is not durable: its record was not written: {}", job_id,
                       saved.ToString());
        }
      }).share();
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_.push_back(std::move(done));
}

void JobRecords::WaitForSaves() const {
  std::vector<std::shared_future<void>> pending;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending = pending_;
  }
  for (const std::shared_future<void>& f : pending) f.wait();
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [](const std::shared_future<void>& f) {
                                  return f.wait_for(std::chrono::seconds(0)) ==
                                         std::future_status::ready;
                                }),
                 pending_.end());
}

std::string JobRecords::JobDir(const std::string& job_id) const {
  return JoinPath(dir_, job_id);
}

absl::Status JobRecords::Save(const std::string& job_id, const v1::JobSpec& spec,
                              const std::string& model_bytes,
                              const std::vector<at::Tensor>& example_inputs,
                              const SentTensors& sent, const v1::Deployment& plan) {
  if (!enabled()) return absl::OkStatus();
  v1::JobRecord record;
  record.set_job_id(job_id);
  record.set_name(spec.name());
  *record.mutable_spec() = spec;
  record.mutable_spec()->clear_example_inputs();
  record.mutable_spec()->clear_model_tensors();
  *record.mutable_deployment() = plan;
  record.set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch()).count());
  c10::Dict<std::string, at::Tensor> tensors;
  for (size_t i = 0; i < example_inputs.size(); ++i) {
    const std::string key = absl::StrCat("input/", i);
    tensors.insert(key, example_inputs[i].contiguous());
    record.add_input_keys(key);
  }
  for (const auto& [name, tensor] : sent) {
    tensors.insert(absl::StrCat("sent/", name), tensor.contiguous());
    record.add_sent_names(name);
  }
  absl::StatusOr<std::string> json = checkpoint::ToJson(record);
  if (!json.ok()) return json.status();
  std::vector<char> tensor_bytes;
  try {
    tensor_bytes = torch::jit::pickle_save(c10::IValue(tensors));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("writing job ", job_id, "'s tensors: ", e.what()));
  }

  std::lock_guard<std::mutex> lock(mu_);
  absl::Status made = MakeDirs(dir_);
  if (!made.ok()) return made;
  const std::string tmp = absl::StrCat(JobDir(job_id), ".tmp-", ::getpid());
  (void)RemoveTree(tmp);  // a leftover of a failed write
  made = MakeDirs(tmp);
  if (!made.ok()) return made;
  absl::Status s = WriteFileDurably(absl::StrCat(tmp, "/", kModel), model_bytes.data(),
                                    model_bytes.size());
  if (s.ok()) {
    s = WriteFileDurably(absl::StrCat(tmp, "/", kTensors), tensor_bytes.data(),
                         tensor_bytes.size());
  }
  if (s.ok()) s = WriteFileDurably(absl::StrCat(tmp, "/", kRecord), json->data(), json->size());
  if (s.ok()) s = SyncDirectory(tmp);
  if (s.ok()) {
    s = RemoveTree(JobDir(job_id));
    if (s.ok() && std::rename(tmp.c_str(), JobDir(job_id).c_str()) != 0) {
      s = ErrnoStatus(errno, absl::StrCat("committing ", JobDir(job_id)));
    }
  }
  if (s.ok()) s = SyncDirectory(dir_);
  if (!s.ok()) (void)RemoveTree(tmp);
  return s;
}

absl::Status JobRecords::Remove(const std::string& job_id) {
  if (!enabled() || job_id.empty() || job_id.find('/') != std::string::npos) {
    return absl::OkStatus();
  }
  WaitForSaves();
  std::lock_guard<std::mutex> lock(mu_);
  return RemoveTree(JobDir(job_id));
}

std::vector<v1::JobRecord> JobRecords::List() const {
  std::vector<v1::JobRecord> out;
  if (!enabled()) return out;
  WaitForSaves();
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir_);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (name.find(".tmp-") != std::string::npos) continue;
    v1::JobRecord record;
    absl::Status read = checkpoint::ReadJsonFile(JoinPath(JoinPath(dir_, name), kRecord),
                                                 &record);
    if (!read.ok()) {
      spdlog::warn("skipping the job record {}: {}", JoinPath(dir_, name), read.ToString());
      continue;
    }
    out.push_back(std::move(record));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.created_unix_ms() < b.created_unix_ms();
  });
  return out;
}

absl::StatusOr<v1::JobRecord> JobRecords::Find(const std::string& id_or_name) const {
  std::vector<v1::JobRecord> all = List();
  for (const v1::JobRecord& r : all) {
    if (r.job_id() == id_or_name) return r;
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->name() == id_or_name) return *it;
  }
  return absl::NotFoundError(absl::StrCat(
      "no suspended job '", id_or_name, "'",
      enabled() ? absl::StrCat(" in ", dir_) : std::string(" (ranncd runs with --state-dir none)")));
}

absl::StatusOr<JobRecords::Loaded> JobRecords::Load(const std::string& job_id) const {
  absl::StatusOr<v1::JobRecord> record = Find(job_id);
  if (!record.ok()) return record.status();
  Loaded loaded;
  loaded.record = std::move(*record);
  const std::string dir = JobDir(loaded.record.job_id());
  absl::StatusOr<std::string> model = ReadFile(absl::StrCat(dir, "/", kModel));
  if (!model.ok()) return absl::DataLossError(model.status().message());
  loaded.model_bytes = std::move(*model);
  absl::StatusOr<std::string> bytes = ReadFile(absl::StrCat(dir, "/", kTensors));
  if (!bytes.ok()) return absl::DataLossError(bytes.status().message());
  try {
    const c10::impl::GenericDict tensors =
        torch::jit::pickle_load(std::vector<char>(bytes->begin(), bytes->end())).toGenericDict();
    for (const std::string& key : loaded.record.input_keys()) {
      loaded.example_inputs.push_back(tensors.at(key).toTensor());
    }
    for (const std::string& name : loaded.record.sent_names()) {
      loaded.sent[name] = tensors.at(absl::StrCat("sent/", name)).toTensor();
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(dir, "/", kTensors, " does not read: ", e.what()));
  }
  return loaded;
}

}  // namespace rannc
