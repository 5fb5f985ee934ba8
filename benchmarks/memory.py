#!/usr/bin/python3
"""Device memory per mode (the memory and precision issue): the planner's estimate against the
daemon's measured peak, and the optimizer state each device holds.

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/memory.py [--layers 4 --dim 256]

One ranncd with --devices cpu:4 trains examples/train_gpt.py's ByteGPT (defaults: 4 layers,
d_model 256, seq 64, batch 16; AdamW) through pyrannc, in each mode (plain, enable_zero,
enable_apex_amp bf16, both, offload_params, offload_params with enable_zero) and each forced
plan (1 stage x 4 replicas; 2 stages x 2 replicas x 2 micro-batches), 3 steps each. A mode whose
job creation raises NotImplementedError (offload_params before the daemon has it) is skipped,
saying so. Per mode and plan it prints, for the first device (or --device):
  - params: what it holds before training (ListJobs' device_bytes after a no-grad forward):
    its parameters and, with replicas and without ZeRO, the gradient reducer's buckets;
  - opt state: what the optimizer state adds after the steps (device_bytes with the gradients
    set to None, minus params; with --zero-grad-in-place the zeroed gradients too);
  - estimate: the planner's memory estimate for the device's stage (Deployment.stages[].
    memory_bytes);
  - peak: the measured peak (ListJobs' peak_device_bytes: what the device held when a step
    began, the gradient reducer's buffers included, plus the high-water mark of its worker's
    allocations during it), and estimate / peak.
With offload_params, params and opt state are what the device keeps between steps (nothing but
buffers and the reducer's buckets, which are transient then too).
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANNCD = os.path.join(ROOT, "bazel-bin", "daemon", "ranncd")

CLIENT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {examples!r})
    import pyrannc
    from pyrannc import _daemon
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    from train_gpt import ByteGPT

    def summary(rmod):
        jobs = _daemon.connection().call("ListJobs", pb.Empty()).jobs
        return next(j for j in jobs if j.job_id == rmod._job.id)

    torch.manual_seed(0)
    model = ByteGPT({layers}, {dim}, 4, {seq}, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, ({batch}, {seq}))
    try:
        rmod = pyrannc.RaNNCModule(model, opt, enable_zero={zero}, enable_apex_amp={amp},
                                   offload_params={offload})
        with torch.no_grad():
            rmod(ids, ids)
    except NotImplementedError as e:
        print(json.dumps({{"skipped": str(e)}}))
        sys.exit(0)
    params = list(summary(rmod).device_bytes)
    for step in range(3):
        loss = rmod(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none={set_to_none})
    float(loss)
    rmod.get_param("pos")  # runs the deferred ops
    s = summary(rmod)
    d = rmod.deployment
    estimate = {{dev: st.memory_bytes for st in d.stages for dev in st.devices}}
    print(json.dumps({{"params": params, "held": list(s.device_bytes),
                      "peak": list(s.peak_device_bytes),
                      "estimate": [estimate[i] for i in range(len(params))],
                      "fixed": [{{dev: st.fixed_bytes for st in d.stages
                                 for dev in st.devices}}[i] for i in range(len(params))],
                      "stages": [list(st.devices) for st in d.stages]}}))
""")

PLANS = {"1x1x4": ("1", "1", "4"), "2x2x2": ("2", "2", "2")}
# mode: (enable_zero, enable_apex_amp, offload_params)
MODES = {"plain": (False, False, False), "zero": (True, False, False),
         "amp": (False, True, False), "zero+amp": (True, True, False),
         "offload": (False, False, True), "zero+offload": (True, False, True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated subset")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--port", type=int, default=50981)
    parser.add_argument("--zero-grad-in-place", action="store_true",
                        help="zero_grad(set_to_none=False), PyTorch 1.x's default (the "
                        "runtime frees zeroed gradients as set_to_none=True does)")
    parser.add_argument("--device", type=int, default=0,
                        help="the device to report (2: the second stage of 2x2x2)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the estimate's batch-independent part (fixed_bytes)")
    args = parser.parse_args()
    address = f"127.0.0.1:{args.port}"
    daemon = subprocess.Popen([RANNCD, "--listen", address, "--devices", "cpu:4",
                               "--profile-cache", "none"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    try:
        print(f"ByteGPT {args.layers} layers, d_model {args.dim}, seq {args.seq}, batch "
              f"{args.batch}, AdamW, cpu:4; device {args.device}, MiB")
        print(f"{'plan':7} {'mode':12} {'params':>7} {'opt state':>9} {'estimate':>8} "
              f"{'peak':>7} {'est/peak':>8}")
        for plan_name in args.plans.split(","):
            p, m, r = PLANS[plan_name]
            for mode in args.modes.split(","):
                zero, amp, offload = MODES[mode]
                env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python_client"),
                           RANNC_DAEMON=address, RANNC_PARTITION_NUM=p, RANNC_PIPELINE_NUM=m,
                           RANNC_REPLICA_NUM=r)
                script = CLIENT.format(examples=os.path.join(ROOT, "examples"),
                                       layers=args.layers, dim=args.dim, seq=args.seq,
                                       batch=args.batch, zero=zero, amp=amp, offload=offload,
                                       set_to_none=not args.zero_grad_in_place)
                out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                     capture_output=True, text=True).stdout.strip().splitlines()
                got = json.loads(out[-1])
                if "skipped" in got:
                    print(f"{plan_name:7} {mode:12} skipped: {got['skipped']}", flush=True)
                    continue
                mib = 1 << 20
                dev = args.device
                params, held = got["params"][dev], got["held"][dev]
                estimate, peak = got["estimate"][dev], got["peak"][dev]
                print(f"{plan_name:7} {mode:12} {params / mib:7.2f} {(held - params) / mib:9.2f} "
                      f"{estimate / mib:8.2f} {peak / mib:7.2f} {estimate / peak:8.2f}"
                      + (f"  fixed {got['fixed'][dev] / mib:.2f}" if args.verbose else ""),
                      flush=True)
    finally:
        daemon.terminate()
        daemon.wait()


if __name__ == "__main__":
    main()
