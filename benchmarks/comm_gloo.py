"""Gloo reference for benchmarks/comm_bandwidth.py: torch.distributed backend="gloo", one
process per rank via torch.multiprocessing.spawn on loopback. Prints "op bytes seconds" lines
like comm_bench (send/recv rank 0 -> 1, all_reduce; float32; median after warm-up).

    /usr/bin/python3 benchmarks/comm_gloo.py --ranks 4 --sizes_mib 1,4 --reps 5
"""
import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, args, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    for mib in args.sizes_mib:
        t = torch.ones((mib << 20) // 4, dtype=torch.float32)  # touched before timing
        p2p, ar = [], []
        for it in range(args.warmup + args.reps):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= args.warmup:
                p2p.append(elapsed.item())
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= args.warmup:
                ar.append(elapsed.item())
        if rank == 0:
            queue.put(f"sendrecv {mib << 20} {statistics.median(p2p):.9f}")
            queue.put(f"allreduce {mib << 20} {statistics.median(ar):.9f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes_mib", default="1,4,16,64,256")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    args.sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_run, args=(args, port, queue), nprocs=args.ranks, join=True)
    while not queue.empty():
        print(queue.get(), flush=True)


if __name__ == "__main__":
    main()
