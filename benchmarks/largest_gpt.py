#!/usr/bin/python3
"""The largest GPT (by layer count) that trains on `cpu:4 --device-memory 1GiB` in each mode,
with the planner's estimate beside it (the memory and precision issue).

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/largest_gpt.py

A fresh ranncd per mode with `--devices cpu:4 --device-memory 1GiB` (links measured at its
start; one profile cache for the whole run, so a mode profiles only what no earlier mode
did: amp's autocast profiles once). The model is examples/train_gpt.py's ByteGPT with d_model
512 (8 heads, dropout 0, tied head), trained on batches of 4 sequences of 16 tokens with AdamW
(lr 1e-3): so small a batch that parameters, gradients and optimizer state, which grow with
the layers, are what fills the devices. Only the layer count varies; the planner chooses the
plan (stages, replicas, micro-batches, recomputation) freely.

Modes: plain, zero (enable_zero=True), amp (enable_apex_amp=True: bf16 autocast, fp32
masters), zero+amp, offload (offload_params=True), zero+offload. A mode pyrannc refuses
(NotImplementedError, as offload_params raised before it was built) is skipped, printing why.

Search, per mode: dry-run plans (a CreateJob with JobSpec.dry_run: the daemon imports the model
and plans it for its own four devices without creating a job; one client process answers all
of a mode's) from a start count (--start for the first mode, the previous mode's answer for
the others). Each answer carries the bytes per device the planner needs (the plan's estimate,
or the least any plan needs when none fits), which grow about linearly with the layers, so the
next count tried is where the line through the answers nearest the limit reaches it; this ends
with a count that plans next to one that does not, usually after two or three plans. The
largest count that plans is then trained for 2 steps through pyrannc.RaNNCModule; it must give
finite losses, or the search goes on below it with training runs, each in a fresh client
process, whose job is deleted after it (a job outlives its client on a remote daemon). Since
all layers share one structure, each count after the first plans from the cached profiles of
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
    import json, math, re, sys, torch
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
                why = e.details or str(e)
                need = re.search(r"needs at least ([0-9.]+) GiB", why)
                usable = re.search(r"only ([0-9.]+) GiB is usable", why)
                out.update(fits=False, why=why,
                           need=float(need.group(1)) * 2**30 if need else None,
                           usable=float(usable.group(1)) * 2**30 if usable else None)
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
        out = {{"layers": layers, "params": sum(p.numel() for p in model.parameters()),
               "losses": losses, "finite": all(math.isfinite(l) for l in losses),
               "peak": max(job.peak_device_bytes), **plan_of(rmod.deployment)}}
        # A job outlives its client on a remote daemon: delete it, or each mode's largest
        # model (parameters, gradients, optimizer state) stays in the daemon's memory.
        _daemon.connection().call("DeleteJob", pb.JobRef(job_id=rmod._job.id))
        return out

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


def search(args, env, planner, mode, start, log):
    """The largest layer count that plans and trains in `mode`, and its training run.

    Planning: every answer carries the per-device bytes the planner needs (the plan's estimate,
    or the least any plan needs when none fits), which grow about linearly with the layers. So
    the next count tried is where the line through the two answers nearest the limit reaches
    it (through the origin after the first answer), kept inside [largest that plans + 1,
    smallest that does not - 1]; a count tried before is replaced by the bracket's middle."""
    planned = {}  # layers -> (fits, per-device bytes)
    usable = [0.9 * 2**30]  # device memory less mem_margin; the first refusal says exactly

    def probe(layers):
        t = time.perf_counter()
        r = planner.plan(layers)
        if "fits" not in r:
            raise RuntimeError(f"planning {layers} layers: {r}")
        need = r["estimate"] if r["fits"] else r.get("need")
        if not r["fits"] and r.get("usable"):
            usable[0] = r["usable"]
        planned[layers] = (r["fits"], need)
        log(f"  {mode}: {layers} layers {'plan' if r['fits'] else 'do not plan'}"
            + (f" ({need / 2**20:.0f} MiB per device)" if need else "")
            + f" ({time.perf_counter() - t:.0f} s)")

    def guess(lo, hi):
        known = sorted((l, b) for l, (_, b) in planned.items() if b)
        below = [p for p in known if p[1] <= usable[0]][-1:]
        above = [p for p in known if p[1] > usable[0]][:1]
        pts = below + above
        if len(pts) == 2 and pts[1][1] != pts[0][1]:
            (l0, b0), (l1, b1) = pts
            g = l0 + (usable[0] - b0) * (l1 - l0) / (b1 - b0)
        elif pts:
            g = pts[0][0] * usable[0] / pts[0][1]
        else:
            g = (lo + hi) / 2
        g = min(hi - 1, max(lo + 1, int(g)))
        return g if g not in planned else (lo + hi) // 2

    lo, hi, layers = 0, args.max_layers + 1, start
    while hi - lo > 1:
        probe(layers)
        if planned[layers][0]:
            lo = max(lo, layers)
        else:
            hi = min(hi, layers)
        layers = guess(lo, hi)
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


def row(mode, r, why, seconds):
    """One Markdown table row."""
    if r is None:
        return f"| {mode} | - | - | skipped: {why or 'nothing trained'} | | | | | |"
    reps = r["replicas"]
    shape = (f"{r['stages']} x {reps[0]}" if len(set(reps)) == 1
             else f"{r['stages']} x ({','.join(map(str, reps))})")
    recompute = sum(r["recompute"])
    plan = (f"{shape} x {r['micro_batches']}"
            + (f", {recompute} stage(s) recompute" if recompute else ""))
    mib = 1 << 20
    return (f"| {mode} | {r['layers']} | {r['params'] / 1e6:.1f} M | {plan} | "
            f"{r['estimate'] / mib:.0f} MiB | {r['peak'] / mib:.0f} MiB | "
            f"{r['estimate'] / r['peak']:.2f} | "
            f"{r['losses'][0]:.3f}, {r['losses'][1]:.3f} | {seconds:.0f} s |")


def rss_gib(pid):
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    return kib / 2**20


def start_daemon(args, tmp, log_path, log):
    """A ranncd on cpu:4 x 1 GiB with the run's profile cache; returns it and the clients'
    environment."""
    address = f"127.0.0.1:{_free_loopback_port()}"
    daemon = subprocess.Popen(
        [args.ranncd, "--listen", address, "--devices", "cpu:4", "--device-memory", "1GiB",
         "--profile-cache", os.path.join(tmp, "profiles.tsv")],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while "listening" not in open(log_path).read():
        if daemon.poll() is not None or time.time() > deadline:
            daemon.kill()
            raise RuntimeError("ranncd did not start:\n" + open(log_path).read())
        time.sleep(0.1)
    links = [l for l in open(log_path).read().splitlines() if "links:" in l]
    log(f"ranncd --devices cpu:4 --device-memory 1GiB; {links[0].split('] ')[-1]}")
    # Each mode exactly as asked: without auto_memory a plain job that does not fit would be
    # offloaded by the daemon instead of failing.
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python_client"),
               RANNC_DAEMON=address, RANNC_AUTO_MEMORY="false")
    return daemon, env


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranncd", default=os.path.join(ROOT, "bazel-bin", "daemon", "ranncd"))
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--start", type=int, default=64, help="first layer count of the first mode "
                    "(each later mode starts from the answer before it)")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: "
                    + ", ".join(MODES))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per client run")
    ap.add_argument("--daemon-logs", help="keep each mode's ranncd log (ranncd-MODE.log) in this "
                    "directory (default: a temporary one)")
    args = ap.parse_args()
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    title = (f"ByteGPT d_model {args.dim} ({args.heads} heads), seq {args.seq}, batch "
             f"{args.batch}, AdamW; ranncd --devices cpu:4 --device-memory 1GiB")
    header = ("| mode | layers | parameters | plan | estimate / device | peak / device | "
              "estimate / peak | losses | search |\n|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.daemon_logs or tmp
        os.makedirs(logs, exist_ok=True)
        rows = []
        previous = None
        for mode in args.modes.split(","):
            mode_start = time.perf_counter()
            # A daemon per mode: what one mode's jobs leave in the daemon's heap (glibc keeps
            # freed memory) does not count against the next; the profile cache is shared.
            daemon, env = start_daemon(args, tmp, os.path.join(logs, f"ranncd-{mode}.log"), log)
            try:
                planner = Planner(args, env, mode)
                if "ready" not in planner.first:
                    why = planner.first.get("unsupported", planner.first.get("error"))
                    planner.close()
                    log(f"{mode}: skipped: {why}")
                    rows.append((mode, None, why, 0))
                    continue
                try:
                    best = search(args, env, planner, mode, previous or args.start, log)
                    why = None
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    planner.close()
                    best, why = None, f"failed: {e}"
                rows.append((mode, best, why, time.perf_counter() - mode_start))
                log(f"{mode}: {json.dumps(best)}; ranncd RSS {rss_gib(daemon.pid):.1f} GiB")
                log(row(*rows[-1]))
                if best:
                    previous = best["layers"]
            finally:
                daemon.terminate()
                daemon.wait(timeout=60)

    print(f"{title}; total {time.perf_counter() - t0:.0f} s")
    print()
    print(header)
    for r in rows:
        print(row(*r))


if __name__ == "__main__":
    main()
