#!/usr/bin/python3
"""The largest GPT (by layer count) that trains on `cpu:4 --device-memory 1GiB` in each mode,
with the planner's estimate beside it (the memory and precision issue).

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/largest_gpt.py

One ranncd with `--devices cpu:4 --device-memory 1GiB` (links measured at start, one profile
cache for the whole run). The model is examples/train_gpt.py's ByteGPT with d_model 512 (8
heads, dropout 0, tied head), trained on batches of 4 sequences of 16 tokens with AdamW
(lr 1e-3): so small a batch that parameters, gradients and optimizer state, which grow with
the layers, are what fills the devices. Only the layer count varies; the planner chooses the
plan (stages, replicas, micro-batches, recomputation) freely.

Modes: plain, zero (enable_zero=True), amp (enable_apex_amp=True: bf16 autocast, fp32
masters), zero+amp, offload (offload_params=True), zero+offload. A mode pyrannc refuses
(offload_params raises NotImplementedError until it is built) is skipped, printing why.

Search, per mode: dry-run plans (a CreateJob with JobSpec.dry_run: the daemon imports the model
and plans it for its own four devices without creating a job; one client process answers all
of a mode's) from a start count, growing
geometrically (x2 for the first mode from 8 layers, x1.25 from the previous mode's answer for
the others) until the planner refuses ("no plan fits"), then bisecting. The largest count that
plans is then trained for 2 steps through pyrannc.RaNNCModule; it must give finite losses, or
the search goes on below it with training runs, each in a fresh client process. Since all
layers share one structure, each count after the first plans from the cached profiles of
one layer.

Per mode it prints: layers, parameters, the plan (stages x replicas x micro-batches, `r` for a
stage that recomputes), the planner's estimate per device (the largest
Deployment.stages[].memory_bytes) and the measured peak (the largest ListJobs
peak_device_bytes after the steps, as benchmarks/memory.py reads it), their ratio, the two
losses and how long the mode's search took.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))

from pyrannc._daemon import _free_loopback_port  # noqa: E402

MODES = {  # name: (enable_zero, enable_apex_amp, offload_params)
    "plain": (False, False, False),
    "zero": (True, False, False),
    "amp": (False, True, False),
    "zero+amp": (True, True, False),
    "offload": (False, False, True),
    "zero+offload": (True, False, True),
}

# A client process for one mode. With `action` "plan" it reads layer counts from stdin, one per
# line, and answers each with a dry-run plan (a JSON line), so that one process (one import of
# torch) serves a mode's whole search; with "train" it trains `layers` layers for 2 steps. A
# mode pyrannc does not take answers {"unsupported": why}.
CLIENT = textwrap.dedent("""
    import json, math, sys, torch
    sys.path.insert(0, {examples!r})
    import grpc
    import pyrannc
    from pyrannc import _codec, _config, _daemon, _optim, _shm
    from pyrannc.errors import RanncError
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    from train_gpt import ByteGPT

    def plan_of(d):
        return {{"stages": len(d.stages), "replicas": [len(s.devices) for s in d.stages],
                "micro_batches": d.micro_batches,
                "recompute": [bool(s.recompute) for s in d.stages],
                "estimate": max(s.memory_bytes for s in d.stages),
                "estimated_step_ms": d.estimated_step_ms,
                "planning_seconds": d.planning_seconds}}

    def module(layers):
        torch.manual_seed(0)
        model = ByteGPT(layers, {dim}, {heads}, {seq}, 0.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rmod = pyrannc.RaNNCModule(model, opt, enable_zero={zero}, enable_apex_amp={amp},
                                   offload_params={offload})
        return model, opt, rmod

    def dry_run(layers):
        model, opt, rmod = module(layers)
        out = {{"layers": layers, "params": sum(p.numel() for p in model.parameters())}}
        ids = torch.randint(0, 256, ({batch}, {seq}))
        conn = _daemon.connection()
        model_bytes, _ = rmod._trace((ids[:1], ids[:1]), rmod._current_mode())
        names_by_id = {{id(p): n for n, p in model.named_parameters()}}
        options = pb.JobOptions(check_unused_values=True, enable_zero={zero},
                                enable_apex_amp={amp}, offload_params={offload},
                                config=_config.job_config())
        with _shm.session(conn.shm) as wire:
            spec = pb.JobSpec(name="largest_gpt", mode=rmod._current_mode(),
                              optimizer=_optim.optimizer_spec(opt, names_by_id),
                              options=options, example_inputs=[wire.encode(ids)] * 2,
                              input_names=["idx", "targets"], model_bytes=len(model_bytes),
                              dry_run=pb.PlanTarget(num_devices=4, batch_size={batch}))
            step = _codec.chunk_bytes(_codec.MODEL_CHUNK_BYTES, conn.info.max_message_bytes)

            def requests():
                yield pb.CreateJobRequest(spec=spec)
                for off in range(0, len(model_bytes), step):
                    yield pb.CreateJobRequest(model_chunk=model_bytes[off:off + step])

            try:
                resp = conn.call_streaming_request("CreateJob", requests())
                out.update(fits=True, **plan_of(resp.deployment))
            except RanncError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                out.update(fits=False, why=e.details or str(e))
        return out

    def train(layers):
        model, opt, rmod = module(layers)
        ids = torch.randint(0, 256, ({batch}, {seq}))
        losses = []
        for _ in range(2):
            loss = rmod(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        rmod.get_param("pos")  # runs the deferred optimizer step
        jobs = _daemon.connection().call("ListJobs", pb.Empty()).jobs
        job = next(j for j in jobs if j.job_id == rmod._job.id)
        return {{"layers": layers, "params": sum(p.numel() for p in model.parameters()),
                "losses": losses, "finite": all(math.isfinite(l) for l in losses),
                "peak": max(job.peak_device_bytes), **plan_of(rmod.deployment)}}

    try:
        module(1)
    except NotImplementedError as e:
        print(json.dumps({{"unsupported": str(e)}}), flush=True)
        sys.exit(0)
    if {action!r} == "train":
        print(json.dumps(train({layers})), flush=True)
    else:
        print(json.dumps({{"ready": True}}), flush=True)
        for line in sys.stdin:
            print(json.dumps(dry_run(int(line))), flush=True)
""")


def client_script(args, action, mode, layers=0):
    zero, amp, offload = MODES[mode]
    return CLIENT.format(examples=os.path.join(ROOT, "examples"), action=action, layers=layers,
                         dim=args.dim, heads=args.heads, seq=args.seq, batch=args.batch,
                         zero=zero, amp=amp, offload=offload)


def train(args, env, layers, mode):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", client_script(args, "train", mode, layers)],
                         env=env, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - start
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}, seconds
    return json.loads(lines[-1]), seconds


class Planner:
    """A client process answering dry-run plans for one mode."""

    def __init__(self, args, env, mode):
        self.proc = subprocess.Popen([sys.executable, "-c", client_script(args, "plan", mode)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.first = json.loads(self.proc.stdout.readline() or '{"error": "client died"}')

    def plan(self, layers):
        self.proc.stdin.write(f"{layers}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client died planning {layers} layers")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def search(args, env, planner, mode, start, growth, log):
    """The largest layer count that plans and trains in `mode`, and its training run."""
    planned = {}

    def fits(layers):
        if layers not in planned:
            t = time.perf_counter()
            r = planner.plan(layers)
            planned[layers] = r["fits"]
            log(f"  {mode}: {layers} layers {'plan' if r['fits'] else 'do not plan'} "
                f"({time.perf_counter() - t:.0f} s)")
        return planned[layers]

    lo, hi, layers = 0, None, start
    if fits(layers):
        lo = layers
        while hi is None and layers < args.max_layers:
            layers = min(args.max_layers, max(layers + 1, int(layers * growth)))
            if fits(layers):
                lo = layers
            else:
                hi = layers
        if hi is None:
            hi = args.max_layers + 1
    else:
        hi = layers
        while lo == 0 and layers > 1:
            layers = max(1, int(layers / growth))
            if fits(layers):
                lo = layers
            else:
                hi = layers
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    planner.close()
    # Train the largest that plans; below it, bisect with training runs if it fails.
    good, bad, best = 0, lo + 1, None
    layers = lo
    while layers > good:
        r, s = train(args, env, layers, mode)
        ok = "error" not in r and r["finite"]
        log(f"  {mode}: {layers} layers {'train' if ok else 'fail to train'} ({s:.0f} s)"
            + ("" if ok else f": {r.get('error', r.get('losses'))}"))
        if ok:
            good, best = layers, r
        else:
            bad = layers
        layers = (good + bad) // 2
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranncd", default=os.path.join(ROOT, "bazel-bin", "daemon", "ranncd"))
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--start", type=int, default=8, help="first layer count of the first mode")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: "
                    + ", ".join(MODES))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per client run")
    args = ap.parse_args()
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        address = f"127.0.0.1:{_free_loopback_port()}"
        log_path = os.path.join(tmp, "ranncd.log")
        daemon = subprocess.Popen(
            [args.ranncd, "--listen", address, "--devices", "cpu:4", "--device-memory", "1GiB",
             "--profile-cache", os.path.join(tmp, "profiles.tsv")],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python_client"),
                   RANNC_DAEMON=address)
        rows = []
        try:
            deadline = time.time() + 60
            while "listening" not in open(log_path).read():
                if daemon.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ranncd did not start:\n" + open(log_path).read())
                time.sleep(0.1)
            links = [l for l in open(log_path).read().splitlines() if "links:" in l]
            log(f"ranncd --devices cpu:4 --device-memory 1GiB; {links[0].split('] ')[-1]}")
            previous = None
            for mode in args.modes.split(","):
                mode_start = time.perf_counter()
                planner = Planner(args, env, mode)
                if "ready" not in planner.first:
                    why = planner.first.get("unsupported", planner.first.get("error"))
                    planner.close()
                    log(f"{mode}: skipped: {why}")
                    rows.append((mode, None, why, 0))
                    continue
                start, growth = (previous, 1.25) if previous else (args.start, 2.0)
                best = search(args, env, planner, mode, start, growth, log)
                rows.append((mode, best, None, time.perf_counter() - mode_start))
                if best:
                    previous = best["layers"]
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)

    print(f"ByteGPT d_model {args.dim} ({args.heads} heads), seq {args.seq}, batch {args.batch}, "
          f"AdamW; ranncd --devices cpu:4 --device-memory 1GiB; total {time.perf_counter() - t0:.0f} s")
    print()
    print("| mode | layers | parameters | plan | estimate / device | peak / device | "
          "estimate / peak | losses | search |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for mode, r, why, seconds in rows:
        if r is None:
            print(f"| {mode} | - | - | skipped: {why or 'nothing trained'} | | | | | |")
            continue
        reps = r["replicas"]
        shape = (f"{r['stages']} x {reps[0]}" if len(set(reps)) == 1
                 else f"{r['stages']} x ({','.join(map(str, reps))})")
        recompute = sum(r["recompute"])
        plan = (f"{shape} x {r['micro_batches']}"
                + (f", {recompute} stage(s) recompute" if recompute else ""))
        print(f"| {mode} | {r['layers']} | {r['params'] / 1e6:.1f} M | {plan} | "
              f"{r['estimate'] / mib:.0f} MiB | {r['peak'] / mib:.0f} MiB | "
              f"{r['estimate'] / r['peak']:.2f} | "
              f"{r['losses'][0]:.3f}, {r['losses'][1]:.3f} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
