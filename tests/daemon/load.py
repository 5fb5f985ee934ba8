"""A bounded load test of one ranncd on loopback (issue 25; docs/hardening.md, "Load").

CLIENTS clients, spread over worker processes, each loop until the deadline: create a small job
(a traced MLP with SGD), train it STEPS steps (Forward, Backward, Step), delete it. Creation may
be refused with RESOURCE_EXHAUSTED while the daemon is full (the expected back-pressure: the
client waits and tries again); any other error is a failure. Meanwhile the daemon's RSS, open
file descriptors and threads are sampled every second.

After WARMUP seconds the adversaries start (unless --no-adversaries) and run to the end:
- slow-loris connections: sockets that send the HTTP/2 preface a byte every 2 seconds, and open
  again when the daemon closes them;
- stalled readers: clients that start streaming a 16 MiB job's state_dict, read one chunk and
  then stop reading, holding the stream open.
The clients' step latencies before and after they start are reported apart.

    /usr/bin/python3 tests/daemon/load.py --clients 64 --seconds 600 --json out.json

prints a summary: jobs, steps, p50/p99 step latency per phase, the errors by code, and the
least-squares slopes of RSS (MiB a minute), fds and threads (a minute) per phase, warm-up
excluded. The daemon must stop cleanly (SIGTERM, exit 0) at the end. load_test.py runs a short
version in CI with bounds on these figures.
"""

import argparse
import io
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "python_client", "tests"))

import grpc  # noqa: E402
import torch  # noqa: E402

from pyrannc import _codec  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2 as pb  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc  # noqa: E402
from conftest import built_binary  # noqa: E402
from process_stats import footprint, slope  # noqa: E402

C = grpc.StatusCode
BATCH, WIDTH = 8, 32
HYPER = pb.HyperParams(lr=0.01)


class _Mlp(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


def _traced(width: int, depth: int):
    torch.manual_seed(0)
    model = _Mlp(width, depth)
    x = torch.randn(BATCH, width)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(model, (x,)), buf)
    return buf.getvalue(), [name for name, _ in model.named_parameters()], x


def _create(stub, model_bytes, params, x, timeout):
    spec = pb.JobSpec(name="load-test", mode=pb.Mode(training=True),
                      example_inputs=[_codec.encode(x)], input_names=["x"],
                      model_bytes=len(model_bytes), options=pb.JobOptions(gather_inputs=True),
                      optimizer=pb.OptimizerSpec(type=pb.SGD, groups=[pb.ParamGroup(
                          params=params, hyper=HYPER)]))

    def requests():
        yield pb.CreateJobRequest(spec=spec)
        for off in range(0, len(model_bytes), 1 << 20):
            yield pb.CreateJobRequest(model_chunk=model_bytes[off:off + (1 << 20)])

    return stub.CreateJob(requests(), timeout=timeout).job_id


# ---------------------------------------------------------------------------------------------
# Clients (in worker processes).

def _train(stub, job_id, inputs, grad, timeout):
    stub.Forward(pb.ForwardRequest(job_id=job_id, inputs=inputs, requires_grad=True),
                 timeout=timeout)
    stub.Backward(pb.BackwardRequest(job_id=job_id, grads=[pb.OutputGrad(
        output_index=0, grad=grad)]), timeout=timeout)
    stub.Step(pb.StepRequest(job_id=job_id, groups=[HYPER]), timeout=timeout)


def _warm_up(address, timeout):
    """One job created, trained two steps and deleted."""
    channel = grpc.insecure_channel(address)
    stub = rpc.TrainingServiceStub(channel)
    model_bytes, params, x = _traced(WIDTH, 2)
    job_id = _create(stub, model_bytes, params, x, timeout)
    for _ in range(2):
        _train(stub, job_id, [_codec.encode(x)], _codec.encode(torch.ones(())), timeout)
    stub.DeleteJob(pb.JobRef(job_id=job_id), timeout=timeout)
    channel.close()

def _client(address, model, deadline, steps, timeout, out, lock):
    model_bytes, params, x = model
    stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
    grad = _codec.encode(torch.ones(()))
    inputs = [_codec.encode(x)]
    mine = {"steps": [], "creates": [], "jobs": 0, "refused": 0, "errors": []}
    rng = random.Random(os.getpid() * 1000 + threading.get_ident() % 1000)
    while time.time() < deadline:
        job_id = None
        try:
            t0 = time.time()
            try:
                job_id = _create(stub, model_bytes, params, x, timeout)
            except grpc.RpcError as err:
                if err.code() == C.RESOURCE_EXHAUSTED:  # back-pressure: wait and try again
                    mine["refused"] += 1
                    time.sleep(rng.uniform(0.1, 0.5))
                    continue
                raise
            mine["creates"].append((t0, time.time() - t0))
            for _ in range(steps):
                if time.time() >= deadline:
                    break
                t0 = time.time()
                _train(stub, job_id, inputs, grad, timeout)
                mine["steps"].append((t0, time.time() - t0))
            stub.DeleteJob(pb.JobRef(job_id=job_id), timeout=timeout)
            job_id = None
            mine["jobs"] += 1
        except grpc.RpcError as err:
            mine["errors"].append((time.time(), err.code().name, (err.details() or "")[:300]))
            time.sleep(0.5)
        finally:
            if job_id is not None:
                try:
                    stub.DeleteJob(pb.JobRef(job_id=job_id), timeout=timeout)
                except grpc.RpcError:
                    pass
    with lock:
        out.append(mine)


def _worker(address, clients, deadline, steps, timeout, queue):
    torch.set_num_threads(1)
    model = _traced(WIDTH, 2)
    results, lock = [], threading.Lock()
    threads = [threading.Thread(target=_client,
                                args=(address, model, deadline, steps, timeout, results, lock))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(results)


# ---------------------------------------------------------------------------------------------
# Adversaries (in the main process).

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _slow_loris(port, stop, stats):
    """One connection that trickles the HTTP/2 preface, a byte every 2 s, forever."""
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                stats["connections"] += 1
                for i in range(10 ** 9):
                    if stop.wait(2.0):
                        return
                    s.sendall(_PREFACE[i % len(_PREFACE):i % len(_PREFACE) + 1])
        except OSError:
            stats["closed_by_daemon"] += 1
            stop.wait(1.0)


def _stalled_reader(address, model, stop, stats, timeout):
    """Creates a job of `model` (16 MiB), starts streaming its state_dict, reads one chunk, then
    stops reading until the end; deletes the job afterwards."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    stub = rpc.TrainingServiceStub(channel)
    model_bytes, params, x = model
    job_id = _create(stub, model_bytes, params, x, timeout)
    stream = stub.StateDict(pb.StateDictRequest(job_id=job_id))
    next(stream)
    stats["stalled_streams"] += 1
    stop.wait()
    stream.cancel()
    stub.DeleteJob(pb.JobRef(job_id=job_id), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# The daemon and its footprint.

def _per_minute(points):
    """The least-squares slope of (seconds, value) points, per minute; None with fewer than 3."""
    per_second = slope(points)
    return None if per_second is None else 60 * per_second


def _percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def start_daemon(devices, extra):
    log = tempfile.NamedTemporaryFile(prefix="ranncd-load-", suffix=".log", delete=False)
    proc = subprocess.Popen([built_binary("ranncd", "RANNC_DAEMON_BIN"), "--listen", "127.0.0.1:0", "--devices", devices,
                             "--state-dir", "none", *extra], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        with open(log.name, errors="replace") as f:
            m = re.search(r"ranncd listening on (\S+)", f.read())
        if m:
            return proc, m.group(1), log.name
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    with open(log.name, errors="replace") as f:
        raise SystemExit("load.py: ranncd did not start:\n" + f.read()[-3000:])


def run(clients=64, seconds=600, warmup=60, steps=10, workers=4, devices="cpu:2",
        adversaries=True, loris=32, stalled=2, timeout=120.0, daemon_args=()):
    proc, address, log = start_daemon(devices, list(daemon_args))
    port = int(address.rsplit(":", 1)[1])
    # The idle footprint, after one job has warmed LibTorch and the thread pools up; compared
    # with the same once every client and adversary is gone.
    _warm_up(address, timeout)
    time.sleep(2.0)
    idle_before = footprint(proc.pid)
    start = time.time()
    deadline = start + seconds
    adversaries_at = start + warmup + (seconds - warmup) / 2 if adversaries else None
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = max(1, min(workers, clients))
    procs = [ctx.Process(target=_worker, args=(address, clients // workers +
                                               (1 if i < clients % workers else 0),
                                               deadline, steps, timeout, queue))
             for i in range(workers)]
    for p in procs:
        p.start()

    samples, stop = [], threading.Event()
    adv_stats = {"connections": 0, "closed_by_daemon": 0, "stalled_streams": 0}
    adv_threads, adv_errors = [], []

    def start_adversaries():
        big = _traced(1024, 4)  # once: torch.jit.trace is not safe from several threads at once
        for _ in range(loris):
            adv_threads.append(threading.Thread(target=_slow_loris, args=(port, stop, adv_stats),
                                                daemon=True))
        for _ in range(stalled):
            def stalled_one():
                try:
                    _stalled_reader(address, big, stop, adv_stats, timeout)
                except Exception as err:  # noqa: BLE001 - reported, not fatal here
                    adv_errors.append(repr(err)[:300])
            adv_threads.append(threading.Thread(target=stalled_one, daemon=True))
        for t in adv_threads:
            t.start()

    results, reported, daemon_died = [], 0, None
    while time.time() < deadline + timeout and reported < workers:
        if adversaries_at is not None and not adv_threads and time.time() >= adversaries_at:
            start_adversaries()
        if proc.poll() is not None:
            daemon_died = proc.returncode
            break
        samples.append((time.time() - start, *footprint(proc.pid)))
        try:
            results.extend(queue.get(timeout=1.0))
            reported += 1
        except Exception:  # noqa: BLE001 - queue.Empty: no worker done yet
            pass
    stop.set()
    for t in adv_threads:
        t.join(timeout=30)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    idle_after = None
    if daemon_died is None and proc.poll() is None:
        time.sleep(2.0)
        idle_after = footprint(proc.pid)
    exit_code = daemon_died
    if exit_code is None:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "did not stop within 60 s of SIGTERM"
    with open(log, errors="replace") as f:
        log_tail = f.read()[-4000:]
    os.unlink(log)
    return summarize(results, samples, start, warmup, adversaries_at, adv_stats, adv_errors,
                     exit_code, log_tail, idle_before, idle_after, clients=clients,
                     seconds=seconds, devices=devices,
                     steps=steps, loris=loris if adversaries else 0,
                     stalled=stalled if adversaries else 0)


def summarize(results, samples, start, warmup, adversaries_at, adv_stats, adv_errors, exit_code,
              log_tail, idle_before, idle_after, **setup):
    split = (adversaries_at - start) if adversaries_at else None
    end = setup["seconds"]  # then the clients finish their last calls and stop
    phases = {"clients only": (warmup, split if split is not None else end)}
    if split is not None:
        # The slow-loris sockets and stalled streams are opened over the first seconds.
        phases["with adversaries"] = (split + 10, end)
    steps = [(t - start, d) for r in results for t, d in r["steps"]]
    creates = [d for r in results for _, d in r["creates"]]
    errors = [e for r in results for e in r["errors"]]
    by_code = {}
    for _, code, _ in errors:
        by_code[code] = by_code.get(code, 0) + 1
    out = {"setup": setup, "clients_reported": len(results),
           "jobs": sum(r["jobs"] for r in results), "steps": len(steps),
           "refused_resource_exhausted": sum(r["refused"] for r in results),
           "clients_without_a_job": sum(1 for r in results if r["jobs"] == 0),
           "errors_by_code": by_code, "first_errors": errors[:10],
           "create_latency_s": {"p50": _percentile(creates, 50), "p99": _percentile(creates, 99)},
           "adversaries": dict(adv_stats, errors=adv_errors),
           "daemon_exit": exit_code, "phases": {},
           "idle": {"before": dict(zip(("rss_mib", "fds", "threads"), idle_before)),
                    "after": dict(zip(("rss_mib", "fds", "threads"), idle_after))
                    if idle_after else None}}
    for name, (lo, hi) in phases.items():
        lat = [d for t, d in steps if lo <= t < hi]
        pts = [s for s in samples if lo <= s[0] < hi]
        out["phases"][name] = {
            "window_s": [round(lo, 1), round(hi, 1)],
            "steps": len(lat),
            "step_latency_s": {"p50": _percentile(lat, 50), "p99": _percentile(lat, 99),
                               "max": max(lat) if lat else None},
            "rss_mib": [round(min(p[1] for p in pts), 1), round(max(p[1] for p in pts), 1)]
            if pts else None,
            "rss_mib_per_min": _per_minute([(p[0], p[1]) for p in pts]),
            "fds": [min(p[2] for p in pts), max(p[2] for p in pts)] if pts else None,
            "fds_per_min": _per_minute([(p[0], p[2]) for p in pts]),
            "threads": [min(p[3] for p in pts), max(p[3] for p in pts)] if pts else None,
            "threads_per_min": _per_minute([(p[0], p[3]) for p in pts]),
        }
    out["daemon_log_tail"] = log_tail if exit_code != 0 or errors else ""
    return out


def render(s) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    su = s["setup"]
    lines = [f"load: {su['clients']} clients for {su['seconds']} s on {su['devices']}, "
             f"{su['steps']} steps a job; {su['loris']} slow-loris sockets and "
             f"{su['stalled']} stalled state_dict readers in the second half",
             f"  jobs {s['jobs']}, steps {s['steps']}, creations refused (RESOURCE_EXHAUSTED) "
             f"{s['refused_resource_exhausted']}, clients without a finished job "
             f"{s['clients_without_a_job']}",
             f"  create latency p50 {f(s['create_latency_s']['p50'], '.3f')} s, p99 "
             f"{f(s['create_latency_s']['p99'], '.3f')} s",
             f"  errors: {s['errors_by_code'] or 'none'}; daemon exit: {s['daemon_exit']}",
             f"  adversaries: {s['adversaries']}"]
    idle = s["idle"]
    lines.append(f"  idle daemon before / after the load: RSS {idle['before']['rss_mib']:.0f} / "
                 + (f"{idle['after']['rss_mib']:.0f} MiB, fds {idle['before']['fds']} / "
                    f"{idle['after']['fds']}, threads {idle['before']['threads']} / "
                    f"{idle['after']['threads']}" if idle["after"] else "- (daemon gone)"))
    for name, p in s["phases"].items():
        lat = p["step_latency_s"]
        lines.append(
            f"  [{name}, t={p['window_s'][0]}..{p['window_s'][1]} s] steps {p['steps']}, step "
            f"p50 {f(lat['p50'], '.3f')} s p99 {f(lat['p99'], '.3f')} s max "
            f"{f(lat['max'], '.3f')} s; RSS {p['rss_mib']} MiB, slope "
            f"{f(p['rss_mib_per_min'], '+.2f')} MiB/min; fds {p['fds']}, slope "
            f"{f(p['fds_per_min'], '+.2f')}/min; threads {p['threads']}, slope "
            f"{f(p['threads_per_min'], '+.2f')}/min")
    for e in s["first_errors"]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=60)
    ap.add_argument("--steps", type=int, default=10, help="training steps per job")
    ap.add_argument("--workers", type=int, default=4, help="client processes")
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--loris", type=int, default=32, help="slow-loris sockets")
    ap.add_argument("--stalled", type=int, default=2, help="stalled state_dict readers")
    ap.add_argument("--no-adversaries", action="store_true")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    s = run(clients=args.clients, seconds=args.seconds, warmup=args.warmup, steps=args.steps,
            workers=args.workers, devices=args.devices, adversaries=not args.no_adversaries,
            loris=args.loris, stalled=args.stalled)
    print(render(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if not s["errors_by_code"] and s["daemon_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
