"""O2's weight casts on one GPU: one kernel per tensor against multi-tensor copies.

amp_level=O2 (docs/runtime.md) reads every weight through a cast to bf16 in each micro-batch's
forward, and autograd widens each bf16 gradient back to fp32 in its backward: one copy kernel
per tensor each way (docs/benchmarks.md, "Where a step's time goes": PyTorch's generic copy
kernel at ~1.2 TB/s on workload A). This times both directions over a workload's parameter
shapes (gpt_model.py's GPT, built on the meta device and materialized on the GPU), three ways:

  per-tensor   t.to(bf16) for each tensor (what the traced graph runs), and the gradient's
               widening as autograd's backward of that cast does it (g.to(fp32));
  foreach      torch._foreach_copy_ into tensors allocated each time (the multi-tensor kernel,
               batched across dtypes since PyTorch 2.4), in groups of at most --group-mib MiB
               of fp32 bytes, in the model's order;
  foreach-all  the same with every tensor in one group.

  python3 benchmarks/cast_bench.py [--model C] [--repeats 20] [--group-mib 256]

Prints one JSON line: milliseconds per pass (median of --repeats, after 3 warm-up passes) and
the bytes moved per second, for each way and direction. Needs PyTorch 2.4+ with CUDA.
"""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpt_model as gm  # noqa: E402


def groups_of(tensors, limit_bytes):
    out, group, size = [], [], 0
    for t in tensors:
        bytes_ = t.numel() * t.element_size()
        if group and size + bytes_ > limit_bytes:
            out.append(group)
            group, size = [], 0
        group.append(t)
        size += bytes_
    if group:
        out.append(group)
    return out


def timed(fn, repeats):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gm.add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--group-mib", type=float, default=256)
    ap.set_defaults(model="C")
    args = ap.parse_args()
    cfg = gm.workload_of(args)
    model = gm.build(cfg, torch.device("cuda"))
    masters = [p.detach() for p in model.parameters()]
    grads = [torch.randn_like(p, dtype=torch.bfloat16) for p in masters]
    n = sum(p.numel() for p in masters)
    bytes_moved = n * 6  # fp32 read and bf16 written, or the reverse

    def per_tensor_down():
        return [p.to(torch.bfloat16) for p in masters]

    def per_tensor_up():
        return [g.to(torch.float32) for g in grads]

    def foreach(srcs, dtype, limit):
        def run():
            out = []
            for group in groups_of(srcs, limit):
                dst = [torch.empty_like(t, dtype=dtype) for t in group]
                torch._foreach_copy_(dst, group)
                out.extend(dst)
            return out
        return run

    # The same values whichever way (a cast is exact one way, a widening the other).
    for a, b in zip(per_tensor_down(), foreach(masters, torch.bfloat16, 1 << 62)()):
        assert torch.equal(a, b)
    for a, b in zip(per_tensor_up(), foreach(grads, torch.float32, 1 << 62)()):
        assert torch.equal(a, b)

    group = int(args.group_mib * 2**20)
    result = {"workload": cfg.name, "params": n, "tensors": len(masters),
              "group_mib": args.group_mib, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    ways = {
        "per_tensor": (per_tensor_down, per_tensor_up),
        "foreach": (foreach(masters, torch.bfloat16, group), foreach(grads, torch.float32,
                                                                     group // 2)),
        "foreach_all": (foreach(masters, torch.bfloat16, 1 << 62),
                        foreach(grads, torch.float32, 1 << 62)),
    }
    for name, (down, up) in ways.items():
        down_ms, up_ms = timed(down, args.repeats), timed(up, args.repeats)
        result[name] = {"cast_ms": round(down_ms, 3), "widen_ms": round(up_ms, 3),
                        "cast_tb_s": round(bytes_moved / down_ms / 1e9, 3),
                        "widen_tb_s": round(bytes_moved / up_ms / 1e9, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
