#!/bin/bash
# A fuzz target's seed corpus replayed through it (fuzz/BUILD): every input must run to the end.
#   corpus_test.sh FUZZER CORPUS_DIR
set -euo pipefail
fuzzer=$1
corpus=$2
count=$(find -L "$corpus" -type f | wc -l)
[ "$count" -gt 0 ] || { echo "no inputs in $corpus"; exit 1; }
"$fuzzer" "$corpus"
echo "$count inputs of $corpus ran through $(basename "$fuzzer")"
