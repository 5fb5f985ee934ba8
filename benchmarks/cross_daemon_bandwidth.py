#!/usr/bin/python3
"""Data-plane bandwidth across daemons vs inside one daemon (issue 5), in one run.

    bazel build //benchmarks:comm_bench && /usr/bin/python3 benchmarks/cross_daemon_bandwidth.py

Runs benchmarks/comm_bench three ways with the same ranks, sizes and repetitions:
  - threads: every rank a thread of one process, as one daemon's CPU devices are;
  - processes: one process per rank meeting through the gRPC store (comm/grpc_store.h), as
    ranks on different daemons of one host are; UCX picks its transports (shared memory);
  - processes over TCP: the same with UCX_TLS=tcp, so every byte crosses the loopback network
    stack, as between daemons on different hosts.
Prints a Markdown table: send/recv rank 0 -> 1 and all_reduce algbw (bytes / slowest rank's
time), float32, median after warm-up. Options: --ranks 4 --sizes_mib 1,4,16,64 --reps 5.
"""
import argparse
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bazel-bin/benchmarks/comm_bench")


def parse(text):
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("sendrecv", "allreduce"):
            out[(parts[0], int(parts[1]))] = float(parts[2])
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(common, ranks, env):
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([BENCH, "--rank", "0", "--serve_store", address] + common,
                              stdout=subprocess.PIPE, text=True, env=env)]
    for r in range(1, ranks):
        procs.append(subprocess.Popen([BENCH, "--rank", str(r), "--store", address] + common,
                                      stdout=subprocess.DEVNULL, env=env))
    out, _ = procs[0].communicate(timeout=1800)
    for p in procs[1:]:
        p.wait(timeout=60)
    if any(p.returncode for p in procs):
        sys.exit(f"comm_bench failed: {[p.returncode for p in procs]}")
    return parse(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes_mib", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not os.path.exists(BENCH):
        sys.exit(f"{BENCH} not found; run: bazel build //benchmarks:comm_bench")
    common = ["--ranks", str(args.ranks), "--sizes_mib", args.sizes_mib, "--reps", str(args.reps)]
    env = dict(os.environ)
    threads = parse(subprocess.run([BENCH] + common, check=True, capture_output=True,
                                   text=True).stdout)
    processes = run_processes(common, args.ranks, env)
    tcp = run_processes(common, args.ranks, dict(env, UCX_TLS="tcp"))
    print(f"{args.ranks} ranks, float32, median of {args.reps} after warm-up; GB/s = 1e9 bytes/s\n")
    print("| size | ranks as | send/recv GB/s | all_reduce algbw GB/s |")
    print("|---:|---|---:|---:|")
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        size = mib << 20
        for name, res in (("threads (one daemon)", threads),
                          ("processes (daemons on one host)", processes),
                          ("processes, UCX_TLS=tcp (across hosts)", tcp)):
            p2p = size / res[("sendrecv", size)] / 1e9
            alg = size / res[("allreduce", size)] / 1e9
            print(f"| {mib} MiB | {name} | {p2p:.2f} | {alg:.2f} |")


if __name__ == "__main__":
    main()
