#!/usr/bin/python3
"""Per-step cost of a job over two daemons vs the same plan in one daemon (issue 5), in one run.

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/cluster_overhead.py

Trains examples/train_gpt.py's ByteGPT (defaults: 2 layers, d_model 64, seq 32, batch 8) through
pyrannc with the plan forced to 2 stages x 2 replicas x 2 micro-batches over four CPU devices:
  - one daemon with --devices cpu:4;
  - two daemons with cpu:2 each, a cluster on loopback (--peers): stage 0 on one, stage 1 on
    the other, the client talking to the first.
Prints the median step time (forward + backward + optimizer step, one round trip with
pyrannc's deferred ops) over --steps steps after 3 warm-up steps, and the difference.
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANNCD = os.path.join(ROOT, "bazel-bin", "daemon", "ranncd")

CLIENT = textwrap.dedent("""
    import statistics, sys, time, torch
    sys.path.insert(0, {examples!r})
    import pyrannc
    from train_gpt import ByteGPT
    torch.manual_seed(0)
    model = ByteGPT({layers}, {dim}, 4, {seq}, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rmod = pyrannc.RaNNCModule(model, opt)
    ids = torch.randint(0, 256, ({batch}, {seq}))
    times = []
    for step in range({steps} + 3):
        start = time.perf_counter()
        loss = rmod(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        float(loss)
        times.append(time.perf_counter() - start)
    print(statistics.median(times[3:]) * 1000, rmod._job.devices)
""")


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start(addresses, devices, peers):
    procs = []
    for address in addresses:
        args = [RANNCD, "--listen", address, "--devices", devices, "--profile-cache", "none"]
        if peers:
            args += ["--peers", ",".join(addresses), "--heartbeat-interval", "500ms"]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(3)  # links measured, cluster formed
    return procs


def run(address, args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python_client"), RANNC_DAEMON=address,
               RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2")
    script = CLIENT.format(examples=os.path.join(ROOT, "examples"), layers=args.layers,
                           dim=args.dim, seq=args.seq, batch=args.batch, steps=args.steps)
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    ms, devices = out.split(" ", 1)
    return float(ms), devices


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    results = {}
    for name, count, devices in (("1 daemon, cpu:4", 1, "cpu:4"),
                                 ("2 daemons, cpu:2 each", 2, "cpu:2")):
        addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
        procs = start(addresses, devices, peers=count > 1)
        try:
            results[name] = run(addresses[0], args)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=15)
    print(f"ByteGPT {args.layers} layers, d_model {args.dim}, seq {args.seq}, batch "
          f"{args.batch}; 2 stages x 2 replicas x 2 micro-batches; median of {args.steps} "
          "steps after 3\n")
    print("| setup | step ms | devices |")
    print("|---|---:|---|")
    for name, (ms, devices) in results.items():
        print(f"| {name} | {ms:.1f} | {devices} |")
    one, two = results["1 daemon, cpu:4"][0], results["2 daemons, cpu:2 each"][0]
    print(f"\ntwo daemons - one daemon: {two - one:+.1f} ms per step ({two / one:.2f}x)")


if __name__ == "__main__":
    main()
