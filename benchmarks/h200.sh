#!/bin/bash
# Issue 7's benchmark in one command on a GPU machine (1 or 2 H200s, python3 with PyTorch 2.11 and
# torchrun, no internet): builds ranncd, trains issue 7's GPT with every system, and prints a
# Markdown table.
#
#   NCCL_NVLS_ENABLE=0 benchmarks/h200.sh [OUTDIR]           workload A (1.34B)
#   WORKLOAD=B NCCL_NVLS_ENABLE=0 benchmarks/h200.sh [OUTDIR] workload B (10.5B): FSDP2 and rannc
#
# OUTDIR defaults to $OUT, else ./bench-out. It receives: results.jsonl (one JSON line per
# system: gpt_peers.py's and gpt_rannc.py's fields, or {"skipped"|"error": why}), table.md,
# log.txt (every run's output), build.log, and per amp_level L ranncd_L.log and
# rannc_<W>_L.deployment.
# The build needs the Debian .debs in .gpu/debs (docs/building.md "On the GPU machine"): through
# the device tool, carry ".gpu".
#
# Systems, each under `timeout` (a hung or failed one yields an "error" line and the rest go on):
#   A: ddp, fsdp2, gpipe, 1f1b (benchmarks/gpt_peers.py under torchrun, one process per GPU;
#      gpipe/1f1b print "skipped" on 1 GPU), then rannc per AMP_LEVELS (benchmarks/gpt_rannc.py:
#      the daemon on --devices cuda, run 1 with planning, run 2 from the saved deployment, run 3
#      the same job trained in-process by benchmarks/job_bench when the build made it).
#   B: fsdp2 (activation checkpointing per block), then rannc with enable_zero (which skips
#      itself when the host cannot hold pyrannc's full-batch trace of a 10.5B model: hundreds of
#      GiB, more than these machines have).
#
# The 10-minute budget (BUDGET, default 570 s, leaving 30 s of the device call's 600 s for the
# table and the files) -- expected times on 2 H200s, workload A:
#   build   SYS=/tmp/sys tools/gpu_cmake_build.sh build/gpu, ~4 min with every core; here it runs
#           in the background on all but 4 cores per GPU (its smoke check on DEVICES=cpu:2, off
#           the GPUs), so allow ~4-5 min.
#   peers   meanwhile, pinned to the other cores: each ~30-45 s (torch import and NCCL set-up
#           ~15 s, 13 steps of ~0.2-0.4 s, teardown); capped at 120 s each (B: fsdp2 ~60-90 s,
#           13 steps of ~2.5-3 s with recomputation; capped at 300 s). They never eat into the
#           last 200 s (RANNC_MIN), which are kept for rannc. SERIAL=1 waits for the build first
#           (peers then run alone on the machine, if the budget allows).
#   rannc   after the build, with whatever is left (~250-300 s): model build on the host ~10 s,
#           pyrannc's trace of the full batch on the host CPUs ~30-60 s, sending the 5.4 GB
#           TorchScript module, planning (profiling on the GPUs) and placement, 13 steps;
#           then run 2 repeats the trace and the send but loads the plan, and trains 1 step.
# If the build outlasts the budget, rannc reports an error and the peers' lines still stand.
#
# Other knobs: RANNCD=path uses an existing ranncd and skips the build (JOB_BENCH=path: its
# job_bench, default ../benchmarks/job_bench from ranncd's folder, as the CMake build puts it);
# SYS (default /tmp/sys);
# PYTHON (default python3); RANNC_FLAGS (extra gpt_rannc.py flags; B's default --zero); PEERS (the
# peer systems to run, default all of the workload's); PEER_CAP (seconds per peer system);
# AMP_LEVELS (the amp_level of each rannc run, default "O1 O2": autocast, then the whole forward in
# bf16; each gets an even share of the time left);
# ATTENTION=math (every system writes attention out instead of F.scaled_dot_product_attention:
# for a run where the fused op is what fails); PROFILE=1 (each peer and run 3 of rannc profile
# 3 more steps after the timed ones into OUTDIR/profiles, and kernels.md gets
# benchmarks/kernel_profile.py's table of where their GPU time goes).
#
# CPU_CHECK=1 checks this script itself on a machine without GPUs: the tiny model on CPU
# (gloo; the daemon on RANNC_DEVICES=cpu:2, from RANNCD or else the build), as if there were 2 GPUs;
# TORCHRUN_ARGS adds torchrun flags (PyTorch 1.13 under Python 3.11 needs
# "--redirects 1 --tee 1": its default "0" no longer parses).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
out=${1:-${OUT:-$root/bench-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
workload=${WORKLOAD:-A}
budget=${BUDGET:-570}
rannc_min=${RANNC_MIN:-200}
python=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
tmp=$(mktemp -d)
start=$(date +%s)
results=$out/results.jsonl
log=$out/log.txt
: >"$results"
: >"$log"

elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( budget - $(elapsed) )); }
say() { echo "[h200.sh +$(elapsed)s] $*" | tee -a "$log"; }

model=$workload
device=cuda
rannc_devices=cuda
if [ "${CPU_CHECK:-0}" = 1 ]; then
  gpus=2
  model=tiny
  device=cpu
  rannc_devices=cpu:2
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "${gpus:-0}" -lt 1 ]; then
  say "no GPU visible (nvidia-smi -L); nothing to benchmark"
  exit 1
fi
ncpu=$(nproc)
peer_n=$(( 4 * gpus )); (( peer_n > ncpu / 2 )) && peer_n=$(( ncpu / 2 ))
peer_cpus="0-$(( peer_n - 1 ))"
build_cpus="$peer_n-$(( ncpu - 1 ))"
{
  echo "workload $workload; budget ${budget}s; $gpus GPU(s); $ncpu CPUs; $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  free -g | head -2
} >>"$log" 2>&1

case "$workload" in
  A) peers="ddp fsdp2 gpipe 1f1b"; peer_cap=120; rannc_flags=${RANNC_FLAGS:-} ;;
  B) peers="fsdp2"; peer_cap=300; rannc_flags=${RANNC_FLAGS:---zero} ;;
  *) say "WORKLOAD must be A or B, not $workload"; exit 2 ;;
esac
peers=${PEERS:-$peers}
amp_levels=${AMP_LEVELS:-O1 O2}
peer_cap=${PEER_CAP:-$peer_cap}
profile_flags=()
[ "${PROFILE:-0}" = 1 ] && profile_flags=(--profile "$out/profiles")

# piece NAME EXPECTED CAP CMD...: runs CMD under `timeout` (at most CAP seconds, and never past
# the budget less $reserve) with its JSON lines going to $json, then appends them to results:
# one line per system, its result (or skip) if it printed one, else its first error line, and for
# each EXPECTED system (comma-separated) that printed nothing an error made from the exit status.
reserve=0
piece() {
  local name=$1 expected=$2 cap=$3; shift 3
  local t=$(( $(left) - reserve ))
  if (( t < 30 )); then
    say "$name: skipped, ${t}s left of the budget"
    printf '{"system": "%s", "workload": "%s", "skipped": "no time left in the %ss budget"}\n' \
      "$name" "$model" "$budget" >>"$results"
    return
  fi
  (( t > cap )) && t=$cap
  local plog=$tmp/$name.log
  say "$name: starting (timeout ${t}s): $*"
  local t0
  t0=$(date +%s)
  timeout -k 15 "$t" "$@" >"$plog" 2>&1
  local rc=$?
  cat "$plog" >>"$log"
  say "$name: exit status $rc after $(( $(date +%s) - t0 ))s"
  "$python" - "$name" "$model" "$rc" "$t" "$json" "$plog" "$expected" >>"$results" <<'EOF'
import json, sys
name, workload, rc, limit, path, plog, expected = sys.argv[1:]
lines = []
try:
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
except FileNotFoundError:
    pass
why = f"timed out after {limit} s" if rc in ("124", "137") else f"exit status {rc}"
try:
    with open(plog, encoding="utf-8", errors="replace") as f:
        tail = [l.strip() for l in f if l.strip()][-1:]
except FileNotFoundError:
    tail = []
detail = why + (f"; last output: {tail[0][:300]}" if tail else "")
# One line per system: a result or skip before any error (ranks may each report one).
picked, seen = [], set()
for r in sorted(lines, key=lambda r: "error" in r):
    if r.get("system") not in seen:
        seen.add(r.get("system"))
        picked.append(r)
for system in [s for s in expected.split(",") if s] or [name]:
    if system not in seen:
        picked.append({"system": system, "workload": workload, "error": detail})
for r in picked:
    print(json.dumps(r))
EOF
}

# --- build (background) -----------------------------------------------------------------------
ranncd=${RANNCD:-}
. "$root/benchmarks/ranncd_build.sh"
if [ -z "$ranncd" ]; then
  ranncd=$root/build/gpu/daemon/ranncd
  say "building ranncd on CPUs $build_cpus (log: build.log)"
  start_build taskset -c "$build_cpus"
fi
[ "${SERIAL:-0}" = 1 ] && wait_build
concurrent=no
[ -n "$build_pid" ] && concurrent="yes (CPUs $peer_cpus; the build on $build_cpus)"

# --- peers ------------------------------------------------------------------------------------
reserve=$rannc_min
for system in $peers; do
  json=$tmp/$system.jsonl
  # shellcheck disable=SC2086
  piece "$system" "$system" "$peer_cap" taskset -c "$peer_cpus" "$python" -m torch.distributed.run \
    --standalone --nproc_per_node "$gpus" ${TORCHRUN_ARGS:-} benchmarks/gpt_peers.py \
    --system "$system" --model "$model" --device "$device" --attention "${ATTENTION:-sdpa}" \
    --out "$json" "${profile_flags[@]}"
done
reserve=0

# --- rannc ------------------------------------------------------------------------------------
wait_build
# A ranncd built against the unpacked .debs finds their libraries there (gRPC, abseil, UCX...).
sys_libs=${SYS:-/tmp/sys}/usr/lib/x86_64-linux-gnu
[ -d "$sys_libs" ] && export LD_LIBRARY_PATH=$sys_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -x "$ranncd" ]; then
  # Run 3 of gpt_rannc.py (the job trained in-process) where the build made job_bench.
  job_bench=${JOB_BENCH:-$(dirname "$ranncd")/../benchmarks/job_bench}
  bench_flags=()
  [ -x "$job_bench" ] && bench_flags=(--job-bench "$job_bench" "${profile_flags[@]}")
  # Each amp_level gets an even share of what is left.
  set -- $amp_levels
  for level in $amp_levels; do
    name=rannc; [ "$level" = O1 ] || name="rannc $level"
    json=$tmp/rannc_$level.jsonl
    expected="$name,$name (saved deployment)"
    [ -x "$job_bench" ] && expected="$expected,$name (in-process)"
    # shellcheck disable=SC2086
    piece "$name" "$expected" "$(( $(left) / $# ))" env \
      RANNC_DAEMON_BIN="$ranncd" RANNC_DEVICES="$rannc_devices" \
      RANNC_DAEMON_LOG="$out/ranncd_$level.log" \
      RANNC_DAEMON_ARGS="--profile-cache $tmp/profiles.tsv" PYTHONPATH=python_client \
      "$python" benchmarks/gpt_rannc.py --model "$model" --device "$device" \
      --attention "${ATTENTION:-sdpa}" --amp-level "$level" --out "$json" \
      --deployment "$out/rannc_${model}_$level.deployment" --pid-file "$tmp/ranncd.pid" \
      "${bench_flags[@]}" $rannc_flags
    # pyrannc stops its daemon at exit, and the kernel does if the client is killed; in case not:
    if [ -s "$tmp/ranncd.pid" ] && kill -0 "$(cat "$tmp/ranncd.pid")" 2>/dev/null; then
      kill "$(cat "$tmp/ranncd.pid")"
    fi
    shift
  done
else
  why="the build (status $(cat "$tmp/build.rc" 2>/dev/null || echo killed)) made no $ranncd; see build.log"
  [ -n "${RANNCD:-}" ] && why="RANNCD=$RANNCD is not an executable"
  for level in $amp_levels; do
    name=rannc; [ "$level" = O1 ] || name="rannc $level"
    for system in "$name" "$name (saved deployment)"; do
      printf '{"system": "%s", "workload": "%s", "error": "no ranncd: %s"}\n' \
        "$system" "$model" "$why" >>"$results"
    done
  done
fi

# --- table ------------------------------------------------------------------------------------
for f in log.txt build.log ranncd_*.log; do  # the device tool brings back files up to 16 MiB
  if [ -f "$out/$f" ] && [ "$(stat -c %s "$out/$f")" -gt 12000000 ]; then
    tail -c 12000000 "$out/$f" >"$tmp/trunc" && mv "$tmp/trunc" "$out/$f"
  fi
done
"$python" - "$results" "$model" "$gpus" "$concurrent" >"$out/table.md" <<'EOF'
import json, sys
path, workload, gpus, concurrent = sys.argv[1:]
rows = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]

def num(v, fmt):
    return "—" if v is None else format(v, fmt)

def note(r):
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    if "error" in r:
        return "error: " + r["error"].replace("|", "/").replace("\n", " ")[:200]
    bits = []
    plan = r.get("plan")
    if plan:
        bits.append(f"plan {plan['stages']} stage(s) x replicas {plan['replicas']}, "
                    f"{plan['micro_batches']} micro-batches, {plan['schedule']}"
                    + (", recompute" if any(plan["recompute"]) else "")
                    + (", loaded" if plan.get("loaded") else ""))
    if r.get("micro_batches"):
        bits.append(f"{r['micro_batches']} micro-batches")
    if r.get("activation_checkpoint"):
        bits.append("activation checkpointing")
    if r.get("split_cost") is not None:
        bits.append(f"the client/daemon split costs {100 * r['split_cost']:.1f}% (a step through "
                    f"pyrannc {1000 * r['client_step_s_median']:.1f} ms, in-process "
                    f"{1000 * r['step_s_median']:.1f} ms)")
    if r.get("loss_last") is not None:
        bits.append(f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    return "; ".join(bits)

dev = next((r.get("device_name") for r in rows if r.get("device_name")), "GPU")
torch_v = next((r.get("torch") for r in rows if r.get("torch")), "?")
print(f"Workload {workload} on {gpus} x {dev} (torch {torch_v}); median of 10 steps after 3 "
      f"warm-up; MFU against 989 TFLOP/s; peers ran beside the ranncd build: {concurrent}.")
print()
print("| system | GPUs | tokens/s | TFLOP/s/GPU | MFU | peak GiB/GPU | planning s | "
      "first step s | notes |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    peak = r.get("peak_mem_gib")
    peak_s = " / ".join(f"{p:.1f}" for p in peak) if peak else "—"
    mfu = r.get("mfu")
    print(f"| {r.get('system')} | {r.get('gpus', '—')} | {num(r.get('tokens_per_s'), ',.0f')} | "
          f"{num(r.get('tflops_per_gpu'), '.1f')} | "
          f"{'—' if mfu is None else format(100 * mfu, '.1f') + '%'} | {peak_s} | "
          f"{num(r.get('planning_s'), '.1f')} | {num(r.get('time_to_first_step_s'), '.1f')} | "
          f"{note(r)} |")
EOF
cat "$out/table.md"
if [ "${PROFILE:-0}" = 1 ]; then
  # Every profiled system, in the results' order: its label and its trace.
  mapfile -t profiled < <("$python" -c '
import json, sys
for l in open(sys.argv[1], encoding="utf-8"):
    r = json.loads(l) if l.strip() else {}
    if r.get("profile"):
        print(r["system"]); print(r["profile"])' "$results")
  labels=() traces=()
  for (( i = 0; i + 1 < ${#profiled[@]}; i += 2 )); do
    labels+=("${profiled[i]}"); traces+=("${profiled[i+1]}")
  done
  if (( ${#traces[@]} )); then
    (IFS=,; "$python" benchmarks/kernel_profile.py "${traces[@]}" --steps 3 \
      --labels "${labels[*]}") >"$out/kernels.md" 2>&1
    cat "$out/kernels.md"
  fi
  # Traces over the device tool's 16 MiB limit on a file would not come back: compress them.
  gzip -f "$out"/profiles/*.json 2>/dev/null
fi
say "done; files in $out"
rm -rf "$tmp"
