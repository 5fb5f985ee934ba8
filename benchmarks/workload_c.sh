#!/bin/bash
# Issue 27's workload C on one H200 in one 10-minute device call: FSDP2's sweep of activation
# checkpointing (and CPU offload), the peers ranncd has to beat, and a Markdown table.
#
#   bash benchmarks/workload_c.sh [OUTDIR]
#
# Workload C (benchmarks/gpt_model.py): 36 layers, d_model 2560, 20 heads, seq 2048, vocab 32000,
# 3.0B parameters, global batch 20 sequences (40,960 tokens a step). By gpt_model.py's memory
# arithmetic it needs ~170 GiB without recomputation and ~58 GiB with every block recomputed,
# against the H200's ~139 GiB (docs/benchmarks.md, "Workload C (issue 27)").
#
# OUTDIR defaults to $OUT, else ./bench-out-c. It receives results.jsonl (one JSON line a run:
# gpt_peers.py's fields with "run" (SYSTEM/AC) and "run_s" added, or {"skipped"|"error": why};
# an out-of-memory is {"error": "out of memory: ...", "oom": true}), table.md (also printed at
# the end) and log.txt (every run's output). Needs python3 with PyTorch 2.x and CUDA, and
# torchrun; builds nothing.
#
# Runs (RUNS: "SYSTEM/AC ..." in order, gpt_peers.py --system SYSTEM --ac AC), most important
# first, so that whatever the budget cuts is what matters least:
#   fsdp2/on              every block recomputed: what most users run (the issue's 1.10x bar)
#   fsdp2/selective       torchtitan's op-level selective checkpointing
#   fsdp2/every:2         every 2nd block recomputed
#   fsdp2/off             no recomputation: expected out of memory (~1.22x the GPU)
#   fsdp2/every:3, fsdp2/every:4
#                         fewer blocks recomputed: the sweep for the best K (every:4 is
#                         expected not to fit); after an out-of-memory at every:K the larger
#                         K of the same system are skipped (they keep more)
#   fsdp2+compile/on      the same with each block compiled (torch.compile, Inductor)
#   fsdp2+offload/off     plain training with CPUOffloadPolicy (parameters, gradients and AdamW
#                         state in host memory; the optimizer steps on the CPU); at the edge
#                         of fitting by the arithmetic (~137 GiB)
#   fsdp2+compile/selective, fsdp2+compile/every:2, fsdp2/every:6
#                         if time is left
#
# Time (H200, 2 warm-up + 5 timed steps, WARMUP/STEPS), per run, estimated, not measured yet:
#   eager   ~40-50 s: torchrun and the torch import ~10 s, NCCL and the device mesh ~3 s, the
#           model built on the GPU ~3 s, 7 steps of ~1.6-2.1 s (830 TFLOP a step plus up to
#           260 TFLOP of recomputation at ~500 TFLOP/s) ~13 s, the first step's cuBLAS/cuDNN
#           set-up ~3 s, exit ~3 s. Capped at CAP_EAGER (120 s).
#   oom     ~20-30 s (it fails in the first step).
#   compile ~90-150 s: the eager run's time plus Dynamo and Inductor on a cold cache for each
#           distinct block (every:K has two). Capped at CAP_COMPILE (240 s).
#   offload ~70-100 s: ~48 GB of pinned host state set up, then ~5 s a step (CPU AdamW over 3.0B
#           parameters ~2-4 s, ~36 GB of parameters and gradients over the host link).
#           Capped at CAP_OFFLOAD (180 s).
# A run starts only if the budget has room for it (MIN_EAGER 45 s, MIN_COMPILE 100 s,
# MIN_OFFLOAD 60 s); otherwise its line says "skipped". BUDGET (540 s) keeps the whole script
# within one 600 s device call, with the table and the files' return after it.
#
# Then ranncd (RANNC=1, the default; 0 runs the peers only): built in the background while the
# peers run (~5 min on the 16 CPUs, all but PEER_CPUS=4 of them; or RANNCD=path of a built one),
# then benchmarks/gpt_rannc.py --amp-level O2 with the plan the daemon picks itself ("rannc/auto":
# the trace on the host, planning with profiling, WARMUP + STEPS steps; ~2-4 min), in the
# RANNC_MIN (240) seconds the peers leave it. Its plan (stages, micro-batches, recomputation, the
# planner's estimates) is in the table's notes; ranncd.log and rannc_C.deployment are in OUTDIR.
#
# PROFILE=1 adds gpt_rannc.py's runs 2 and 3 (the job trained in-process by job_bench, from
# JOB_BENCH or the build, with 3 more steps profiled into OUTDIR/profiles; ~2-3 min more).
#
# Workload D (issue 27: offload on one GPU and its host) runs through the same script:
#   MODEL=D MODEL_ARGS="--layers 16" RUNS="fsdp2+offload/off" RANNC_FLAGS=--offload \
#     BASELINE=fsdp2+offload/off bash benchmarks/workload_c.sh
# (MODEL_ARGS goes to both harnesses: gpt_model.add_workload_args's size overrides; BASELINE,
# default fsdp2/on, is the run the table's speeds are relative to.)
#
# Other knobs: PYTHON (python3), MODEL (C), DEVICE (cuda), NPROC (1: processes, one per GPU),
# TORCHRUN_ARGS (extra torchrun flags; PyTorch 1.13 under Python 3.11 needs
# "--redirects 1 --tee 1"), ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF for every run, default
# expandable_segments:True as torchtitan runs; "none" leaves PyTorch's default), RANNC_FLAGS
# (extra gpt_rannc.py flags).
#
# The CPU check of the script itself (PyTorch 1.13: fsdp2 ends in error lines there, selective
# and offload in "skipped"):
#   MODEL=tiny DEVICE=cpu RUNS="ddp/on ddp/every:2 ddp/off fsdp2/on ddp/selective \
#     fsdp2+offload/off" PYTHON=/usr/bin/python3 TORCHRUN_ARGS="--redirects 1 --tee 1" \
#     RANNCD=bazel-bin/daemon/ranncd bash benchmarks/workload_c.sh /tmp/workload_c
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
out=${1:-${OUT:-$root/bench-out-c}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
budget=${BUDGET:-540}
python=${PYTHON:-python3}
model=${MODEL:-C}
device=${DEVICE:-cuda}
nproc=${NPROC:-1}
warmup=${WARMUP:-2}
steps=${STEPS:-5}
rannc_min=${RANNC_MIN:-240}
runs=${RUNS-fsdp2/on fsdp2/selective fsdp2/every:2 fsdp2/off fsdp2/every:3 fsdp2/every:4 \
fsdp2+compile/on fsdp2+offload/off fsdp2+compile/selective fsdp2+compile/every:2 fsdp2/every:6}
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
alloc_conf=${ALLOC_CONF:-expandable_segments:True}
if [ "$alloc_conf" = none ]; then
  unset PYTORCH_CUDA_ALLOC_CONF
else
  export PYTORCH_CUDA_ALLOC_CONF=$alloc_conf
fi
tmp=$(mktemp -d)
start=$(date +%s)
results=$out/results.jsonl
log=$out/log.txt
: >"$results"
: >"$log"

elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( budget - $(elapsed) )); }
say() { echo "[workload_c.sh +$(elapsed)s] $*" | tee -a "$log"; }

if [ "$device" = cuda ] && ! nvidia-smi -L >/dev/null 2>&1; then
  say "no GPU visible (nvidia-smi -L); nothing to benchmark"
  exit 1
fi
{
  echo "workload $model; budget ${budget}s; device $device x $nproc; $(nproc) CPUs;" \
    "$(date -u +%FT%TZ)"
  echo "runs: $runs"
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}"
  [ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  free -g | head -2
} >>"$log" 2>&1

# pick LABEL SYSTEM AC RC LIMIT SECONDS JSONL PLOG: the one line a run leaves in results: its
# result if it printed one, else its first out-of-memory or error line, else an error made from
# the exit status and the last line of its output.
pick() {
  "$python" - "$model" "$@" <<'EOF'
import json, sys
workload, label, system, ac, rc, limit, seconds, path, plog = sys.argv[1:]
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
ok = [r for r in lines if "error" not in r]
oom = [r for r in lines if r.get("oom")]
picked = (ok or oom or lines or [None])[0]
if picked is None:
    why = f"timed out after {limit} s" if rc in ("124", "137") else f"exit status {rc}"
    try:
        with open(plog, encoding="utf-8", errors="replace") as f:
            tail = [l.strip() for l in f if l.strip()][-1:]
    except FileNotFoundError:
        tail = []
    picked = {"system": system, "workload": workload, "ac": ac,
              "error": why + (f"; last output: {tail[0][:300]}" if tail else "")}
picked["run"] = label
picked["run_s"] = int(seconds)
print(json.dumps(picked))
EOF
}

# skip LABEL SYSTEM AC WHY: a line for a run that did not start.
skip() {
  say "$1: skipped: $4"
  "$python" -c 'import json, sys
label, system, ac, why, workload = sys.argv[1:]
print(json.dumps({"system": system, "workload": workload, "ac": ac, "run": label,
                  "skipped": why}))' "$@" "$model" >>"$results"
}

# --- ranncd's build (background) -----------------------------------------------------------
# RANNC=1 (the default) adds ranncd's run after the peers; RANNCD=path uses an existing ranncd,
# else it is built here (tools/gpu_cmake_build.sh into build/gpu, the .debs of .gpu: carry
# ".gpu") on all CPUs but the first PEER_CPUS (4), while the peers run pinned to those.
rannc=${RANNC:-1}
rannc_devices=cuda
[ "$device" = cpu ] && rannc_devices=cpu:2
ranncd=${RANNCD:-}
. "$root/benchmarks/ranncd_build.sh"
peer_pin=()
if [ "$rannc" = 1 ] && [ -z "$ranncd" ]; then
  ranncd=$root/build/gpu/daemon/ranncd
  ncpu=$(nproc)
  peer_n=${PEER_CPUS:-4}
  build_pin=()
  if (( ncpu > 2 * peer_n )); then
    peer_pin=(taskset -c "0-$(( peer_n - 1 ))")
    build_pin=(taskset -c "$peer_n-$(( ncpu - 1 ))")
  fi
  say "building ranncd in the background (log: build.log)"
  start_build "${build_pin[@]}"
fi
[ "$rannc" = 1 ] || rannc_min=0

# --- FSDP2 peers -----------------------------------------------------------------------------
oom_every=()  # "SYSTEM K": every:K of SYSTEM ran out of memory, so larger K will too
n=0
for label in $runs; do
  n=$(( n + 1 ))
  system=${label%%/*}
  ac=${label#*/}
  case "$system" in
    *compile*) cap=${CAP_COMPILE:-240}; need=${MIN_COMPILE:-100} ;;
    *offload*) cap=${CAP_OFFLOAD:-180}; need=${MIN_OFFLOAD:-60} ;;
    *) cap=${CAP_EAGER:-120}; need=${MIN_EAGER:-45} ;;
  esac
  if [[ $ac == every:* ]]; then
    k=${ac#every:}
    smaller=""
    for prior in "${oom_every[@]}"; do
      [ "${prior% *}" = "$system" ] && (( ${prior#* } < k )) && smaller=${prior#* }
    done
    if [ -n "$smaller" ]; then
      skip "$label" "$system" "$ac" "every:$smaller ran out of memory, and every:$k keeps more"
      continue
    fi
  fi
  t=$(( $(left) - rannc_min ))
  if (( t < need )); then
    skip "$label" "$system" "$ac" \
      "${t}s left of the ${budget}s budget, a $system run needs ~${need}s"
    continue
  fi
  (( t > cap )) && t=$cap
  json=$tmp/$n.jsonl
  plog=$tmp/$n.log
  say "$label: starting (timeout ${t}s)"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$t" "${peer_pin[@]}" "$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
    ${TORCHRUN_ARGS:-} benchmarks/gpt_peers.py --system "$system" --ac "$ac" --model "$model" \
    ${MODEL_ARGS:-} --device "$device" --warmup "$warmup" --steps "$steps" --out "$json" >"$plog" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  { echo "=== $label (exit status $rc, ${seconds}s)"; cat "$plog"; } >>"$log"
  line=$(pick "$label" "$system" "$ac" "$rc" "$t" "$seconds" "$json" "$plog")
  echo "$line" >>"$results"
  say "$label: exit status $rc after ${seconds}s: $(echo "$line" | cut -c1-160)"
  if [[ $ac == every:* ]] && [[ $line == *'"oom": true'* ]]; then
    oom_every+=("$system ${ac#every:}")
  fi
done

# --- rannc ----------------------------------------------------------------------------------
# ranncd's own plan of workload C (gpt_rannc.py, --amp-level O2: bf16 forward, fp32 masters and
# AdamW state), in the RANNC_MIN seconds the peers leave; the daemon picks stages, micro-batches
# and recomputation itself: no RANNC_* shape keys are set. Its line gets "run": "rannc/auto".
if [ "$rannc" = 1 ]; then
  wait_build
  sys_libs=${SYS:-/tmp/sys}/usr/lib/x86_64-linux-gnu
  [ -d "$sys_libs" ] && export LD_LIBRARY_PATH=$sys_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  t=$(left)
  json=$tmp/rannc.jsonl
  plog=$tmp/rannc.log
  if [ ! -x "$ranncd" ]; then
    why="the build (status $(cat "$tmp/build.rc" 2>/dev/null || echo killed)) made no $ranncd"
    [ -n "${RANNCD:-}" ] && why="RANNCD=$RANNCD is not an executable"
    echo "{\"system\": \"rannc O2\", \"workload\": \"$model\", \"run\": \"rannc/auto\"," \
      "\"error\": \"no ranncd: $why\"}" >>"$results"
  elif (( t < 60 )); then
    skip rannc/auto "rannc O2" auto "${t}s left of the ${budget}s budget"
  else
    # PROFILE=1: runs 2 and 3 of gpt_rannc.py too (the saved plan, then the same job trained
    # in-process by job_bench, whose profiled steps go to OUTDIR/profiles); else run 1 only.
    profile_flags=(--second-steps 0)
    job_bench=${JOB_BENCH:-$(dirname "$ranncd")/../benchmarks/job_bench}
    if [ "${PROFILE:-0}" = 1 ] && [ -x "$job_bench" ]; then
      profile_flags=(--second-steps 1 --job-bench "$job_bench" --profile "$out/profiles"
                     --job-dir "$tmp/job")
    fi
    say "rannc/auto: starting (timeout ${t}s)"
    t0=$(date +%s)
    timeout -k 15 "$t" env RANNC_DAEMON_BIN="$ranncd" RANNC_DEVICES="$rannc_devices" \
      RANNC_DAEMON_LOG="$out/ranncd.log" PYTHONPATH=python_client \
      RANNC_DAEMON_ARGS="--profile-cache $tmp/profiles.tsv" \
      "$python" benchmarks/gpt_rannc.py --model "$model" ${MODEL_ARGS:-} --device "$device" \
      --amp-level O2 \
      --warmup "$warmup" --steps "$steps" --out "$json" "${profile_flags[@]}" \
      --deployment "$out/rannc_${model}.deployment" --pid-file "$tmp/ranncd.pid" \
      ${RANNC_FLAGS:-} >"$plog" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - t0 ))
    if [ -s "$tmp/ranncd.pid" ] && kill -0 "$(cat "$tmp/ranncd.pid")" 2>/dev/null; then
      kill "$(cat "$tmp/ranncd.pid")"
    fi
    { echo "=== rannc/auto (exit status $rc, ${seconds}s)"; cat "$plog"; } >>"$log"
    line=$(pick rannc/auto "rannc O2" auto "$rc" "$t" "$seconds" "$json" "$plog")
    echo "$line" >>"$results"
    # Runs 2 and 3 (PROFILE=1): their own rows, "rannc/auto (saved deployment)" and so on.
    [ -s "$json" ] && "$python" - "$json" >>"$results" <<'EOF'
import json, sys
for line in open(sys.argv[1], encoding="utf-8"):
    r = json.loads(line)
    system = r.get("system", "")
    if system.startswith("rannc O2 ("):
        r["run"] = "rannc/auto" + system[len("rannc O2"):]
        print(json.dumps(r))
EOF
    say "rannc/auto: exit status $rc after ${seconds}s: $(echo "$line" | cut -c1-160)"
  fi
fi

# --- table -----------------------------------------------------------------------------------
if [ -f "$log" ] && [ "$(stat -c %s "$log")" -gt 12000000 ]; then  # the device tool's 16 MiB
  tail -c 12000000 "$log" >"$tmp/trunc" && mv "$tmp/trunc" "$log"
fi
"$python" - "$results" "$model" "$warmup" "$steps" "${PYTORCH_CUDA_ALLOC_CONF:-default}" \
  "${BASELINE:-fsdp2/on}" >"$out/table.md" <<'EOF'
import json, sys
path, workload, warmup, steps, alloc, baseline = sys.argv[1:]
rows = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]

def num(v, fmt):
    return "—" if v is None else format(v, fmt)

def note(r):
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    if r.get("oom"):
        return "out of memory" + (f" (at {r['peak_mem_gib_max']:.1f} GiB allocated)"
                                  if r.get("peak_mem_gib_max") is not None else "")
    if "error" in r:
        return "error: " + r["error"].replace("|", "/").replace("\n", " ")[:200]
    bits = []
    plan = r.get("plan")
    if plan:
        bits.append(f"plan: {plan['stages']} stage(s) x {plan['replicas']} replicas, "
                    f"{plan['micro_batches']} micro-batches, {plan['schedule']}, "
                    f"recompute {plan['recompute']}, est. "
                    f"{plan['estimated_step_ms'] / 1000:.2f} s / "
                    + ", ".join(f"{g:.0f}" for g in plan["estimated_memory_gib"]) + " GiB")
        if any(plan.get("kept_on_device_gib") or []):
            bits.append("parameters kept on the device: "
                        + ", ".join(f"{g:.1f}" for g in plan["kept_on_device_gib"]) + " GiB")
    if r.get("optimizer"):
        bits.append(r["optimizer"])
    if r.get("peak_rss_gib") and r.get("offload"):
        bits.append(f"host peak {max(r['peak_rss_gib']):.0f} GiB")
    if r.get("daemon_peak_rss_gib") is not None and r.get("offload"):
        # ranncd's own, and the client's (which traces the model and frees it once sent)
        bits.append(f"host peak: daemon {r['daemon_peak_rss_gib']:.0f} GiB, client "
                    f"{r.get('host_peak_rss_gib') or 0:.0f} GiB")
    if r.get("host_min_available_gib") is not None and r.get("offload"):
        # the host's memory pressure over the timed steps (gpt_model.HostPressure)
        bits.append(f"host free >= {r['host_min_available_gib']:.0f} GiB, "
                    f"{r.get('host_major_faults')} major faults, "
                    f"{r.get('host_pages_swapped')} pages swapped")
    if r.get("host_min_available_setup_gib") is not None and r.get("offload"):
        bits.append(f"host free >= {r['host_min_available_setup_gib']:.0f} GiB in set-up")
    if r.get("loss_last") is not None:
        bits.append(f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    return "; ".join(bits)

done = [r for r in rows if r.get("tokens_per_s")]
full = next((r for r in done if r.get("run") == baseline), None)
dev = next((r.get("device_name") for r in rows if r.get("device_name")), "GPU")
torch_v = next((r.get("torch") for r in rows if r.get("torch")), "?")
params = next((r.get("params") for r in rows if r.get("params")), None)
print(f"Workload {workload} ({num(params and params / 1e9, '.2f')}B parameters, "
      f"{num(next((r.get('tokens_per_step') for r in done), None), ',')} tokens a step) on "
      f"{dev} (torch {torch_v}); median of {steps} steps after {warmup} warm-up; MFU against "
      f"989 TFLOP/s (model FLOPs, recomputation not counted); PYTORCH_CUDA_ALLOC_CONF={alloc}.")
print()
print(f"| run | blocks recomputed | tokens/s | vs {baseline} | MFU | step s | peak GiB (est.) | "
      "reserved GiB | planning s | first step s | run s | notes |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    tps = r.get("tokens_per_s")
    vs = "—" if not (tps and full) else f"{tps / full['tokens_per_s']:.3f}x"
    peak = r.get("peak_mem_gib_max")
    est = r.get("peak_estimate_gib")
    peak_s = num(peak, ".1f") + (f" ({est:.0f})" if est is not None else "")
    reserved = r.get("peak_reserved_gib") or [r.get("peak_reserved_gib_max")]
    blocks = r.get("ac_blocks")
    ac = r.get("ac", "—")
    mfu = r.get("mfu")
    print(f"| {r.get('run', r.get('system'))} | {ac if blocks is None else f'{ac}: {blocks}'} | "
          f"{num(tps, ',.0f')} | {vs} | "
          f"{'—' if mfu is None else format(100 * mfu, '.1f') + '%'} | "
          f"{num(r.get('step_s_median'), '.3f')} | {peak_s} | "
          f"{num(max(reserved) if None not in reserved else None, '.1f')} | "
          f"{num(r.get('planning_s'), '.1f')} | {num(r.get('time_to_first_step_s'), '.1f')} | "
          f"{num(r.get('run_s'), 'd')} | {note(r)} |")
peers = [r for r in done if not str(r.get("system", "")).startswith("rannc")]
if peers:
    best = max(peers, key=lambda r: r["tokens_per_s"])
    print()
    print(f"Best peer: {best.get('run')} at {best['tokens_per_s']:,.0f} tokens/s"
          + (f", {best['tokens_per_s'] / full['tokens_per_s']:.3f}x {baseline}" if full else "")
          + ".")
EOF
cat "$out/table.md"
say "done; files in $out"
rm -rf "$tmp"
