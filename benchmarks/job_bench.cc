// job_bench: trains a job that pyrannc saved (RANNC_SAVE_JOB=DIR, pyrannc/_save_job.py) inside
// this one process: the daemon's own Job code, with no client, no gRPC and no shared memory
// between them. Against the same job trained through pyrannc and ranncd it measures what the
// client/daemon split costs (issue 7: "within 3% of the same plan run in-process").
//
//   job_bench DIR [--devices SPEC] [--links LINKS] [--warmup N] [--steps N]
//             [--profile FILE [--profile-steps N]]
//
// DIR holds job.pb, model.pt, the shared-memory files job.pb names and forward.pb. --devices and
// --links are ranncd's (default: every CUDA GPU, else cpu:1; links measured). The job is created
// as ranncd's CreateJob creates it (JobSettingsFromSpec, the devices' backend); a job saved from a
// run with load_deployment keeps that plan. Each step is what pyrannc's training loop asks of
// the daemon: Forward (requires_grad) with forward.pb's inputs and its first output copied to the
// host (the loss the client receives), Backward of that output with a gradient of ones, Step with
// the optimizer's hyper-parameters from job.pb, ZeroGrad(set_to_none). Prints one JSON line:
// {"create_s", "step_s": [...], "step_s_median", "warmup", "steps", "plan_summary",
//  "devices", "loss_first", "loss_last"}; logs go to stderr.
//
// --profile FILE: after the timed steps, --profile-steps more (default 3) run under LibTorch's
// Kineto profiler (the GPU's kernels, copies and sets on CUDA devices; the host's operators on
// CPU devices), and its Chrome trace is written to FILE (benchmarks/kernel_profile.py reads it);
// the JSON line then also has "profile" and "profile_steps". The timed steps are not profiled.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/algorithm/container.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/elapsed.h"
#include "daemon/common/shm_transfer.h"
#include "daemon/common/status.h"
#include "daemon/config/options.h"
#include "daemon/daemon.h"
#include "daemon/planner/deployment.h"
#include "daemon/server/job.h"
#include "daemon/server/training_service.h"
#include "daemon/common/files.h"

namespace rannc {
namespace {

struct BenchOptions {
  std::string dir;
  DaemonOptions daemon;
  int warmup = 3;
  int steps = 10;
  std::string profile;  // a Chrome trace of profile_steps more steps goes here
  int profile_steps = 3;
};

absl::StatusOr<BenchOptions> ParseArgs(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool takes_value = arg == "--devices" || arg == "--links" || arg == "--warmup" ||
                             arg == "--steps" || arg == "--profile" || arg == "--profile-steps";
    if (takes_value && i + 1 >= argc) {
      return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    }
    const std::string v = takes_value ? argv[++i] : "";
    if (arg == "--devices") {
      o.daemon.devices = v;
    } else if (arg == "--links") {
      o.daemon.links = v;
    } else if (arg == "--warmup") {
      o.warmup = std::atoi(v.c_str());
    } else if (arg == "--steps") {
      o.steps = std::atoi(v.c_str());
    } else if (arg == "--profile") {
      o.profile = v;
    } else if (arg == "--profile-steps") {
      o.profile_steps = std::atoi(v.c_str());
    } else if (!arg.empty() && arg[0] != '-' && o.dir.empty()) {
      o.dir = arg;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument ", arg));
    }
  }
  if (o.dir.empty() || o.steps < 1 || o.warmup < 0 || o.profile_steps < 1) {
    return absl::InvalidArgumentError(
        "usage: job_bench DIR [--devices SPEC] [--links LINKS] [--warmup N] [--steps N] "
        "[--profile FILE [--profile-steps N]]");
  }
  return o;
}

template <typename Message>
absl::StatusOr<Message> ReadMessage(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  Message m;
  if (!m.ParseFromString(*bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a ", m.GetTypeName()));
  }
  return m;
}

// The shared-memory files a saved spec names were copied into `dir` under their own names.
void MoveShmRefs(const std::string& dir, v1::Tensor* t) {
  if (!t->has_shm()) return;
  const std::string& path = t->shm().path();
  t->mutable_shm()->set_path(absl::StrCat(dir, "/", path.substr(path.rfind('/') + 1)));
}

// `s` for inside a JSON string (newlines become spaces).
std::string JsonEscaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c == '\n' ? ' ' : c;
  }
  return out;
}

// Runs `steps` calls of `step` under Kineto and writes its Chrome trace to `path`: the GPU's
// activity (every thread's kernels, copies and sets) on CUDA devices, else the host's operators.
template <typename Step>
absl::Status ProfileSteps(const std::string& path, int steps, bool cuda, Step& step) {
  namespace profiler = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(
      torch::profiler::impl::ProfilerState::KINETO);
  const std::set<ActivityType> activities = {cuda ? ActivityType::CUDA : ActivityType::CPU};
  try {
    profiler::prepareProfiler(config, activities);
    profiler::enableProfiler(config, activities);
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(absl::StrCat("cannot start the profiler: ", e.what()));
  }
  absl::Status ran = absl::OkStatus();
  for (int s = 0; s < steps && ran.ok(); ++s) ran = step().status();
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  if (!ran.ok()) return Annotate(ran, "a profiled step");
  std::remove(path.c_str());
  try {
    result->save(path);  // throws where LibTorch was built without Kineto (Debian's 1.13)
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write the profile to ", path, ": ", e.what()));
  }
  std::ifstream written(path);
  if (!written || written.peek() == std::ifstream::traits_type::eof()) {
    return absl::InternalError(absl::StrCat("the profiler wrote no trace to ", path, " (",
                                            result->events().size(), " events)"));
  }
  spdlog::info("profiled {} steps ({} events) into {}", steps, result->events().size(), path);
  return absl::OkStatus();
}

absl::Status Run(const BenchOptions& o) {
  absl::StatusOr<v1::JobSpec> spec = ReadMessage<v1::JobSpec>(o.dir + "/job.pb");
  if (!spec.ok()) return spec.status();
  absl::StatusOr<v1::ForwardRequest> forward =
      ReadMessage<v1::ForwardRequest>(o.dir + "/forward.pb");
  if (!forward.ok()) return forward.status();
  absl::StatusOr<std::string> model = ReadFile(o.dir + "/model.pt");
  if (!model.ok()) return model.status();
  for (v1::NamedTensor& t : *spec->mutable_model_tensors()) MoveShmRefs(o.dir, t.mutable_tensor());
  for (v1::Tensor& t : *spec->mutable_example_inputs()) MoveShmRefs(o.dir, &t);
  const ShmDirectory shm(o.dir);

  absl::StatusOr<DaemonFacts> facts = ResolveFacts(o.daemon);
  if (!facts.ok()) return facts.status();
  absl::StatusOr<JobSettings> config = JobSettingsFromSpec(*spec, *facts);
  if (!config.ok()) return config.status();
  config->backend = JobBackend(config->placement, facts->devices);
  const std::vector<HyperParams> hypers = config->optimizer.group_hyper;

  absl::StatusOr<std::vector<at::Tensor>> examples = DecodeAll(spec->example_inputs(), "example input", shm);
  if (!examples.ok()) return examples.status();
  absl::StatusOr<std::vector<at::Tensor>> inputs = DecodeAll(forward->inputs(), "input", shm);
  if (!inputs.ok()) return inputs.status();

  // What ranncd's CreateJob does after receiving the spec: the tensors apart, then the job.
  const auto created = std::chrono::steady_clock::now();
  absl::StatusOr<SentTensors> sent = DecodeModelTensors(spec->model_tensors(), shm);
  if (!sent.ok()) return sent.status();
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create("in-process", std::move(*config), *model, *examples, *sent);
  if (!job.ok()) return Annotate(job.status(), "creating the job");
  sent->clear();
  const double create_s = SecondsSince(created);
  const std::string plan = planner::DescribeDeployment((*job)->info().plan);
  spdlog::info("job created in {:.2f} s: {}", create_s, plan);

  // One training step as pyrannc asks for it; returns the loss the client would receive.
  auto train_step = [&]() -> absl::StatusOr<float> {
    absl::StatusOr<std::vector<at::Tensor>> out = (*job)->Forward(0, *inputs, true);
    if (!out.ok()) return Annotate(out.status(), "forward");
    const at::Tensor loss = (*out)[0].to(at::kCPU);
    absl::Status status = (*job)->Backward(0, {{0, at::ones_like(loss)}}, false);
    JobOp step;
    step.hypers = hypers;
    if (status.ok()) status = (*job)->Run(0, step).status();
    if (!status.ok()) return Annotate(status, "backward and step");
    JobOp zero;
    zero.kind = JobOp::Kind::kZeroGrad;
    zero.set_to_none = true;
    (*job)->Run(0, zero).IgnoreError();
    return loss.to(at::kFloat).item<float>();
  };
  std::vector<double> step_s;
  std::vector<double> losses;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<float> loss = train_step();
    if (!loss.ok()) return loss.status();
    if (s >= o.warmup) step_s.push_back(SecondsSince(start));
    losses.push_back(*loss);
  }
  if (!o.profile.empty()) {
    const bool cuda = absl::c_any_of((*job)->info().devices, [](const std::string& d) {
      return d.rfind("cuda", 0) == 0;
    });
    if (absl::Status p = ProfileSteps(o.profile, o.profile_steps, cuda, train_step); !p.ok()) {
      return p;
    }
  }
  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;

  // Every digit of a double: a float32 loss read back by Python equals the client's.
  std::cout << std::setprecision(17) << "{\"create_s\": " << create_s << ", \"step_s\": ["
            << absl::StrJoin(step_s, ", ") << "], \"step_s_median\": " << median
            << ", \"warmup\": " << o.warmup << ", \"steps\": " << o.steps
            << ", \"plan_summary\": \"" << JsonEscaped(plan) << "\", \"devices\": [\""
            << absl::StrJoin((*job)->info().devices, "\", \"") << "\"], \"loss_first\": "
            << losses.front() << ", \"loss_last\": " << losses.back();
  if (!o.profile.empty()) {
    std::cout << ", \"profile\": \"" << JsonEscaped(o.profile)
              << "\", \"profile_steps\": " << o.profile_steps;
  }
  std::cout << "}" << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace rannc

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("job_bench"));
  absl::StatusOr<rannc::BenchOptions> options = rannc::ParseArgs(argc, argv);
  if (!options.ok()) {
    std::cerr << "job_bench: " << options.status().message() << std::endl;
    return 2;
  }
  absl::Status ran = rannc::Run(*options);
  if (!ran.ok()) {
    std::cerr << "job_bench: " << ran.ToString() << std::endl;
    return 1;
  }
  return 0;
}
