#!/bin/bash
# The GPU machine's suites in one device call (docs/building.md, "GPU conformance"): builds
# ranncd, the CLI and the SDK example with tools/gpu_cmake_build.sh (REBUILD=0 keeps a build that
# is there), then runs each suite named in STEPS, writing its log to $OUT/<suite>.log and a line
# with its exit status and the seconds since the start:
#   models       test_gpu_models.py on cuda:0/4 (RANNC_GPU_MODELS_REPORT=$OUT/gpu_models.jsonl)
#   scripted     test_scripted_optimizer.py on cuda:0/4, reference on the GPU
#   conformance  test_conformance.py -k optimizers on cuda, reference on the GPU
#   amp          test_memory_conformance.py -k "fp16 or loss_scaling" on cuda:0/4
#   checkpoint   benchmarks/checkpoint_bench.py --size workload-a (2 checkpoints, restart)
#
#   STEPS="models amp" OUT=/tmp/out tools/gpu_suites.sh      (with the device tool: carry .gpu)
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-suites}
mkdir -p "$OUT"
t0=$(date +%s)
if [ ! -x build/gpu/daemon/ranncd ] || [ "${REBUILD:-1}" = 1 ]; then
  SYS=/tmp/sys TESTS=0 TARGETS="ranncd rannc train_example" tools/gpu_cmake_build.sh build/gpu \
    > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
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
for step in ${STEPS:-models scripted conformance amp}; do
  case $step in
    models) RANNC_DEVICES=cuda:0/4 RANNC_GPU_MODELS_REPORT=$OUT/gpu_models.jsonl \
      run gpu_models 300 python3 -m pytest -q --tb=short $tests/test_gpu_models.py ;;
    scripted) RANNC_DEVICES=cuda:0/4 RANNC_TEST_REF_DEVICE=cuda \
      run scripted 120 python3 -m pytest -q --tb=short $tests/test_scripted_optimizer.py ;;
    conformance) RANNC_DEVICES=cuda RANNC_TEST_REF_DEVICE=cuda \
      run conformance 150 python3 -m pytest -q --tb=short $tests/test_conformance.py -k optimizers ;;
    amp) RANNC_DEVICES=cuda:0/4 RANNC_TEST_REF_DEVICE=cuda \
      run amp 240 python3 -m pytest -q --tb=short $tests/test_memory_conformance.py \
      -k "fp16 or loss_scaling" ;;
    checkpoint) RANNC_DEVICES=cuda:0 RANNC_CHECKPOINT_KEEP=1 \
      run checkpoint 420 python3 benchmarks/checkpoint_bench.py --size workload-a \
      --checkpoints 2 --every 2 --warmup 2 --disk-reps 1 --dir /tmp/rb ;;
    *) echo "unknown suite $step"; exit 2 ;;
  esac
done
