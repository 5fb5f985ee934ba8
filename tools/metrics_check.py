"""Checks ranncd's metrics endpoint on the devices at hand (the GPU machine's CUDA devices, where
the Prometheus server of //python_client:observability_test is not installed): starts ranncd
with --metrics-listen, trains a small GPT with pyrannc for --steps steps, scrapes /metrics once,
prints the job's series and checks them against the client's count and ListJobs.

    RANNC_DAEMON_BIN=build/gpu/daemon/ranncd PYTHONPATH=python_client \\
        python3 tools/metrics_check.py --devices cuda [--steps 30]
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

import torch


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    address, metrics = f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"
    daemon = subprocess.Popen([os.environ["RANNC_DAEMON_BIN"], "--listen", address, "--devices",
                               args.devices, "--metrics-listen", metrics, "--state-dir", "none",
                               "--log-format", "json"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    os.environ.update(RANNC_DAEMON=address, RANNC_JOB="metrics-check")
    try:
        import pyrannc
        from pyrannc.proto.rannc.v1 import training_pb2 as pb
        from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc
        import grpc
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 256), layer,
                                    torch.nn.Linear(256, 1000))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        rmod = pyrannc.RaNNCModule(model, opt)
        start = time.monotonic()
        for _ in range(args.steps):
            x = torch.randint(0, 1000, (16, 128))
            loss = rmod(x).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        rmod.state_dict()  # the deferred last step is sent
        print(f"{args.steps} steps in {time.monotonic() - start:.1f} s")
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        series = {}
        for line in text.splitlines():
            if line.startswith("rannc_job_") and 'rannc_job="metrics-check"' in line and \
                    "_bucket{" not in line:
                print(line)
                series[line.split("{")[0]] = float(line.split()[-1])
        with grpc.insecure_channel(address) as channel:
            job = rpc.TrainingServiceStub(channel).ListJobs(pb.Empty(), timeout=30).jobs[0]
        print("ListJobs:", f"steps {job.steps}, device_bytes {list(job.device_bytes)},",
              f"step {job.step_seconds:.4f} s (busy {job.busy_seconds:.4f}, planned",
              f"{job.planned_step_seconds:.4f}), bubble {job.bubble:.3f} (planned",
              f"{job.planned_bubble:.3f}), tokens/s {job.tokens_per_second:.0f}")
        problems = []
        if series.get("rannc_job_steps_total") != args.steps:
            problems.append(f"steps {series.get('rannc_job_steps_total')} != {args.steps}")
        if series.get("rannc_job_steps_total") != job.steps:
            problems.append("the endpoint's steps differ from ListJobs'")
        if not series.get("rannc_job_device_memory_bytes", 0) > 0:
            problems.append("no device memory")
        if series.get("rannc_job_device_memory_bytes") != sum(job.device_bytes):
            problems.append("the endpoint's memory differs from ListJobs'")
        if series.get("rannc_job_tokens_total") != args.steps * 16 * 128:
            problems.append(f"tokens {series.get('rannc_job_tokens_total')}")
        print("metrics check:", "; ".join(problems) if problems else "OK")
        return 1 if problems else 0
    finally:
        daemon.terminate()
        out, _ = daemon.communicate(timeout=30)
        print("ranncd's last lines:\n" + "\n".join(out.splitlines()[-4:]))


if __name__ == "__main__":
    sys.exit(main())
