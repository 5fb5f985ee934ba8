#!/bin/bash
# The GPU machine's suites in one device call (docs/building.md, "GPU conformance"): builds
# ranncd, the CLI and the SDK example with tools/gpu_cmake_build.sh (REBUILD=0 keeps a build that
# is there), then runs each suite named in STEPS, writing its log to $OUT/<suite>.log and a line
# with its exit status and the seconds since the start:
#   models       test_gpu_models.py on cuda:0/4 (RANNC_GPU_MODELS_REPORT=$OUT/gpu_models.jsonl)
#   scripted     test_scripted_optimizer.py on cuda:0/4, reference on the GPU
#   conformance  test_conformance.py -k optimizers on cuda, reference on the GPU
#   amp          test_memory_conformance.py -k "amp_trains or fp16 or loss_scaling" on cuda:0/4
#   engine       pipeline_engine_cuda_test (the C++ engine on CUDA devices; built only then)
#   checkpoint   benchmarks/checkpoint_bench.py --size workload-a (2 checkpoints EVERY steps
#                apart, default 80: more than a 16 GB write takes; restart; CKPT_ARGS adds
#                options, e.g. --restart-deployment)
#   metrics      tools/metrics_check.py on cuda: the metrics endpoint against ListJobs
#   stress       test_plan_stress.py on cuda:0/4, reference on the GPU: STRESS_ROUNDS (5) rounds
#                of test_gpu_models' models, profile cache cold then warm (issue 25; ~80 s a
#                round on an H200)
#
#   STEPS="models amp" OUT=/tmp/out tools/gpu_suites.sh      (with the device tool: carry .gpu)
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-suites}
mkdir -p "$OUT"
t0=$(date +%s)
steps=${STEPS:-models scripted conformance amp}
targets="ranncd rannc train_example" tests=0
case " $steps " in *" engine "*) targets="$targets pipeline_engine_cuda_test" tests=1 ;; esac
if [ ! -x build/gpu/daemon/ranncd ] || [ "${REBUILD:-1}" = 1 ]; then
  # The build's own ctest run is left out (-R matches nothing): the engine step runs the test.
  SYS=/tmp/sys TESTS=$tests TARGETS="$targets" CTEST="-R ^none$" tools/gpu_cmake_build.sh \
    build/gpu > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
fi
echo "build done $(( $(date +%s) - t0 )) s"
export LD_LIBRARY_PATH=/tmp/sys/usr/lib/x86_64-linux-gnu
export PYTHONPATH=python_client RANNC_DAEMON_BIN=$PWD/build/gpu/daemon/ranncd
tests=python_client/tests
run() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - t0 )) s"
  tail -4 "$OUT/$name.log"
}
for step in $steps; do
  case $step in
    models) RANNC_DEVICES=cuda:0/4 RANNC_GPU_MODELS_REPORT=$OUT/gpu_models.jsonl \
      run gpu_models 300 python3 -m pytest -q --tb=short $tests/test_gpu_models.py ;;
    scripted) RANNC_DEVICES=cuda:0/4 RANNC_TEST_REF_DEVICE=cuda \
      run scripted 120 python3 -m pytest -q --tb=short $tests/test_scripted_optimizer.py ;;
    conformance) RANNC_DEVICES=cuda RANNC_TEST_REF_DEVICE=cuda \
      run conformance 150 python3 -m pytest -q --tb=short $tests/test_conformance.py -k optimizers ;;
    amp) RANNC_DEVICES=cuda:0/4 RANNC_TEST_REF_DEVICE=cuda RANNC_DAEMON_LOG=/tmp/amp-ranncd.log \
      run amp 400 python3 -m pytest -q --tb=short $tests/test_memory_conformance.py \
      -k "amp_trains or fp16 or loss_scaling"
      # Values a stage computes in another dtype than the IR's (cast before sending): none
      # expected since the IR takes a CUDA job's dtypes from a run on the GPU.
      echo "IR dtype runs: $(grep -c 'values have other dtypes on cuda' /tmp/amp-ranncd.log)," \
        "casts: $(grep -c 'where the IR says' /tmp/amp-ranncd.log)"
      grep -m3 'where the IR says\|does not run node by node' /tmp/amp-ranncd.log ;;
    engine) (cd build/gpu && run engine 300 ./daemon/runtime/pipeline_engine_cuda_test) ;;
    checkpoint) RANNC_DEVICES=cuda:0 RANNC_CHECKPOINT_KEEP=1 \
      run checkpoint 540 python3 benchmarks/checkpoint_bench.py --size workload-a \
      --checkpoints 2 --every "${EVERY:-80}" --warmup 2 --disk-reps 1 --dir /tmp/rb ${CKPT_ARGS:-}
      cp /tmp/rb/ranncd-*.log "$OUT/" 2>/dev/null ;;
    metrics) run metrics 120 python3 tools/metrics_check.py --devices cuda ;;
    stress) RANNC_DEVICES=cuda:0/4 RANNC_TEST_REF_DEVICE=cuda RANNC_STRESS_ROUNDS=${STRESS_ROUNDS:-5} \
      run stress 540 python3 -m pytest -q -s --tb=short $tests/test_plan_stress.py ;;
    *) echo "unknown suite $step"; exit 2 ;;
  esac
done
