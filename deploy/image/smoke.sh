#!/bin/bash
# Smoke check of the rannc image, run INSIDE it as its user (deploy/image/build.sh runs it in
# the root filesystem through rootfs-hook.sh; a container runtime can too):
#
#   podman run --rm -v ./deploy/image/smoke.sh:/smoke.sh:ro --entrypoint /smoke.sh rannc:cpu
#
# Prints the first lines of `ranncd --help` and `rannc --help`, imports pyrannc, then starts
# ranncd on a free loopback port with one CPU device, asks it for its info with `rannc info`,
# trains a small model through pyrannc against it for 5 steps (the loss must go down) and stops
# it with SIGTERM, which must end it cleanly. Exits non-zero at the first failure.
set -euo pipefail
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

for cmd in ranncd rannc; do
  echo "== $cmd --help | head -3"
  # The whole output first: `head` closing the pipe early must not fail the program.
  "$cmd" --help >"$work/help.txt"
  head -3 "$work/help.txt"
done

echo "== python3 -c 'import pyrannc'"
python3 -c 'import grpc, pyrannc, torch
print("import pyrannc: ok:", pyrannc.__file__, "(torch", torch.__version__ + ", grpc",
      grpc.__version__ + ")")'

echo "== ranncd on loopback: rannc info, 5 pyrannc training steps, SIGTERM"
ranncd --listen 127.0.0.1:0 --devices cpu:1 --device-memory 1GiB --profile-cache none \
  --links p2p=5GB/s,allreduce=2:3GB/s >"$work/ranncd.log" 2>&1 &
pid=$!
address=""
for _ in $(seq 1 120); do
  address=$(sed -n 's/.*ranncd listening on \([0-9.]*:[0-9]*\).*/\1/p' "$work/ranncd.log" | head -1)
  [ -n "$address" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "ranncd exited at start:"; cat "$work/ranncd.log"; exit 1; }
  sleep 0.5
done
[ -n "$address" ] || { echo "ranncd did not listen within 60 s:"; cat "$work/ranncd.log"; exit 1; }
rannc --daemon "$address" info >"$work/info.txt"
head -4 "$work/info.txt"
RANNC_DAEMON=$address python3 - <<'EOF'
import torch
import torch.nn.functional as F

import pyrannc


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


torch.manual_seed(0)
model = MLP()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
rmod = pyrannc.RaNNCModule(model, opt)
x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
losses = []
for _ in range(5):
    loss = rmod(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("pyrannc: 5 steps, loss %.4f -> %.4f" % (losses[0], losses[-1]))
EOF
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
pid=""
if [ "$status" -ne 0 ]; then
  echo "ranncd exited with $status on SIGTERM:"
  tail -5 "$work/ranncd.log"
  exit 1
fi
echo "ranncd at $address: stopped cleanly on SIGTERM"
echo "image check: ok"
