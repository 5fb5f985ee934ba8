#!/usr/bin/python3
"""Failover time on etcd (issue 29): a job's leading daemon SIGKILLed mid-training, until the
client's first step on the daemon that took the job over, against the checkpoint's size.

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/failover_bench.py \
        [--sizes small,large,xl] [--lease 10] [--dir DIR]

For each size: a one-member etcd and two ranncd (`--devices cpu:2`, `--cluster-store`,
`--cluster-lease LEASE` seconds) on loopback, and a client (RANNC_DAEMON=both) training
examples/train_gpt.py's ByteGPT (fp32, AdamW) on random bytes with checkpoints every 5 steps
into a directory both daemons share, on 2 stages x 1 replica (so the job fits either daemon's
two devices: before, the first daemon's; after, the second's). After step 7 (the checkpoint of
step 5 committed) the test SIGKILLs the leading daemon. Reported, from the kill:
- takeover: when the second daemon logs that the job lost its leader and it takes it over (its
  etcd watch saw the leader's key go with its lease: at most the lease's TTL, less the time
  since its last renewal);
- restored: when it logs the job running again (its record read from the shared directory, the
  checkpoint read and checked, the plan made and deployed: its "took over" line gives that span);
- client: when the client's call raised JobMoved (its retries back off up to 2 s between
  LocateJob questions);
- first step: when the client's first step on the new leader ended (the failover as a user sees
  it).
Sizes (layers, d_model, heads, seq, batch): small (2, 96, 4, 64, 16: ~3 MB a checkpoint), large
(4, 512, 8, 32, 4: ~150 MB), xl (8, 1024, 16, 32, 4: ~1.2 GB). A checkpoint holds 12 bytes a
parameter (fp32 parameter, AdamW's exp_avg and exp_avg_sq). Markdown on stdout.
"""

import argparse
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = {"small": (2, 96, 4, 64, 16), "large": (4, 512, 8, 32, 4),
         "xl": (8, 1024, 16, 32, 4)}
KILL_AFTER = 7

CLIENT = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {examples!r})
    import pyrannc
    from train_gpt import ByteGPT
    torch.manual_seed(0)
    layers, d, heads, seq, batch = {size!r}
    model = ByteGPT(layers, d, heads, seq, 0.0)
    print("params", sum(p.numel() for p in model.parameters()), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    rmod = pyrannc.RaNNCModule(model, opt)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (batch, seq + 1), generator=gen) for _ in range({steps})]
    step = 0
    while step < {steps}:
        try:
            ids = batches[step]
            rmod(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            # The step's deferred ops ride on the next forward: flush them to time this one.
            rmod._flush()
            print("step", step, time.time(), flush=True)
        except pyrannc.JobMoved as moved:
            print("moved", moved.step, time.time(), flush=True)
            step = moved.step
""")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def log_time(line):
    """The epoch seconds of a daemon log line "[2026-12-04 09:16:13.985] ..." (local time)."""
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\]", line)
    stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")
    return time.mktime(stamp.timetuple()) + stamp.microsecond / 1e6


def run(size, lease, work, ranncd):
    client_port, peer_port, a_port, b_port = free_ports(4)
    etcd = subprocess.Popen(
        ["etcd", "--name", "m0", "--data-dir", os.path.join(work, "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"m0=http://127.0.0.1:{peer_port}", "--logger", "zap",
         "--log-outputs", "stderr"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peers = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    logs = [os.path.join(work, f"ranncd-{i}.log") for i in range(2)]
    daemons = []
    try:
        time.sleep(1.0)
        for address, log in zip(peers, logs):
            daemons.append(subprocess.Popen(
                [ranncd, "--listen", address, "--devices", "cpu:2", "--peers", ",".join(peers),
                 "--cluster-store", f"etcd://127.0.0.1:{client_port}",
                 "--cluster-lease", f"{lease}s", "--heartbeat-interval", "200ms",
                 "--profile-cache", "none", "--links", "p2p=5GB/s,allreduce=2:3GB/s"],
                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                env=dict(os.environ, RANNC_STATE_DIR="none")))
        deadline = time.time() + 60
        while not all("is UP" in open(log).read() for log in logs):
            assert time.time() < deadline, open(logs[0]).read()
            time.sleep(0.1)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python_client"),
                   RANNC_DAEMON=",".join(peers), RANNC_JOB=f"failover-{size}",
                   RANNC_CHECKPOINT_DIR=os.path.join(work, "ckpt"), RANNC_CHECKPOINT_EVERY="5",
                   RANNC_CALL_RETRY_TIMEOUT="120", RANNC_PARTITION_NUM="2",
                   RANNC_REPLICA_NUM="1", RANNC_PIPELINE_NUM="1")
        script = CLIENT.format(examples=os.path.join(ROOT, "examples"), size=SIZES[size],
                               steps=KILL_AFTER + 5)
        client = subprocess.Popen([sys.executable, "-c", script], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        params = killed = moved = first = None
        step_s = []
        last = None
        for line in client.stdout:
            words = line.split()
            if words[0] == "params":
                params = int(words[1])
            elif words[0] == "step":
                now = float(words[2])
                if last is not None and killed is None:
                    step_s.append(now - last)
                last = now
                if int(words[1]) == KILL_AFTER and killed is None:
                    # The checkpoint of step 5 is committed by now (it is written meanwhile).
                    ckpt = os.path.join(work, "ckpt", f"failover-{size}")
                    while not any(n.startswith("step-") for n in os.listdir(ckpt)):
                        time.sleep(0.05)
                    daemons[0].send_signal(signal.SIGKILL)
                    killed = time.time()
                elif moved is not None and first is None:
                    first = now
            elif words[0] == "moved":
                moved = float(words[2])
        client.wait(timeout=600)
        if client.returncode != 0:
            raise RuntimeError(client.stderr.read() + open(logs[1]).read())
        text = open(logs[1]).read().splitlines()
        takeover = next(log_time(l) for l in text if "lost its leader" in l)
        took = next(l for l in text if "took over job" in l)
        restored = log_time(took)
        ckpt_bytes = int(re.search(r"committed: (\d+) bytes", open(logs[0]).read()).group(1))
        return {"size": size, "params": params, "bytes": ckpt_bytes, "lease": lease,
                "step_s": sorted(step_s)[len(step_s) // 2] if step_s else float("nan"),
                "takeover": takeover - killed, "restored": restored - killed,
                "client": moved - killed, "first": first - killed}
    finally:
        for d in daemons:
            if d.poll() is None:
                d.kill()
            d.wait()
        etcd.kill()
        etcd.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,large,xl")
    parser.add_argument("--lease", type=int, default=10, help="--cluster-lease, seconds")
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    ranncd = os.environ.get("RANNC_DAEMON_BIN") or os.path.join(ROOT, "bazel-bin/daemon/ranncd")
    rows = []
    for size in args.sizes.split(","):
        work = args.dir or tempfile.mkdtemp(prefix="failover-bench-")
        work = os.path.join(work, size)
        os.makedirs(work, exist_ok=True)
        try:
            rows.append(run(size, args.lease, work, ranncd))
            print(f"{size}: {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            if not args.dir:
                shutil.rmtree(os.path.dirname(work), ignore_errors=True)
    print(f"| size | parameters | checkpoint | step | lease | takeover | restored | "
          f"client's JobMoved | first resumed step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['bytes'] / 1e6:.0f} MB | "
              f"{r['step_s']:.2f} s | {r['lease']} s | {r['takeover']:.2f} s | "
              f"{r['restored']:.2f} s | {r['client']:.2f} s | {r['first']:.2f} s |")


if __name__ == "__main__":
    main()
