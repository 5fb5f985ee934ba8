"""Issue 7's GPT trained through pyrannc against a ranncd that owns the devices: JSON lines.

    RANNC_DAEMON_BIN=build/gpu/daemon/ranncd PYTHONPATH=python_client \
        python3 benchmarks/gpt_rannc.py [--model A|B|tiny] [--out FILE]

    # the CPU check of the harness, against Bazel's daemon on two CPU devices:
    RANNC_DAEMON_BIN=bazel-bin/daemon/ranncd /usr/bin/python3 benchmarks/gpt_rannc.py \
        --device cpu --model tiny

pyrannc starts the daemon itself (RANNC_DEVICES: `cuda`, every GPU, with --device cuda; `cpu:2`
with --device cpu, unless RANNC_DEVICES is set; the binary from RANNC_DAEMON_BIN; its output to
RANNC_DAEMON_LOG if set; RANNC_DAEMON_ARGS adds flags, e.g. `--profile-cache FILE`). With
RANNC_DAEMON=host:port it uses a running daemon instead.

The training loop is an ordinary one over pyrannc.RaNNCModule(model, optimizer,
enable_apex_amp=True): the daemon's mixed precision in bf16 (the config key amp_dtype, whose
default is bf16; RANNC_AMP_DTYPE overrides it) with fp32 master weights, under autocast or
(--amp-level O2) with the whole forward in bf16, AdamW (lr 1e-4, betas
0.9/0.95, weight decay 0.1) as gpt_peers.py uses, the workload's global batch (16 sequences)
from one client, the same seeded model (initialized on --device as gpt_peers.py does, then moved
to the host, where pyrannc traces it), so the same losses as the peers. The daemon
plans the model itself (stages x replicas x micro-batches); RANNC_PARTITION_NUM and friends
force a shape.

Run 1 (JSON line with "system": "rannc"): 3 warm-up + 10 timed steps. A step is forward,
loss.backward(), optimizer.step(), zero_grad() and then the flush of what pyrannc defers to the
next forward (backward, step, zero_grad travel with it otherwise), so each timed step holds one
whole training step; the daemon runs a job's requests in order, so any device work a flush
leaves running is waited for by the next step's forward, and the median stays a step period.
Besides gpt_peers.py's fields: planning_s and profiling_s (the deployment's planning_seconds
and profiling_seconds: the daemon's planning at the first forward, profiling included), the plan
(stages, replicas per stage, micro-batches, schedule, recomputation, the planner's step-time and
memory estimates), peak memory per device (ListJobs' peak_device_bytes: the daemon's measured
high-water mark during a step, what a device held when the step began included), the
last step's busy time in the daemon by kind of call (busy_by_call_s), host memory
(host_peak_rss_gib, this client's peak; daemon_peak_rss_gib, the embedded daemon's VmHWM; the
host's pressure over the timed steps, as gpt_peers.py records it: host_min_available_gib,
host_major_faults, host_pages_swapped), and
time_to_first_step_s: from RaNNCModule(...) to the end of the first step, i.e. tracing the model
on the host, sending it, planning, placing it on the devices, and one step. The daemon is
started (or reached) before that clock starts: daemon_start_s is apart.

Run 2 (JSON line with "system": "rannc (saved deployment)"): the plan of run 1 is saved
(save_deployment, to --deployment), the first job is deleted, and a new RaNNCModule with
load_deployment= trains --second-steps steps (default 1) from the same host model: its
time_to_first_step_s is the cost of a start that skips planning. --second-steps 0 skips it.
With --offload, run 2 makes pyrannc keep its copy of the model (keep_local_model), which it
frees otherwise: run 2 needs it, at 4 bytes a parameter of host memory more.

Run 3 (with --job-bench; JSON line "rannc (in-process)"): what the client/daemon split costs.
A third RaNNCModule from the saved deployment saves its job (RANNC_SAVE_JOB: the JobSpec, the
TorchScript, the model's tensors and one training batch) and is deleted; then benchmarks/job_bench
trains that job, with run 2's plan, inside one process: the daemon's own Job code, no client, no
gRPC. Its step_s_median is over --warmup + --steps steps as run 1's, each forward (the loss
copied to the host), backward, optimizer step and zero_grad; split_cost is run 1's median over
it, less 1 (the target: at most 3%). With --profile DIR, job_bench then profiles 3 more steps
(its --profile: the GPU's kernels, through LibTorch's Kineto) into DIR/<system>.trace.json, and
the line gets "kernels" (benchmarks/kernel_profile.py's summary: GPU busy and idle time a step,
kernel time by category).

The host must hold the traced model: pyrannc traces the model on the host (with autograd) on
--trace-batch samples of the first batch (RANNC_TRACE_BATCH; default 1, the plan is still for
the whole batch; 0 traces the whole batch), serializes it, and the daemon loads it and keeps
host masters. The script estimates that (20 bytes a parameter plus the trace's activations)
and prints {"skipped": why} when MemAvailable is smaller (--force tries anyway).
"""

import argparse
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python_client"))

import torch  # noqa: E402

import gpt_model as gm  # noqa: E402

GIB = 1 << 30
# Run 1's gm.HostLowWater until its first timed step, then the least free memory it saw (GiB).
SETUP_LOW = {"sampler": None, "gib": None}
PROFILE_STEPS = 3  # steps of run 3 profiled with --profile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gm.add_workload_args(p)  # --model, --layers, --seq, --batch
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="the daemon's devices: RANNC_DEVICES defaults to cuda, or cpu:2")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--second-steps", type=int, default=1,
                   help="steps of the run from the saved deployment (0: no second run)")
    p.add_argument("--deployment", help="where to save run 1's deployment (default: a "
                   "temporary file)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--zero", action="store_true", help="enable_zero=True")
    p.add_argument("--amp-level", default="O1", choices=("O1", "O2"),
                   help="the config key amp_level (RANNC_AMP_LEVEL): O1 autocast, O2 the whole "
                   "forward in bf16 (as FSDP2's bf16 parameters); O2 names the systems "
                   "\"rannc O2\" and \"rannc O2 (saved deployment)\"")
    p.add_argument("--trace-batch", type=int, default=1,
                   help="samples of the first batch the model is traced on (RANNC_TRACE_BATCH; "
                        "0: the whole batch)")
    p.add_argument("--force", action="store_true", help="run even if the host-memory estimate "
                   "says the trace will not fit")
    p.add_argument("--pid-file", help="write the embedded daemon's pid here once it runs")
    p.add_argument("--attention", default="sdpa", choices=gm.ATTENTIONS,
                   help="sdpa: F.scaled_dot_product_attention (the issue's); math: written out")
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument("--job-bench", metavar="BIN",
                   help="after run 2, run 3: the same job (run 2's plan) trained in one process "
                   "by BIN (benchmarks/job_bench, built beside ranncd)")
    p.add_argument("--profile", metavar="DIR", help="with --job-bench: profile 3 more steps of "
                   "run 3 into DIR (module doc)")
    p.add_argument("--job-dir", help="where run 3 saves the job for --job-bench (default: a "
                   "folder under /dev/shm, removed afterwards)")
    p.add_argument("--offload", action="store_true",
                   help="offload_params=True: parameters, gradients and optimizer state in "
                   "host memory between steps (workload D)")
    return p.parse_args(argv)


def host_bytes_needed(cfg, trace_batch: int, offload: bool, low_precision: bool = False) -> int:
    """A rough upper estimate of the host memory a run needs. Without offload: the client's fp32
    model, the serialized trace (two copies while pyrannc sends it), the daemon's loaded module
    and host masters (20 bytes a parameter together), plus the trace's forward on the traced
    samples on the host (it keeps nothing for a backward: about one layer's ~16 d_model-wide
    fp32 tensors a token at a time, and three copies of the logits). With offload the larger of
    the trace (the client's model and that forward) and 17 bytes a parameter: while the job is
    created, the client's model, its copy in shared memory, the daemon's copy of that and its
    page-locked masters; then the daemon's masters, gradients and AdamW moments (pyrannc frees
    its own copy, keep_local_model), 16 bytes a parameter, and what else the daemon holds (113
    GiB for 7.12B parameters measured, docs/benchmarks.md); with `low_precision` (the job key
    offload_low_precision) the masters' bf16 copies for upload, 2 bytes a parameter more."""
    samples = trace_batch if 0 < trace_batch < cfg.batch else cfg.batch
    tokens = samples * cfg.seq
    activations = tokens * cfg.d_model * 4 * 16 + tokens * cfg.vocab * 4 * 3
    n = gm.param_count(cfg)
    if offload:
        return max(4 * n + activations, (19 if low_precision else 17) * n)
    return 20 * n + activations


def job_summary(rmod):
    from pyrannc import _daemon
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    jobs = _daemon.connection().call("ListJobs", pb.Empty()).jobs
    return next(j for j in jobs if j.job_id == rmod._job.id)


def delete_job(rmod):
    """Deletes the job without pulling its state to the host first (as _drop_job would: GiBs
    for A), so the second run starts on empty devices."""
    from pyrannc import _daemon
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    _daemon.connection().call("DeleteJob", pb.JobRef(job_id=rmod._job.id))
    rmod._job = None


def plan_of(deployment):
    from pyrannc.proto.rannc.v1 import deployment_pb2
    if deployment is None:
        return None
    return {
        "stages": len(deployment.stages),
        "replicas": [len(s.devices) for s in deployment.stages],
        "devices": [list(s.devices) for s in deployment.stages],
        "micro_batches": deployment.micro_batches,
        "schedule": deployment_pb2.PipelineSchedule.Name(deployment.schedule)
        .replace("SCHEDULE_", ""),
        "recompute": [bool(s.recompute) for s in deployment.stages],
        "estimated_step_ms": deployment.estimated_step_ms,
        "estimated_memory_gib": [s.memory_bytes / GIB for s in deployment.stages],
        # offload: the host's optimizer step the first forward does not hide, per stage
        "estimated_host_step_ms": [s.host_step_ms for s in deployment.stages],
        # offload: the parameters each stage keeps on the device (offload_keep_on_device)
        "kept_on_device_gib": [s.kept_on_device_bytes / GIB for s in deployment.stages],
        "device_type": deployment.device_type,
        "device_memory_gib": deployment.device_memory_bytes / GIB,
        "loaded": deployment.loaded,
    }


def daemon_peak_rss_gib():
    """The embedded daemon's peak resident memory so far (VmHWM), in GiB; None when pyrannc
    reached a daemon it did not start, or /proc does not say."""
    from pyrannc import _daemon
    conn = _daemon.current_connection()
    if conn is None or conn.embedded is None:
        return None
    try:
        with open(f"/proc/{conn.embedded.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / (1 << 20)  # kB
    except OSError:
        pass
    return None


def write_pid(path):
    from pyrannc import _daemon
    conn = _daemon.current_connection()
    if path and conn is not None and conn.embedded is not None:
        with open(path, "w", encoding="ascii") as f:
            f.write(f"{conn.embedded.proc.pid}\n")


def stop_setup_low():
    """Stops run 1's set-up sampler (once) and prints the least free host memory it saw."""
    sampler, SETUP_LOW["sampler"] = SETUP_LOW["sampler"], None
    if sampler is not None:
        SETUP_LOW["gib"] = sampler.stop()
        if SETUP_LOW["gib"] is not None:
            print(f"gpt_rannc: host memory available at least {SETUP_LOW['gib']:.1f} GiB until "
                  "the first timed step", file=sys.stderr, flush=True)
    return SETUP_LOW["gib"]


def train(rmod, opt, cfg, gen, steps, started, pressure=None, warmup=0, at_warmup=None):
    """`steps` training steps; returns each step's seconds, losses and the end of the first step
    measured from `started`. `pressure` (gm.HostPressure) starts after `warmup` steps and is
    sampled after each later one; `at_warmup` is called there."""
    flush = getattr(rmod, "_flush", None)  # pyrannc's deferred backward/step/zero_grad
    times, losses, first = [], [], None
    for i in range(steps):
        if pressure is not None and i == warmup:
            pressure.start()
        if at_warmup is not None and i == warmup:
            at_warmup()
        x, y = gm.batch(cfg, cfg.batch, gen)
        t0 = time.perf_counter()
        loss = rmod(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if flush is not None:
            flush()
        t1 = time.perf_counter()
        if first is None:
            first = t1 - started
        times.append(t1 - t0)
        losses.append(float(loss))
        if pressure is not None and i >= warmup:
            pressure.sample()
    return times, losses, first


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                             weight_decay=0.1)


def system_name(args, suffix=""):
    return ("rannc" if args.amp_level == "O1" else f"rannc {args.amp_level}") + suffix


def base_record(system, args, cfg):
    return {"system": system, "workload": cfg.name, "device": args.device,
            "amp_level": args.amp_level}


def run(args, cfg, phase):
    """Runs 1 and 2; phase[0] names the system a failure belongs to."""
    import pyrannc

    SETUP_LOW["sampler"] = gm.HostLowWater()  # the least free host memory until timed steps
    build_start = time.perf_counter()
    # Initialized on args.device, as gpt_peers.py does (the CPU and CUDA generators draw different
    # numbers from one seed), then moved to the host, where pyrannc traces it: the same weights,
    # so the same losses as the peers'. The GPU is empty again before the daemon starts.
    model = gm.build(cfg, args.device, attention=args.attention)
    if args.device != "cpu":
        model = model.cpu()
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - build_start
    gen = torch.Generator().manual_seed(gm.SEED + 1)

    # Start (or reach) the daemon before the clock: time to first step is the job's, in both
    # runs, not the daemon's start (which measures its links).
    daemon_start = time.perf_counter()
    from pyrannc import _daemon
    _daemon.connection()
    daemon_start_s = time.perf_counter() - daemon_start
    write_pid(args.pid_file)

    opt = make_optimizer(model, args)
    started = time.perf_counter()
    rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True, enable_zero=args.zero,
                               offload_params=args.offload)
    pressure = gm.HostPressure()
    times, losses, first = train(rmod, opt, cfg, gen, args.warmup + args.steps, started,
                                 pressure, args.warmup, stop_setup_low)
    deployment = rmod.deployment
    summary = job_summary(rmod)
    devices = list(summary.devices)
    gpus = len(devices)
    step_s = times[args.warmup:]
    median = statistics.median(step_s)
    record = base_record(system_name(args), args, cfg)
    record.update({
        "gpus": gpus,
        "daemon_devices": devices,
        "torch": torch.__version__,
        "params": gm.param_count(cfg),
        "flops_per_token": gm.flops_per_token(cfg),
        "global_batch": cfg.batch,
        "seq": cfg.seq,
        "tokens_per_step": cfg.tokens_per_step,
        "enable_zero": args.zero,
        "offload": args.offload,
        "attention": gm.effective_attention(args.attention),
        "warmup": args.warmup,
        "steps": args.steps,
        "step_s_median": median,
        "step_s": step_s,
        **gm.throughput(cfg, median, gpus),
        "peak_mem_gib": [b / GIB for b in summary.peak_device_bytes],
        "peak_mem_gib_max": max(summary.peak_device_bytes) / GIB
        if summary.peak_device_bytes else None,
        # The last step's time in the daemon by kind of call (ListJobs; the forward holds the
        # backward the engine fuses into it, the step is the optimizer's).
        "busy_s": summary.busy_seconds,
        "busy_by_call_s": {"forward": summary.forward_busy_seconds,
                           "backward": summary.backward_busy_seconds,
                           "step": summary.step_busy_seconds,
                           "other": summary.other_busy_seconds},
        "planning_s": deployment.planning_seconds if deployment is not None else None,
        "profiling_s": deployment.profiling_seconds if deployment is not None else None,
        "plan": plan_of(deployment),
        "plan_summary": rmod.plan_summary,
        "time_to_first_step_s": first,
        "model_build_s": build_s,
        "daemon_start_s": daemon_start_s,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
        "daemon_peak_rss_gib": daemon_peak_rss_gib(),
        **pressure.record(),
        "host_min_available_setup_gib": SETUP_LOW["gib"],
        "loss_first": losses[0],
        "loss_last": losses[-1],
    })
    gm.emit(record, args.out)

    if args.second_steps <= 0:
        return
    phase[0] = system_name(args, " (saved deployment)")
    path = args.deployment or os.path.join(tempfile.mkdtemp(prefix="gpt_rannc."),
                                           f"gpt_{cfg.name}.deployment")
    rmod.save_deployment(path)
    delete_job(rmod)
    del rmod, opt
    # From the host model as built: run 1's training stayed in the daemon and went with its job.
    opt = make_optimizer(model, args)
    started = time.perf_counter()
    rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True, enable_zero=args.zero,
                               offload_params=args.offload, load_deployment=path)
    times, losses, first = train(rmod, opt, cfg, gen, args.second_steps, started)
    deployment = rmod.deployment
    summary = job_summary(rmod)
    record = base_record(system_name(args, " (saved deployment)"), args, cfg)
    record.update({
        "gpus": len(summary.devices),
        "deployment_file": path,
        "time_to_first_step_s": first,
        "step_s": times,
        # A loaded deployment carries the planning time of the run that made it; none was spent.
        "planning_s": 0.0 if deployment is not None and deployment.loaded else
        (deployment.planning_seconds if deployment is not None else None),
        "plan": plan_of(deployment),
        "peak_mem_gib": [b / GIB for b in summary.peak_device_bytes],
        "loss_first": losses[0],
        "loss_last": losses[-1],
    })
    gm.emit(record, args.out)
    if args.job_bench:
        delete_job(rmod)
        del rmod, opt
        phase[0] = system_name(args, " (in-process)")
        in_process(args, cfg, model, path, gen, client_median=median, gpus=gpus)


def in_process(args, cfg, model, deployment_path, gen, client_median, gpus):
    """Run 3 (module doc): the job saved by pyrannc, then trained by benchmarks/job_bench."""
    import json
    import shutil
    import subprocess

    import pyrannc
    job_dir = args.job_dir or tempfile.mkdtemp(prefix="rannc-job-", dir="/dev/shm")
    os.environ["RANNC_SAVE_JOB"] = job_dir
    try:
        opt = make_optimizer(model, args)
        rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True, enable_zero=args.zero,
                                   load_deployment=deployment_path)
        x, y = gm.batch(cfg, cfg.batch, gen)
        rmod(x, y)  # creates the job and saves it, and this training batch
        delete_job(rmod)
        del rmod, opt
    finally:
        del os.environ["RANNC_SAVE_JOB"]
    # job_bench needs the devices: an embedded daemon's process keeps what its jobs had in
    # LibTorch's CUDA cache, so it is stopped here (a daemon reached by RANNC_DAEMON is not).
    from pyrannc import _daemon
    conn = _daemon.current_connection()
    if conn is not None and conn.embedded is not None:
        _daemon.shutdown()
    try:
        cmd = [args.job_bench, job_dir, "--devices", os.environ["RANNC_DEVICES"],
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            trace = os.path.join(args.profile, system_name(args, " (in-process)")
                                 .replace(" ", "_").replace("(", "").replace(")", "")
                                 + ".trace.json")
            cmd += ["--profile", trace, "--profile-steps", str(PROFILE_STEPS)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, check=False, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit status {done.returncode}")
        bench = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        if not args.job_dir:
            shutil.rmtree(job_dir, ignore_errors=True)
    median = bench["step_s_median"]
    record = base_record(system_name(args, " (in-process)"), args, cfg)
    record.update({
        "gpus": gpus,
        "daemon_devices": bench["devices"],
        "step_s_median": median,
        "step_s": bench["step_s"],
        **gm.throughput(cfg, median, gpus),
        "job_create_s": bench["create_s"],
        "plan_summary": bench["plan_summary"],
        "client_step_s_median": client_median,
        "split_cost": client_median / median - 1,
        "loss_first": bench["loss_first"],
        "loss_last": bench["loss_last"],
    })
    if "profile" in bench:
        import kernel_profile
        record["profile"] = bench["profile"]
        if args.device == "cuda":
            record["kernels"] = kernel_profile.summarize(bench["profile"], PROFILE_STEPS)
    gm.emit(record, args.out)


def main(argv=None):
    args = parse_args(argv)
    cfg = gm.workload_of(args)
    # pyrannc's phases (trace, serialize, tensors to shared memory, CreateJob) on stderr: where
    # the time to first step goes.
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pyrannc").setLevel(logging.DEBUG)
    os.environ.setdefault("RANNC_DEVICES", "cuda" if args.device == "cuda" else "cpu:2")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the daemon inherits it
    os.environ["RANNC_AMP_LEVEL"] = args.amp_level
    if args.trace_batch > 0:
        os.environ.setdefault("RANNC_TRACE_BATCH", str(args.trace_batch))
    if args.offload and args.second_steps > 0:
        # Run 2 starts from the host model as built, which offload frees once run 1's job has it.
        os.environ.setdefault("RANNC_KEEP_LOCAL_MODEL", "1")
    from pyrannc import _config
    low = _config.job_config().get("offload_low_precision", "").lower() in _config._TRUE
    need = host_bytes_needed(cfg, args.trace_batch, args.offload, low)
    have = gm.mem_available() or 0
    if need > have and not args.force:
        gm.emit({**base_record(system_name(args), args, cfg), "skipped":
              f"pyrannc traces the model on the host: about "
              f"{need / GIB:.0f} GiB of host memory needed, {have / GIB:.0f} GiB available "
              "(--force tries anyway)"}, args.out)
        return 0
    phase = [system_name(args)]
    try:
        run(args, cfg, phase)
        return 0
    except Exception as e:  # noqa: BLE001 - reported as the run's result
        traceback.print_exc()
        gm.emit({**base_record(phase[0], args, cfg), "error": f"{type(e).__name__}: {e}"[:800],
                 "host_min_available_setup_gib": stop_setup_low()}, args.out)
        return 1


if __name__ == "__main__":
    sys.exit(main())
