#!/usr/bin/python3
"""Pipeline efficiency of ranncd's engine on this machine's CPU devices (issue 4).

    bazel build //benchmarks:pipeline_bench && /usr/bin/python3 benchmarks/pipeline_efficiency.py

Traces a small GPT (examples/train_gpt.py's ByteGPT; defaults 4 layers, d_model 128, 4 heads,
seq 64, batch 16, dropout 0) with torch.jit.trace into a temporary .pt and runs
bazel-bin/benchmarks/pipeline_bench on it, which for the 1F1B and GPipe schedules at
several micro-batch counts m (and the single-stage data-parallel plan as a baseline):

1. plans the model with the stages, replicas, m and schedule forced (links measured once for
   the devices, in-memory profile cache shared by every plan);
2. executes that plan with the real PipelineEngine on N CPU devices (threads, 1 LibTorch thread
   each) and takes the median of --steps timed training steps after 2 warm-up steps;
3. reports the measured step, the planner's estimate of the same plan, the ideal step (the
   step's profiled compute spread evenly over the N devices), the bubble fraction
   1 - ideal / measured, and estimate / measured.

With --zero-buckets B1,B2,... it instead times ZeRO's gradient reduction (enable_zero, AdamW)
on the --stages x replicas plan, once per bucket size: a bucket as large as a stage's gradients
is one reduce-scatter as the backward ends, smaller ones overlap it (docs/benchmarks.md).

Prints a Markdown table (stdout); progress goes to stderr.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from train_gpt import ByteGPT  # noqa: E402

BINARY = os.path.join(ROOT, "bazel-bin", "benchmarks", "pipeline_bench")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", choices=["ucx", "fake"], default="ucx")
    p.add_argument("--binary", default=BINARY)
    p.add_argument("--zero-buckets", default="",
                   help="comma-separated bucket sizes in bytes: ZeRO (AdamW) rows on the "
                   "--stages x replicas plan with the first --micro-batches count, one per size, "
                   "instead of the pipeline rows")
    args = p.parse_args()

    if not os.path.exists(args.binary):
        sys.exit(f"{args.binary} not found; run: bazel build //benchmarks:pipeline_bench")

    torch.manual_seed(0)
    model = ByteGPT(args.layers, args.d_model, args.heads, args.seq, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpt.pt")
        ids = torch.randint(0, 256, (args.batch, args.seq))
        torch.jit.trace(model, (ids, ids), check_trace=False).save(path)
        print(f"ByteGPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
              f"{sum(t.numel() for t in model.parameters())} parameters", flush=True)
        result = subprocess.run(
            [args.binary, "--model", path, "--batch", str(args.batch), "--seq", str(args.seq),
             "--devices", str(args.devices), "--stages", str(args.stages),
             "--micro-batches", args.micro_batches, "--steps", str(args.steps),
             "--backend", args.backend] +
            (["--zero-buckets", args.zero_buckets] if args.zero_buckets else []),
            check=False)
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
