#!/bin/sh
# Runs one C++ test as `bazel test` would (see rannc_cc_test in RanncRules.cmake): ctest starts it
# from the build tree's root with the runfiles variables set; this gives it an empty TEST_TMPDIR
# of its own and removes it afterwards.
TEST_TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/rannc-test.XXXXXX") || exit 1
export TEST_TMPDIR
"$@"
rc=$?
rm -rf "$TEST_TMPDIR"
exit $rc
