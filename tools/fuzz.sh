#!/bin/bash
# Builds the libFuzzer targets of fuzz/BUILD with clang-14 (ASan + UBSan) and runs each for a
# while, growing its corpus in a working copy; prints executions, coverage and crashes per target.
#
#   tools/fuzz.sh [SECONDS_EACH] [TARGET ...]      (default: 60 s, every target in fuzz/BUILD)
#
# Needs clang-14 and libclang-rt-14-dev (apt-get install clang-14 libclang-rt-14-dev). Builds in
# its own Bazel output base (~/.cache/rannc-fuzz-bazel): switching the compiler there leaves the
# main build's cache alone. A crash leaves its input as OUT/TARGET/crash-*; add it to
# fuzz/corpus/TARGET once fixed, so that //fuzz:TARGET_corpus_test keeps it fixed. OUT defaults
# to /tmp/rannc-fuzz; each target's log is OUT/TARGET.log, its grown corpus OUT/TARGET/corpus.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
seconds=${1:-60}
shift || true
out=${OUT:-/tmp/rannc-fuzz}
for tool in clang-14 clang++-14; do
  if ! command -v "$tool" >/dev/null; then
    echo "fuzz.sh: no $tool (apt-get install clang-14 libclang-rt-14-dev)"
    exit 2
  fi
done
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then  # each rannc_fuzz_target's name in fuzz/BUILD
  mapfile -t targets < <(awk '/rannc_fuzz_target\(/ { getline; if (match($0, /"[^"]+"/))
                                print substr($0, RSTART + 1, RLENGTH - 2) }' fuzz/BUILD)
fi
bazel_fuzz=(bazel --output_base="$HOME/.cache/rannc-fuzz-bazel")
build_flags=(--config=fuzz --symlink_prefix=/)  # the workspace's bazel-* links stay the main build's
if ! CC=clang-14 CXX=clang++-14 "${bazel_fuzz[@]}" build "${build_flags[@]}" \
    $(printf '//fuzz:%s_fuzzer ' "${targets[@]}") >"$out.build.log" 2>&1; then
  mkdir -p "$out"
  tail -30 "$out.build.log"
  echo "fuzz.sh: the build failed (log: $out.build.log)"
  exit 1
fi
bin=$(CC=clang-14 CXX=clang++-14 "${bazel_fuzz[@]}" info "${build_flags[@]}" bazel-bin 2>/dev/null)
mkdir -p "$out"
status=0
printf '%-20s %8s %12s %10s %6s %8s  %s\n' target seconds executions exec/s cov features crashes
for t in "${targets[@]}"; do
  work=$out/$t
  mkdir -p "$work/corpus"
  cp -n fuzz/corpus/"$t"/* "$work/corpus/" 2>/dev/null
  touch "$work/.started"  # crash files of earlier runs are not this run's
  # LibTorch's own leaks are suppressed, each with its reason (tools/sanitizers/lsan.supp).
  (cd "$work" && LSAN_OPTIONS="suppressions=$root/tools/sanitizers/lsan.supp" \
     "$bin/fuzz/${t}_fuzzer" -max_total_time="$seconds" -print_final_stats=1 \
     -timeout=10 -rss_limit_mb=4096 corpus >"$out/$t.log" 2>&1)
  rc=$?
  runs=$(grep -oP 'stat::number_of_executed_units:\s*\K[0-9]+' "$out/$t.log" | tail -1)
  rate=$(grep -oP 'stat::average_exec_per_sec:\s*\K[0-9]+' "$out/$t.log" | tail -1)
  cov=$(grep -oP '#[0-9]+\s+(DONE|pulse|NEW|REDUCE)\s+cov: \K[0-9]+' "$out/$t.log" | tail -1)
  ft=$(grep -oP '#[0-9]+\s+(DONE|pulse|NEW|REDUCE)\s+cov: [0-9]+ ft: \K[0-9]+' "$out/$t.log" | tail -1)
  crashes=$(find "$work" -maxdepth 1 -newer "$work/.started" \( -name 'crash-*' \
            -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  printf '%-20s %8s %12s %10s %6s %8s  %s\n' "$t" "$seconds" "${runs:-?}" "${rate:-?}" \
    "${cov:-?}" "${ft:-?}" "$crashes"
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    status=1
    grep -m3 -E 'ERROR|SUMMARY' "$out/$t.log"
  fi
done
exit $status
