# Sourced by benchmarks/h200.sh and benchmarks/workload_c.sh: ranncd built in the background on
# the GPU machine while peers run, and the wait for it. The caller defines `say` and `left` (the
# seconds of its budget left) and sets root, out and tmp.
#
#   start_build [PIN...]   tools/gpu_cmake_build.sh into build/gpu in a session of its own
#                          (so that it can be stopped as a group), run under PIN (e.g.
#                          `taskset -c 4-15`); build.log into $out, its exit status into
#                          $tmp/build.rc; sets build_pid
#   wait_build             waits for it, stopping it when less than 60 s of the budget are left

build_pid=""

start_build() {
  setsid bash -c "$* env SYS='${SYS:-/tmp/sys}' DEVICES=cpu:2 \
    tools/gpu_cmake_build.sh build/gpu >'$out/build.log' 2>&1; echo \$? >'$tmp/build.rc'" &
  build_pid=$!
}

wait_build() {
  [ -n "$build_pid" ] || return 0
  while kill -0 "$build_pid" 2>/dev/null; do
    if (( $(left) < 60 )); then
      say "build still running with $(left)s left: stopping it"
      kill -TERM -- "-$build_pid" 2>/dev/null
      sleep 2
      kill -KILL -- "-$build_pid" 2>/dev/null
      break
    fi
    sleep 2
  done
  wait "$build_pid" 2>/dev/null
  say "build finished: status $(cat "$tmp/build.rc" 2>/dev/null || echo killed)"
  build_pid=""
}
