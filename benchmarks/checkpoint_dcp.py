"""The peer of checkpoint_bench.py on a GPU: torch.distributed.checkpoint (DCP) save and
async_save of the same model under FSDP2, one process on one GPU: JSON lines.

    NCCL_NVLS_ENABLE=0 python3 benchmarks/checkpoint_dcp.py --size gpu-1b --dir /tmp/dcp
    NCCL_NVLS_ENABLE=0 python3 benchmarks/checkpoint_dcp.py --size workload-a --dir /tmp/dcp

The model, its batches and optimizer are checkpoint_bench.py's (its Workload of --size), built
on cuda:0 and sharded with fully_shard per block and on the root over a world of one (this
process's own process group, rank 0 of 1): ByteGPT (small, large, gpu-1b) fp32 with AdamW (lr 3e-3, weight
decay 0.01); workload-a, gpt_model.py's workload A (1.34B parameters, seq 1024, batch 16),
exactly as gpt_peers.py --system fsdp2 sets it up: gpt_model.build on the device (seed
gpt_model.SEED), fully_shard with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
(fp32 sharded parameters, bf16 compute), no activation checkpointing, fused AdamW (lr 1e-4,
betas 0.9/0.95, weight decay 0.1). Either way the state dicts hold the fp32 parameters and
AdamW's exp_avg and exp_avg_sq ("expected_bytes": 12 bytes a parameter). After
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
from checkpoint_bench import SIZES, Workload, disk_write  # noqa: E402


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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    work = Workload(args.size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = work.model(0, device)
    mesh = init_device_mesh("cuda", (1,))
    shard = {"mesh": mesh}
    if work.gpt:  # gpt_peers.py's setup_fsdp2
        shard["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    opt = work.optimizer(model.parameters(), fused=work.gpt)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)

    def step():
        x, y = (ids.to(device) for ids in work.batch_of(gen))
        t = time.perf_counter()
        loss = model(x, y)
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
    out = {"system": "dcp (fsdp2)", "size": args.size, "model": work.describe(),
           "mixed_precision": "bf16 params, fp32 reduce" if work.gpt else None,
           "params": params, "expected_bytes": work.expected_bytes(params),
           "step_s_median": statistics.median(steps[args.warmup:]),
           "bytes": size, "save_s": saves, "async_blocked_s": blocked, "async_total_s": totals,
           "disk_MBps": disk, "save_MBps": size / statistics.median(saves) / 1e6}
    print(json.dumps(out), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
