#!/bin/bash
# Runs test suites under a sanitizer build (.bazelrc's --config=asan: ASan + UBSan, or
# --config=tsan) and fails on any report, from the test processes or from the ranncd and rannc
# processes they start (which write theirs to files: a daemon's stderr is not the test's).
#
#   tools/sanitize.sh asan|tsan [--ci|--torch-free] [TARGET ...]
#
# Without targets, ASan runs the whole list below; --torch-free only the C++ tests that do not
# link LibTorch (what .ci/run runs by default: minutes to build cold), --ci a middle list (CI's
# with RANNC_CI_SANITIZE=full). TSan runs the C++ tests and ASan's daemon-process suites,
# with --torch-free (or --ci) the C++ tests that do not link LibTorch, and those that use gRPC
# only with tools/tsan_deps.sh's instrumented gRPC (see below).
# Reports are left in /tmp/rannc-sanitizer/<sanitizer>.<binary>.<pid> (emptied first) and the
# first lines of each are printed. Suppressions: tools/sanitizers/*.supp, each entry with its
# reason.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
config=${1:-}
shift || true
case "$config" in
  asan|tsan) ;;
  *) echo "usage: tools/sanitize.sh asan|tsan [--ci|--torch-free] [TARGET ...]"; exit 2 ;;
esac
scope=all
case "${1:-}" in
  --ci) scope=ci; shift ;;
  --torch-free) scope=torch-free; shift ;;
esac
targets=("$@")

# What runs. Under ASan every C++ test (the torch-free layers in seconds, the runtime's in
# minutes) and, of the daemon-process suites, those that exercise the daemon's threads (jobs,
# pipelines, streams, clusters, signals), not those that re-check numerics that the plain build
# already holds to PyTorch.
query() { bazel query "kind(cc_test, //...) except attr(tags, gpu, //...) $1" 2>/dev/null; }
daemon_tests=(//tests/daemon:daemon_lifecycle_test //tests/daemon:cluster_test
              //python_client:bad_input_test //python_client:api_test
              //python_client:detached_jobs_test //python_client:exactly_once_test
              //python_client:pipeline_conformance_test //python_client:checkpoints_test
              //tests/daemon:load_test //fuzz:config_corpus_test //fuzz:tensor_codec_corpus_test)
# The middle list (--ci) is every C++ test and these: near 15 minutes on 2 cores once the
# sanitizer build is cached.
ci_extra=(//tests/daemon:daemon_lifecycle_test //python_client:bad_input_test
          //python_client:api_test //fuzz:config_corpus_test //fuzz:tensor_codec_corpus_test)
# TSan sees a race wherever threads hand memory over through code it does not instrument with
# synchronization it cannot see: Debian's gRPC (completion queues, atomics, absl::Mutex), whose
# every test reports hundreds (docs/hardening.md). So TSan runs gRPC's users only against the
# instrumented abseil, gRPC and protobuf that tools/tsan_deps.sh builds from Debian's sources
# (RANNC_TSAN_DEPS_BUILD=1 builds them first, ~20 minutes on 2 cores); without them it runs
# only the tests that use no gRPC. The TSan binaries (tests, ranncd, the rannc CLI) are linked
# with an rpath to them (DT_RPATH, which also covers the libraries they load), so exactly the
# instrumented processes load them: not Bazel's linux-sandbox nor the /usr/bin/python3 of the
# daemon-process suites and of the client's integration tests (Debian's LibTorch and the sandbox
# link libprotobuf, and an instrumented library crashes a process without TSan's runtime).
# With them, --torch-free (CI's) is every C++ test that does not link LibTorch; the whole list
# adds those that do (LibTorch's own reports suppressed in tools/sanitizers/tsan.supp) and the
# daemon-process suites of ASan's list. The lists are queried only when no targets are given.
tsan_flags=()
if [ "$config" = tsan ]; then
  if [ "${RANNC_TSAN_DEPS_BUILD:-0}" = 1 ] && ! tools/tsan_deps.sh --check >/dev/null; then
    tools/tsan_deps.sh >/tmp/rannc-tsan-deps.log 2>&1 ||
      echo "tsan: building the instrumented gRPC failed (/tmp/rannc-tsan-deps.log)"
  fi
  if deps=$(tools/tsan_deps.sh --check); then
    echo "tsan: gRPC, abseil and protobuf instrumented, from $deps"
    tsan_flags=("--linkopt=-Wl,--disable-new-dtags,-rpath,$deps")
  else
    echo "tsan: no instrumented gRPC (tools/tsan_deps.sh): the tests that use gRPC are left out"
  fi
fi
if [ ${#targets[@]} -eq 0 ] && [ "$config" = tsan ]; then
  if [ ${#tsan_flags[@]} -gt 0 ] && [ "$scope" = all ]; then
    targets=($(query "") "${daemon_tests[@]}")
  elif [ ${#tsan_flags[@]} -gt 0 ]; then
    targets=($(query "except rdeps(//..., //third_party:torch)"))
  else
    targets=($(query "except rdeps(//..., //third_party:torch)
                      except rdeps(//..., //third_party:grpc)"))
  fi
elif [ ${#targets[@]} -eq 0 ]; then
  case "$scope" in
    ci) targets=($(query "") "${ci_extra[@]}") ;;
    torch-free) targets=($(query "except rdeps(//..., //third_party:torch)")
                         //fuzz:config_corpus_test) ;;
    *) targets=($(query "") "${daemon_tests[@]}") ;;
  esac
fi

reports=/tmp/rannc-sanitizer
mkdir -p "$reports"
find "$reports" -maxdepth 1 -type f -name '*san.*' ! -name '*.supp' -delete
cp tools/sanitizers/*.supp "$reports"/
start=$(date +%s)
bazel test --config="$config" "${tsan_flags[@]}" "${targets[@]}" 2>&1 |
  tee "/tmp/rannc-$config-test.log" |
  grep -vE "linux-sandbox|^INFO: From Testing|^\(cached\)"
rc=${PIPESTATUS[0]}
# A process whose every finding matched a suppression still leaves a file: LSan's table of the
# suppressions it used (print_suppressions, kept on so that what they hide stays visible). Such a
# file is printed but is no report; anything else in a file is one.
found=$(find "$reports" -maxdepth 1 -type f -name '*san.*' ! -name '*.supp' | sort)
count=0
suppressed=0
for f in $found; do
  if grep -vqE '^(-+|Suppressions used:| *count +bytes +template| *[0-9]+ +[0-9]+ +.+|)$' "$f"
  then
    echo "=== $f"
    count=$((count + 1))
  else
    echo "=== $f (suppressed findings only, not counted)"
    suppressed=$((suppressed + 1))
  fi
  head -n 40 "$f"
done
passed=$(grep -cE "^//[^ ]+ +PASSED" "/tmp/rannc-$config-test.log" || true)
failed=$(grep -cE "^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FLAKY)" "/tmp/rannc-$config-test.log" || true)
echo "$config: ${passed} passed, ${failed} failed, ${count} sanitizer reports" \
     "(${suppressed} with suppressed findings only) in $(( $(date +%s) - start )) s"
[ "$rc" -ne 0 ] && exit "$rc"
[ "$count" -ne 0 ] && exit 1
exit 0
