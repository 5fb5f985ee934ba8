#!/usr/bin/python3
"""Host memory of an offloaded job (issue 27's workload D is bounded by it): the client's and
the embedded daemon's resident memory, per parameter, after a few steps of a GPT trained with
offload_params=True on CPU devices.

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/host_memory.py [--layers 4]

The model is gpt_model's workload A (d_model 2048, vocab 32000) with --layers layers, trained
on batches of --batch sequences of --seq tokens (small: the parameters, not the activations,
should fill the memory) with AdamW. pyrannc starts its own ranncd on cpu:1 (RANNC_DAEMON_BIN
picks another binary, for a comparison). Printed, one JSON line: the parameter count N; the
daemon's resident memory after the steps and its peak (VmRSS, VmHWM of /proc/PID/status); the
client's resident memory and peak; each also in bytes per parameter. What an offloaded job
must hold on the host is 16 bytes a parameter in the daemon (fp32 masters, gradients, AdamW's
two moments) and the client's own model (4).
"""

import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python_client"))

import torch  # noqa: E402

import gpt_model as gm  # noqa: E402


def proc_status(pid, key):
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("RANNC_DEVICES", "cpu:1")
    import pyrannc
    from pyrannc import _daemon

    cfg = gm.workload_of(argparse.Namespace(model="A", layers=args.layers, seq=args.seq,
                                            batch=args.batch))
    model = gm.build(cfg, "cpu", attention="sdpa")
    n = gm.param_count(cfg)
    client_model_rss = proc_status(os.getpid(), "VmRSS")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(gm.SEED + 1)
    started = time.perf_counter()
    rmod = pyrannc.RaNNCModule(model, opt, offload_params=True)
    losses, phases = [], []
    flush = getattr(rmod, "_flush", None)  # pyrannc's deferred backward/step/zero_grad
    pid = None
    for step in range(args.steps):
        tokens, targets = gm.batch(cfg, cfg.batch, gen)
        loss = rmod(tokens, targets)
        losses.append(float(loss))
        pid = pid or _daemon.current_connection().embedded.proc.pid
        phases.append((f"step {step}: forward", proc_status(pid, "VmRSS") / 2**30))
        loss.backward()
        opt.step()
        if flush is not None:
            flush()
        phases.append((f"step {step}: backward, step", proc_status(pid, "VmRSS") / 2**30))
        opt.zero_grad(set_to_none=True)
        if flush is not None:
            flush()
        phases.append((f"step {step}: zero_grad", proc_status(pid, "VmRSS") / 2**30))
    record = {
        "params": n,
        "layers": args.layers,
        "seconds": time.perf_counter() - started,
        "offload_blocks": [s.offload_blocks for s in rmod.deployment.stages],
        "daemon_rss_gib": proc_status(pid, "VmRSS") / 2**30,
        "daemon_peak_gib": proc_status(pid, "VmHWM") / 2**30,
        "client_rss_gib": proc_status(os.getpid(), "VmRSS") / 2**30,
        "client_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "client_model_rss_gib": client_model_rss / 2**30,
        "losses": losses,
        "daemon_rss_gib_by_phase": phases,
    }
    for key in ("daemon_rss", "daemon_peak", "client_rss", "client_peak"):
        record[key + "_bytes_per_param"] = record[key + "_gib"] * 2**30 / n
    print(json.dumps(record))
    pyrannc.clear()


if __name__ == "__main__":
    main()
