#!/usr/bin/python3
"""Per-step overhead of training through ranncd, and client<->daemon tensor throughput.

    bazel build //daemon:ranncd && PYTHONPATH=python_client /usr/bin/python3 benchmarks/overhead.py

1. Step time (forward, backward, optimizer.step, zero_grad; AdamW) of the same model trained
   in-process with plain PyTorch and through pyrannc against an embedded ranncd on loopback, for
   a small MLP and a medium GPT; the difference is the client/daemon split's cost per step.
2. Tensor throughput for 1-64 MiB tensors: a no-grad forward whose output is its input (both
   ways) and one whose output is one element (client -> daemon), with same-host shared memory
   (pyrannc's default) and with the bytes inline in gRPC messages (RANNC_SHM=0). The figure
   includes everything a forward costs the client beyond the model: encoding, the RPC, the
   daemon's copies and the client's new output tensor.

Each figure is the median over repetitions after warm-up. Prints a Markdown table.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(16, 32)
    y = torch.randint(0, 10, (16,))

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    return WithLoss(), (x, y)


def gpt():
    from train_gpt import ByteGPT  # the README's example model
    model = ByteGPT(layers=2, d=128, heads=4, max_len=64, dropout=0.0)
    ids = torch.randint(0, 256, (8, 65))
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def step_times(model, optimizer, inputs, steps, warmup):
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(*inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        float(loss)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_steps(name, make, steps, warmup):
    import pyrannc
    torch.manual_seed(0)
    local_model, inputs = make()
    local = step_times(local_model, torch.optim.AdamW(local_model.parameters(), lr=1e-3),
                       inputs, steps, warmup)
    torch.manual_seed(0)
    model, inputs = make()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = pyrannc.RaNNCModule(model, opt)
    remote = step_times(wrapped, opt, inputs, steps, warmup)
    wrapped.undeploy()
    return name, params, local, remote


class Echo(nn.Module):
    """Returns its input: the tensor crosses both ways and the daemon computes nothing."""

    def forward(self, x):
        return x.view(-1)


class Head(nn.Module):
    """Returns a one-element slice: the tensor crosses to the daemon only."""

    def forward(self, x):
        return x[:1] + 0


def bench_throughput(sizes_mib, reps):
    import pyrannc
    rows = []
    for mib in sizes_mib:
        x = torch.randn(mib * (1 << 20) // 4)
        for label, model_cls, directions in (("both ways", Echo, 2), ("to daemon", Head, 1)):
            model = pyrannc.RaNNCModule(model_cls(), None)
            times = []
            with torch.no_grad():
                model(x)  # job creation and reply-region sizing
                for _ in range(reps):
                    t0 = time.perf_counter()
                    out = model(x)
                    times.append(time.perf_counter() - t0)
            if model_cls is Echo:
                assert torch.equal(out, x)
            t = statistics.median(times)
            rows.append((mib, label, t, directions * mib / 1024 / t))
            model.undeploy()
    return rows


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--inline", action="store_true",
                        help="(internal) run the throughput part with RANNC_SHM=0")
    args = parser.parse_args()

    if args.inline:
        for mib, label, t, gbs in bench_throughput([1, 4, 16, 64], args.reps):
            print(f"THROUGHPUT\t{mib}\t{label}\t{t}\t{gbs}")
        return

    print(f"host: {os.cpu_count()} cores, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()} (client and daemon alike), "
          f"RANNC_DEFER_OPS={os.environ.get('RANNC_DEFER_OPS', '1')}\n")
    print("| model | parameters | in-process step | through ranncd | overhead per step |")
    print("|---|---|---|---|---|")
    for name, make in (("MLP 32-64-10, batch 16", mlp), ("GPT 2x128, seq 64, batch 8", gpt)):
        n, params, local, remote = bench_steps(name, make, args.steps, args.warmup)
        print(f"| {n} | {params:,} | {local * 1e3:.2f} ms | {remote * 1e3:.2f} ms | "
              f"{(remote - local) * 1e3:+.2f} ms |")

    shm = bench_throughput([1, 4, 16, 64], args.reps)
    # Inline bytes: the embedded daemon must accept 64 MiB messages.
    env = dict(os.environ, RANNC_SHM="0", RANNC_MAX_MESSAGE_SIZE="1GiB")
    out = subprocess.run([sys.executable, __file__, "--inline", "--reps", str(args.reps)],
                         env=env, capture_output=True, text=True, check=True).stdout
    inline = {}
    for line in out.splitlines():
        if line.startswith("THROUGHPUT"):
            _, mib, label, t, gbs = line.split("\t")
            inline[(int(mib), label)] = (float(t), float(gbs))
    print("\n| tensor | direction | shared memory | inline gRPC bytes | local copy into a new "
          "tensor |")
    print("|---|---|---|---|---|")
    for mib, label, t, gbs in shm:
        it, igbs = inline[(mib, label)]
        local = ""
        if label == "both ways":
            # What any new tensor of this size costs this process (page faults + copy): the
            # floor for receiving an output, in-process or not.
            x = torch.randn(mib * (1 << 20) // 4)
            lt = statistics.median(_timed(lambda: torch.empty_like(x).copy_(x), args.reps))
            local = f"{lt * 1e3:.1f} ms, {mib / 1024 / lt:.2f} GB/s"
        print(f"| {mib} MiB | {label} | {t * 1e3:.1f} ms, {gbs:.2f} GB/s | "
              f"{it * 1e3:.1f} ms, {igbs:.2f} GB/s | {local} |")


if __name__ == "__main__":
    main()
