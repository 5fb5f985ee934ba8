"""The peer of checkpoint_bench.py on a GPU: torch.distributed.checkpoint (DCP) save and
async_save of the same model under FSDP2, one process on one GPU: JSON lines.

    NCCL_NVLS_ENABLE=0 python3 benchmarks/checkpoint_dcp.py --size gpu-1b --dir /tmp/dcp

The model and optimizer are checkpoint_bench.py's (examples/train_gpt.py's ByteGPT of --size,
fp32, AdamW), sharded with fully_shard per block and on the root over a world of one. After
--warmup steps, --checkpoints times each: a step; dcp.save of {'model', 'optim'} (the state
dicts of torch.distributed.checkpoint.state_dict), timed whole (training is blocked for all of
it); a step; dcp.async_save, timed until it returns (blocked) and until its future completes
(total). Also the median step, the bytes written (the directory's size) and the disk's
sequential write speed in the same directory (as checkpoint_bench.py measures it).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_bench import SIZES, disk_write  # noqa: E402


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="gpu-1b", choices=sorted(SIZES))
    p.add_argument("--checkpoints", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dir", default="/tmp/dcp-bench")
    args = p.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from train_gpt import ByteGPT

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    layers, dim, heads, seq, batch = SIZES[args.size]
    torch.manual_seed(0)
    model = ByteGPT(layers, dim, heads, seq, 0.0).to(device)
    mesh = init_device_mesh("cuda", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, 256, (batch, seq + 1), generator=gen).to(device)
        t = time.perf_counter()
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    steps = [step() for _ in range(args.warmup)]
    shutil.rmtree(args.dir, ignore_errors=True)
    saves, blocked, totals, sizes = [], [], [], []
    for i in range(args.checkpoints):
        steps.append(step())
        target = os.path.join(args.dir, f"save-{i}")
        t = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=target)
        saves.append(time.perf_counter() - t)
        sizes.append(dir_bytes(target))
        shutil.rmtree(target)
        steps.append(step())
        target = os.path.join(args.dir, f"async-{i}")
        t = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=target)
        blocked.append(time.perf_counter() - t)
        future.result()
        totals.append(time.perf_counter() - t)
        shutil.rmtree(target)
    size = statistics.median(sizes)
    disk = size / disk_write(os.path.join(args.dir, "disk-test"), int(size)) / 1e6
    out = {"system": "dcp (fsdp2)", "size": args.size,
           "params": sum(p.numel() for p in model.parameters()),
           "step_s_median": statistics.median(steps[args.warmup:]),
           "bytes": size, "save_s": saves, "async_blocked_s": blocked, "async_total_s": totals,
           "disk_MBps": disk, "save_MBps": size / statistics.median(saves) / 1e6}
    print(json.dumps(out), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
