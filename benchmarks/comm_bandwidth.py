"""Usage: bazel build -c opt //benchmarks:comm_bench && /usr/bin/python3 benchmarks/comm_bandwidth.py

Runs the UCX backend (ranks as threads of one process, benchmarks/comm_bench.cc) and
torch.distributed's Gloo (one process per rank, benchmarks/comm_gloo.py) in one run, on the same
machine, and prints one Markdown table: send/recv bandwidth rank 0 -> 1 (bytes / time) and
all_reduce algbw (bytes / time) and busbw (algbw * 2(n-1)/n), float32, median after warm-up.
Options: --ranks 4 --sizes_mib 1,4,16,64,256 --reps 5 --chunk_kib 1024 (UCX ring chunk).
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(text):
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("sendrecv", "allreduce"):
            out[(parts[0], int(parts[1]))] = float(parts[2])
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes_mib", default="1,4,16,64,256")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk_kib", type=int, default=1024)
    args = parser.parse_args()
    common = ["--ranks", str(args.ranks), "--sizes_mib", args.sizes_mib, "--reps", str(args.reps)]
    bench = os.path.join(ROOT, "bazel-bin/benchmarks/comm_bench")
    ucx = parse(subprocess.run([bench] + common + ["--chunk_kib", str(args.chunk_kib)],
                               check=True, capture_output=True, text=True).stdout)
    gloo = parse(subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/comm_gloo.py")]
                                + common, check=True, capture_output=True, text=True).stdout)
    n = args.ranks
    print(f"{n} ranks, float32, median of {args.reps} after warm-up; GB/s = 1e9 bytes/s; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}\n")
    print("| size | system | send/recv GB/s | all_reduce algbw GB/s | all_reduce busbw GB/s |")
    print("|---:|---|---:|---:|---:|")
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        size = mib << 20
        for name, res in (("rannc UCX (threads)", ucx), ("torch gloo (processes)", gloo)):
            p2p = size / res[("sendrecv", size)] / 1e9
            alg = size / res[("allreduce", size)] / 1e9
            print(f"| {mib} MiB | {name} | {p2p:.2f} | {alg:.2f} | {alg * 2 * (n - 1) / n:.2f} |")


if __name__ == "__main__":
    main()
