#!/bin/bash
# Smoke check of a CMake build (docs/building.md): starts BUILD_DIR/daemon/ranncd on a free
# loopback port with two CPU devices (or DEVICES, e.g. DEVICES=cuda on a GPU machine), asks it
# for its info with BUILD_DIR/client/rannc, and
# trains a small traced model with BUILD_DIR/client/train_example until its loss goes down; then
# stops the daemon with SIGTERM, which must end it cleanly. PYTHON (default /usr/bin/python3)
# traces the model and must have the PyTorch that matches the daemon's LibTorch.
#
#   tools/cmake_smoke.sh build
set -euo pipefail
build=$(cd "${1:?usage: cmake_smoke.sh BUILD_DIR}" && pwd)
python=${PYTHON:-/usr/bin/python3}
devices=${DEVICES:-cpu:2}
work=$(mktemp -d)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "cmake smoke: FAILED: $*"; sed 's/^/  ranncd: /' "$work/ranncd.log" | tail -20; exit 1; }

"$build/daemon/ranncd" --help >/dev/null || fail "ranncd --help"
memory=(--device-memory 1GiB)
[[ $devices == cpu* ]] || memory=()
"$build/daemon/ranncd" --listen 127.0.0.1:0 --devices "$devices" "${memory[@]}" \
  --profile-cache none --links p2p=5GB/s,allreduce=2:3GB/s >"$work/ranncd.log" 2>&1 &
daemon_pid=$!
address=""
for _ in $(seq 1 120); do
  address=$(sed -n 's/.*ranncd listening on \([0-9.]*:[0-9]*\).*/\1/p' "$work/ranncd.log" | head -1)
  [ -n "$address" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || fail "ranncd exited at start"
  sleep 0.5
done
[ -n "$address" ] || fail "ranncd did not report its address within 60 s"

"$build/client/rannc" --daemon "$address" info >"$work/info.txt" || fail "rannc info"
if [ "$devices" = cpu:2 ]; then
  grep -q "^devices: 2" "$work/info.txt" || fail "rannc info does not list 2 devices: $(cat "$work/info.txt")"
fi

"$python" -c 'import sys, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
torch.jit.save(torch.jit.trace(m, torch.randn(16, 8)), sys.argv[1])' "$work/model.pt"
"$build/client/train_example" "$work/model.pt" --daemon "$address" --input-shape 16,8 \
  --steps 5 --lr 0.5 >"$work/train.txt" || fail "train_example: $(cat "$work/train.txt")"
first=$(awk '/^step 0 /{print $4}' "$work/train.txt")
last=$(awk '/^step 4 /{print $4}' "$work/train.txt")
awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a)}' ||
  fail "train_example's loss did not go down: $(cat "$work/train.txt")"

kill -TERM "$daemon_pid"
status=0
wait "$daemon_pid" || status=$?
daemon_pid=""
[ "$status" -eq 0 ] || fail "ranncd exited with $status on SIGTERM"
echo "cmake smoke: ok (ranncd at $address, --devices $devices: info, 5 training steps, loss $first -> $last, clean stop)"
