#!/usr/bin/python3
"""Planning time and plan quality of ranncd's planner on this machine's CPU devices.

    bazel build //daemon:ranncd //client:rannc && /usr/bin/python3 benchmarks/planning.py

For GPT models of several sizes (examples/train_gpt.py's ByteGPT, AdamW), through a real ranncd
(`--devices cpu:4`) and `rannc plan` dry runs:

1. Planning time, cold (empty profile cache) and warm (the same model again), and the plan the
   planner picks for the daemon's own 4 devices, for 8 hypothetical 80 GiB devices, and for 8
   devices that each hold only 60% of the model's parameters, gradients and optimizer state.
2. The planner's step-time estimate for one device and one micro-batch against the step's
   forward+backward measured in-process with plain PyTorch at the same batch (median of 5
   after 2 warm-up runs): how well profiled block costs add up to the model's.

Prints Markdown tables.
"""

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from pyrannc.proto.rannc.v1 import deployment_pb2  # noqa: E402
from pyrannc._daemon import _free_loopback_port  # noqa: E402
from train_gpt import ByteGPT  # noqa: E402

MODELS = [  # name, layers, d_model, heads, seq, batch
    ("gpt-2x96", 2, 96, 4, 64, 16),
    ("gpt-6x192", 6, 192, 6, 64, 16),
    ("gpt-12x256", 12, 256, 8, 64, 16),
]


def params_of(model):
    return sum(p.numel() for p in model.parameters())


def trace(model, batch, seq, path):
    ids = torch.randint(0, 256, (batch, seq))
    traced = torch.jit.trace(model, (ids, ids), check_trace=False)
    traced.save(path)
    return ids


def plan(rannc, daemon, model_path, batch, seq, devices, memory, save, config=()):
    cmd = [rannc, "--daemon", daemon, "plan", model_path, "--devices", str(devices),
           "--device-memory", memory, "--batch", str(batch),
           "--input", f"int64:{batch}x{seq}", "--input", f"int64:{batch}x{seq}",
           "--optimizer", "adamw", "--save", save]
    for c in config:
        cmd += ["--config", c]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    d = deployment_pb2.Deployment()
    with open(save, "rb") as f:
        d.ParseFromString(f.read())
    return d, wall


def shape(d):
    stages = " + ".join(f"{len(s.devices)}x[{s.first_node}:{s.end_node}]" +
                        ("r" if s.recompute else "") for s in d.stages)
    return f"{len(d.stages)} stage(s) {stages}, {d.micro_batches} micro-batch(es)"


def eager_step_ms(model, ids, reps=5, warmup=2):
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        loss = model(ids, ids)
        loss.backward()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[warmup:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranncd", default=os.path.join(ROOT, "bazel-bin/daemon/ranncd"))
    ap.add_argument("--rannc", default=os.path.join(ROOT, "bazel-bin/client/rannc"))
    args = ap.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        port = _free_loopback_port()
        daemon = f"127.0.0.1:{port}"
        log = open(os.path.join(tmp, "ranncd.log"), "w")
        proc = subprocess.Popen(
            [args.ranncd, "--listen", daemon, "--devices", "cpu:4", "--device-memory", "1GiB",
             "--profile-cache", os.path.join(tmp, "profiles.tsv")],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 30
            while "listening" not in open(log.name).read():
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ranncd did not start:\n" + open(log.name).read())
                time.sleep(0.1)
            links = [l for l in open(log.name).read().splitlines() if "links:" in l]
            print(f"ranncd --devices cpu:4 --device-memory 1GiB; {links[0].split('] ')[-1]}")
            print(f"torch threads: {torch.get_num_threads()}\n")

            rows, estimates = [], []
            for name, layers, d_model, heads, seq, batch in MODELS:
                model = ByteGPT(layers, d_model, heads, seq, 0.0)
                path = os.path.join(tmp, name + ".pt")
                ids = trace(model, batch, seq, path)
                save = os.path.join(tmp, name + ".deployment")
                n = params_of(model)
                cold, cold_wall = plan(args.rannc, daemon, path, batch, seq, 4, "1GiB", save)
                warm, warm_wall = plan(args.rannc, daemon, path, batch, seq, 4, "1GiB", save)
                big, _ = plan(args.rannc, daemon, path, batch, seq, 8, "80GiB", save)
                one, _ = plan(args.rannc, daemon, path, batch, seq, 1, "80GiB", save,
                              ["pipeline_num=1"])
                # 60% of the whole model's parameters, gradients and AdamW state, and a tenth of
                # one batch's activations (margin included): no single device holds the model.
                fixed = one.stages[0].fixed_bytes
                acts = one.stages[0].memory_bytes - fixed
                tight_bytes = int((0.6 * fixed + 0.1 * acts) / (1 - one.mem_margin))
                tight, _ = plan(args.rannc, daemon, path, batch, seq, 8, str(tight_bytes), save)
                rows.append((name, n, batch, seq, cold, cold_wall, warm, warm_wall, big, tight,
                             tight_bytes))
                estimates.append((name, batch, one.estimated_step_ms, eager_step_ms(model, ids)))

            print("| model | params | batch x seq | cold plan (profiling) | warm plan | "
                  "cpu:4 x 1 GiB | 8 x 80 GiB | 8 x tight |")
            print("|---|---|---|---|---|---|---|---|")
            for (name, n, batch, seq, cold, cold_wall, warm, warm_wall, big, tight,
                 tight_bytes) in rows:
                print(f"| {name} | {n / 1e6:.2f} M | {batch} x {seq} | "
                      f"{cold.planning_seconds:.2f} s ({cold.profiling_seconds:.2f} s); "
                      f"CLI {cold_wall:.2f} s | {warm.planning_seconds:.2f} s; CLI "
                      f"{warm_wall:.2f} s | {shape(cold)}, est. {cold.estimated_step_ms:.1f} ms "
                      f"| {shape(big)}, est. {big.estimated_step_ms:.1f} ms | "
                      f"{tight_bytes / 2**20:.1f} MiB: {shape(tight)}, est. "
                      f"{tight.estimated_step_ms:.1f} ms |")
            print()
            print("| model | batch | planner estimate, 1 device (ms) | PyTorch fwd+bwd (ms) | "
                  "estimate / measured |")
            print("|---|---|---|---|---|")
            for name, batch, est, measured in estimates:
                print(f"| {name} | {batch} | {est:.1f} | {measured:.1f} | {est / measured:.2f} |")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
