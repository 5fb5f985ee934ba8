// Pipeline-efficiency benchmark (issue 4): for a TorchScript model on CPU virtual devices, the
// step time of pipelined plans executed by the real PipelineEngine, next to the planner's
// estimate of the same plan and the ideal step (the step's total compute spread evenly over the
// devices), for the 1F1B and GPipe schedules at several micro-batch counts, plus the
// single-stage data-parallel plan as a baseline. Prints a Markdown table on stdout.
//
//   bazel build //benchmarks:pipeline_bench
//   bazel-bin/benchmarks/pipeline_bench --model gpt.pt --batch 16 --seq 64 \
//       --devices 2 --stages 2 --micro-batches 1,2,4,8 --steps 5 --backend ucx
//
// The model takes two int64 [batch, seq] tensors of token ids in [0, 256) (examples/
// train_gpt.py's ByteGPT: idx, targets); its first output is the loss.
//
// Definitions, per row (a plan with stages s, each with r_s replicas, m micro-batches):
//   measured  median wall time of `--steps` TrainStep calls (after 2 warm-up steps; ZeroGrad
//             between steps, not timed)
//   estimate  the deployment's estimated_step_ms (the planner's schedule simulation)
//   ideal     sum_s r_s * m * (fwd_ms_s + bwd_ms_s) / N, with the deployment's per-stage,
//             per-micro-batch profiled costs: the step's compute with no bubble, no transfer
//             and no all-reduce
//   bubble    1 - ideal / measured: the fraction of device time not spent computing
//   schedule bubble  (S - 1) / (m + S - 1): the idle fraction 1F1B and GPipe both have with S
//             equal stages and free communication, what `bubble` would be on ideal devices
//   est/meas  estimate / measured
//
// With --zero-buckets B1,B2,...: instead, ZeRO's gradient reduction, with AdamW, on the plan
// --stages x (--devices / --stages) replicas with the first --micro-batches count, once per
// bucket size Bi (EngineOptions::bucket_bytes). A bucket as large as the stage's gradients is
// one reduce-scatter issued as the backward ends (what ZeRO did before its reduction was
// bucketed); smaller ones start during the backward. Per row:
//   buckets   ZeRO partitions (reduce-scatter buckets) on device 0, and how many of them its
//             last step started during the backward
//   train     median wall time of TrainStep (forwards, backwards, reduce-scatters)
//   optimizer median wall time of Step (AdamW on the shards, all-gather of the parameters)
//
//   bazel-bin/benchmarks/pipeline_bench --model gpt.pt --devices 4 --stages 2
//       --micro-batches 1 --zero-buckets 1073741824,1048576,262144 --steps 9   (one line)
//
// LibTorch intra-op threads are set to 1 (at::set_num_threads(1)) before profiling, so every
// device thread (and the planner's profiling) runs single-threaded: N device threads share the
// machine's cores the same way in every row, and the profiled costs match what a device pays.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/status/statusor.h"
#include "daemon/comm/factory.h"
#include "daemon/graph/ir.h"
#include "daemon/graph/torchscript_import.h"
#include "daemon/planner/links.h"
#include "daemon/planner/planner.h"
#include "daemon/planner/profile_cache.h"
#include "daemon/runtime/pipeline_engine.h"
#include "rannc/v1/deployment.pb.h"
#include "daemon/common/stats.h"

namespace rannc {
namespace {

struct Args {
  std::string model;
  int64_t batch = 16;
  int64_t seq = 64;
  int devices = 2;
  int stages = 2;
  std::vector<int> micro_batches = {1, 2, 4, 8};
  int steps = 5;
  std::string backend = "ucx";
  std::vector<int64_t> zero_buckets;  // ZeRO rows instead of the pipeline rows (see above)
};

[[noreturn]] void Usage(const std::string& why) {
  std::cerr << "pipeline_bench: " << why << "\n"
            << "usage: pipeline_bench --model FILE.pt [--batch B] [--seq T] [--devices N] "
               "[--stages S] [--micro-batches 1,2,4,8] [--steps K] [--backend ucx|fake] "
               "[--zero-buckets BYTES,...]\n";
  std::exit(2);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string key = argv[i];
    std::string value;
    if (size_t eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      if (i + 1 >= argc) Usage("missing value for " + key);
      value = argv[++i];
    }
    try {
      if (key == "--model") {
        a.model = value;
      } else if (key == "--batch") {
        a.batch = std::stoll(value);
      } else if (key == "--seq") {
        a.seq = std::stoll(value);
      } else if (key == "--devices") {
        a.devices = std::stoi(value);
      } else if (key == "--stages") {
        a.stages = std::stoi(value);
      } else if (key == "--steps") {
        a.steps = std::stoi(value);
      } else if (key == "--backend") {
        a.backend = value;
      } else if (key == "--micro-batches") {
        a.micro_batches.clear();
        std::stringstream ss(value);
        std::string item;
        while (std::getline(ss, item, ',')) a.micro_batches.push_back(std::stoi(item));
      } else if (key == "--zero-buckets") {
        std::stringstream ss(value);
        std::string item;
        while (std::getline(ss, item, ',')) a.zero_buckets.push_back(std::stoll(item));
      } else {
        Usage("unknown flag " + key);
      }
    } catch (const std::exception&) {
      Usage("bad value for " + key + ": " + value);
    }
  }
  if (a.model.empty()) Usage("--model is required");
  if (a.devices < 1 || a.stages < 1 || a.devices % a.stages != 0) {
    Usage("--devices must be a positive multiple of --stages");
  }
  if (a.steps < 1 || a.batch < 1 || a.seq < 1 || a.micro_batches.empty()) Usage("bad sizes");
  if (a.backend != "ucx" && a.backend != "fake") Usage("--backend must be ucx or fake");
  return a;
}

struct Row {
  std::string schedule;
  int stages = 0;
  int replicas = 0;
  int m = 0;
  double measured_ms = 0;
  double estimate_ms = 0;
  double ideal_ms = 0;
  std::string error;
};

std::string Fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  at::set_num_threads(1);

  std::ifstream in(args.model, std::ios::binary);
  if (!in) Usage("cannot read " + args.model);
  std::stringstream bytes;
  bytes << in.rdbuf();
  absl::StatusOr<ImportedModel> model = ImportTorchScript(bytes.str());
  if (!model.ok()) {
    std::cerr << "import: " << model.status() << "\n";
    return 1;
  }
  std::vector<at::Tensor> tensors;
  for (const std::string& name : model->graph_tensor_names) {
    for (const ModuleTensor& t : model->tensors) {
      if (t.name == name) tensors.push_back(t.tensor);
    }
  }
  at::manual_seed(0);
  const std::vector<at::Tensor> inputs = {
      at::randint(0, 256, {args.batch, args.seq}, at::kLong),
      at::randint(0, 256, {args.batch, args.seq}, at::kLong)};
  absl::StatusOr<IrGraph> ir = BuildIr(*model, tensors, inputs);
  if (!ir.ok()) {
    std::cerr << "ir: " << ir.status() << "\n";
    return 1;
  }

  planner::LinkProbeOptions probe;
  probe.num_devices = args.devices;
  absl::StatusOr<planner::Links> links = planner::MeasureCpuLinks(probe);
  if (!links.ok()) {
    std::cerr << "links: " << links.status() << "\n";
    return 1;
  }
  std::cerr << "links: " << planner::DescribeLinks(*links) << "\n";

  planner::PlanTarget target;
  target.num_devices = args.devices;
  target.device_memory_bytes = 64ull << 30;
  target.device_type = "cpu";
  target.batch_size = args.batch;
  target.links = *links;
  planner::MemoryModel memory;
  planner::ProfileCache cache("");  // in memory: each micro-batch size is profiled once
  const comm::Backend backend = args.backend == "ucx" ? comm::Backend::kUcx : comm::Backend::kFake;

  auto run = [&](const std::string& label, planner::Schedule schedule, int stages, int m) {
    Row row;
    row.schedule = label;
    row.stages = stages;
    row.replicas = args.devices / stages;
    row.m = m;
    planner::PlannerConfig config;
    config.partition_num = stages;
    config.replica_num = row.replicas;
    config.pipeline_num = m;
    config.schedule = schedule;
    absl::StatusOr<v1::Deployment> plan = planner::PlanModel(
        *ir, tensors, inputs, target, memory, config, &cache, "pipeline_bench");
    if (!plan.ok()) {
      row.error = "plan: " + std::string(plan.status().message());
      return row;
    }
    row.estimate_ms = plan->estimated_step_ms();
    double compute = 0;
    for (const v1::DeploymentStage& st : plan->stages()) {
      compute += st.devices_size() * plan->micro_batches() * (st.fwd_ms() + st.bwd_ms());
    }
    row.ideal_ms = compute / args.devices;
    absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
        PipelineEngine::Create(*ir, *plan, tensors, backend, args.devices);
    if (!engine.ok()) {
      row.error = "engine: " + std::string(engine.status().message());
      return row;
    }
    std::vector<double> times;
    for (int i = 0; i < 2 + args.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<StepResult> step = (*engine)->TrainStep(inputs);
      const auto t1 = std::chrono::steady_clock::now();
      if (!step.ok()) {
        row.error = "step: " + std::string(step.status().message());
        return row;
      }
      (*engine)->ZeroGrad();
      if (i >= 2) times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    row.measured_ms = Median(times);
    std::cerr << label << " S=" << stages << " m=" << m << ": " << row.measured_ms << " ms\n";
    return row;
  };

  if (!args.zero_buckets.empty()) {
    const int replicas = args.devices / args.stages;
    const int m = args.micro_batches[0];
    planner::PlannerConfig config;
    config.partition_num = args.stages;
    config.replica_num = replicas;
    config.pipeline_num = m;
    absl::StatusOr<v1::Deployment> plan = planner::PlanModel(
        *ir, tensors, inputs, target, memory, config, &cache, "pipeline_bench");
    if (!plan.ok()) {
      std::cerr << "plan: " << plan.status() << "\n";
      return 1;
    }
    std::vector<int> params;
    for (size_t i = 0; i < ir->tensor_names.size(); ++i) {
      if (ir->values[ir->inputs[ir->num_user_inputs + i]].role == ValueRole::kParam) {
        params.push_back(static_cast<int>(i));
      }
    }
    HyperParams adamw;
    adamw.lr = 1e-4;
    std::cout << "ZeRO, devices " << args.devices << " (" << args.stages << " stages x "
              << replicas << " replicas), m " << m << ", batch " << args.batch << " x seq "
              << args.seq << ", backend " << args.backend << ", AdamW, " << args.steps
              << " timed steps (median)\n\n";
    std::cout << "| bucket bytes | buckets (started during backward) | train ms | optimizer ms "
                 "| total ms |\n";
    std::cout << "|---:|---:|---:|---:|---:|\n";
    for (int64_t bucket_bytes : args.zero_buckets) {
      EngineOptions options;
      options.backend = backend;
      options.num_devices = args.devices;
      options.zero = true;
      options.bucket_bytes = static_cast<size_t>(bucket_bytes);
      absl::StatusOr<std::unique_ptr<PipelineEngine>> engine =
          PipelineEngine::Create(*ir, *plan, tensors, options);
      absl::Status s = engine.ok() ? (*engine)->SetOptimizer(OptimizerKind::kAdamW, {params})
                                   : engine.status();
      std::vector<double> train, step;
      for (int i = 0; s.ok() && i < 2 + args.steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<StepResult> result = (*engine)->TrainStep(inputs);
        const auto t1 = std::chrono::steady_clock::now();
        s = result.ok() ? (*engine)->Step({adamw}) : result.status();
        const auto t2 = std::chrono::steady_clock::now();
        (*engine)->ZeroGrad();
        if (i < 2) continue;
        train.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        step.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      if (!s.ok()) {
        std::cout << "| " << bucket_bytes << " | error: " << s.message() << " | | | |\n";
        continue;
      }
      const auto [early, buckets] = (*engine)->OverlappedBuckets(0);
      std::cout << "| " << bucket_bytes << " | " << buckets << " (" << early << ") | "
                << Fmt("%.1f", Median(train)) << " | " << Fmt("%.1f", Median(step)) << " | "
                << Fmt("%.1f", Median(train) + Median(step)) << " |\n";
    }
    return 0;
  }

  std::vector<Row> rows;
  rows.push_back(run("dp (1 stage)", planner::Schedule::k1F1B, 1, 1));
  if (args.stages > 1) {
    for (auto [name, schedule] : {std::pair{"1f1b", planner::Schedule::k1F1B},
                                  std::pair{"gpipe", planner::Schedule::kGPipe}}) {
      for (int m : args.micro_batches) rows.push_back(run(name, schedule, args.stages, m));
    }
  }

  std::cout << "devices " << args.devices << ", batch " << args.batch << " x seq " << args.seq
            << ", backend " << args.backend << ", " << args.steps
            << " timed steps (median); links: " << planner::DescribeLinks(*links) << "\n\n";
  std::cout << "| schedule | stages x replicas | m | measured ms | estimate ms | ideal ms | bubble "
               "| schedule bubble | est/meas |\n";
  std::cout << "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Row& r : rows) {
    std::cout << "| " << r.schedule << " | " << r.stages << " x " << r.replicas << " | " << r.m
              << " | ";
    if (!r.error.empty()) {
      std::cout << "error: " << r.error << " | | | | | |\n";
      continue;
    }
    std::cout << Fmt("%.1f", r.measured_ms) << " | " << Fmt("%.1f", r.estimate_ms) << " | "
              << Fmt("%.1f", r.ideal_ms) << " | "
              << Fmt("%.2f", 1.0 - r.ideal_ms / r.measured_ms) << " | "
              << Fmt("%.2f", static_cast<double>(r.stages - 1) / (r.m + r.stages - 1)) << " | "
              << Fmt("%.2f", r.estimate_ms / r.measured_ms) << " |\n";
  }
  return 0;
}

}  // namespace
}  // namespace rannc

int main(int argc, char** argv) { return rannc::Main(argc, argv); }
