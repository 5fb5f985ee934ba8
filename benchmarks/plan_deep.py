#!/usr/bin/python3
"""Planning time of deep GPTs through ranncd on this machine's CPU devices.

    bazel build //daemon:ranncd //client:rannc && /usr/bin/python3 benchmarks/plan_deep.py

For each model (examples/train_gpt.py's ByteGPT, AdamW, batch 16 x 64 tokens; default 72 layers
of d_model 512 and 16 layers of d_model 1024), one ranncd (`--devices cpu:4 --device-memory
1GiB`, a fresh profile cache) and two `rannc plan` dry runs of the model for its own devices:
cold (nothing profiled yet) and warm (the same request again). Per run: the CLI's wall time
(the daemon's import of the model included, tracing not), the deployment's planning and
profiling seconds, the IR build's seconds (from the daemon's log), the CPU seconds the daemon
spent (from /proc, which on a busy machine says more than wall time), the plan, and the load
average when the run ended. `--ranncd` points at another daemon binary (e.g. one built from
an older commit) to compare; its log may lack the IR line.

Models are traced at 2 samples (tracing runs forward once; the plan is for --batch 16).
Prints a Markdown table.
"""

import argparse
import os
import re
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

BATCH, SEQ = 16, 64


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shape(d):
    stages = " + ".join(f"{len(s.devices)}x[{s.first_node}:{s.end_node}]" +
                        ("r" if s.recompute else "") for s in d.stages)
    return f"{stages}, {d.micro_batches} micro-batch(es)"


def plan(args, daemon, pid, log_path, model_path, save):
    cmd = [args.rannc, "--daemon", daemon, "plan", model_path, "--devices", "4",
           "--device-memory", "1GiB", "--batch", str(BATCH),
           "--input", f"int64:{BATCH}x{SEQ}", "--input", f"int64:{BATCH}x{SEQ}",
           "--optimizer", "adamw", "--save", save]
    log_before = len(open(log_path).read())
    cpu_before = cpu_seconds(pid)
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    cpu = cpu_seconds(pid) - cpu_before
    d = deployment_pb2.Deployment()
    with open(save, "rb") as f:
        d.ParseFromString(f.read())
    ir = re.findall(r"IR: .* built in ([0-9.]+) s", open(log_path).read()[log_before:])
    return {"wall": wall, "cpu": cpu, "d": d, "ir": float(ir[-1]) if ir else None,
            "load": os.getloadavg()[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranncd", default=os.path.join(ROOT, "bazel-bin/daemon/ranncd"))
    ap.add_argument("--rannc", default=os.path.join(ROOT, "bazel-bin/client/rannc"))
    ap.add_argument("--models", default="72x512,16x1024",
                    help="comma-separated LAYERSxD_MODEL (heads: d_model / 64)")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="also plan each model a second time, from the profile cache")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per plan")
    args = ap.parse_args()
    torch.manual_seed(0)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.models.split(","):
            layers, d_model = (int(x) for x in spec.split("x"))
            model = ByteGPT(layers, d_model, max(1, d_model // 64), SEQ, 0.0)
            params = sum(p.numel() for p in model.parameters())
            path = os.path.join(tmp, f"gpt{spec}.pt")
            ids = torch.randint(0, 256, (2, SEQ))
            torch.jit.trace(model, (ids, ids), check_trace=False).save(path)
            del model

            daemon = f"127.0.0.1:{_free_loopback_port()}"
            log_path = os.path.join(tmp, f"ranncd-{spec}.log")
            log = open(log_path, "w")
            proc = subprocess.Popen(
                [args.ranncd, "--listen", daemon, "--devices", "cpu:4", "--device-memory", "1GiB",
                 "--profile-cache", os.path.join(tmp, f"profiles-{spec}.tsv")],
                stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.time() + 60
                while "listening" not in open(log_path).read():
                    if proc.poll() is not None or time.time() > deadline:
                        raise RuntimeError("ranncd did not start:\n" + open(log_path).read())
                    time.sleep(0.1)
                save = os.path.join(tmp, f"gpt{spec}.deployment")
                for kind in ["cold", "warm"] if args.warm else ["cold"]:
                    r = plan(args, daemon, proc.pid, log_path, path, save)
                    rows.append((spec, params, kind, r))
                    print(f"{spec} {kind}: CLI {r['wall']:.1f} s, planning "
                          f"{r['d'].planning_seconds:.1f} s, daemon CPU {r['cpu']:.1f} s",
                          file=sys.stderr, flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)

    print("| model | params | run | CLI wall | planning (profiling) | IR build | daemon CPU "
          "| load | plan | est. step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, params, kind, r in rows:
        d = r["d"]
        ir = f"{r['ir']:.1f} s" if r["ir"] is not None else "-"
        print(f"| gpt-{spec} | {params / 1e6:.0f} M | {kind} | {r['wall']:.1f} s | "
              f"{d.planning_seconds:.1f} s ({d.profiling_seconds:.1f} s) | {ir} | "
              f"{r['cpu']:.1f} s | {r['load']:.1f} | {shape(d)} | "
              f"{d.estimated_step_ms / 1e3:.1f} s |")


if __name__ == "__main__":
    main()
