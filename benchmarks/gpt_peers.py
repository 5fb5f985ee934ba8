"""Issue 7's GPT trained by plain PyTorch systems, the peers ranncd is compared with: one JSON line.

    python3 -m torch.distributed.run --standalone --nproc_per_node NGPUS \
        benchmarks/gpt_peers.py --system ddp|fsdp2|gpipe|1f1b|ddp+compile|fsdp2+compile|\
        fsdp2+offload [--model A|B|C|tiny] [--ac off|on|auto|every:K|selective] [--out FILE] \
        [--profile DIR]

    # the CPU check of the harness (gloo, bf16 CPU autocast, the tiny model):
    /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/gpt_peers.py --system ddp --device cpu --model tiny

One process per GPU (torchrun). Every system trains the workload's global batch (16 sequences,
C's 20) with AdamW (fused on CUDA; lr 1e-4, betas 0.9/0.95, weight decay 0.1) from the seeded init
of gpt_model.py, with bf16 compute and fp32 master weights:
  ddp     DistributedDataParallel over every GPU, forward under torch.autocast(bf16); each rank
          trains 16/NGPUS sequences.
  fsdp2   torch.distributed.fsdp.fully_shard per block and on the root, MixedPrecisionPolicy(
          param_dtype=bf16, reduce_dtype=fp32); 16/NGPUS sequences per rank. On workloads B and
          C each block's activations are recomputed in backward (--ac auto), or they do not fit.
  gpipe   torch.distributed.pipelining, 2 stages (the first half of the blocks with the
  1f1b    embeddings, the second half with the head; PipelineStage built by hand) under
          ScheduleGPipe / Schedule1F1B with 8 micro-batches of 2 sequences; each stage runs under
          torch.autocast(bf16). Exactly 2 GPUs: on 1 GPU the line says "skipped": "needs 2 GPUs".
  ddp+compile, fsdp2+compile
          ddp or fsdp2 with the model compiled by torch.compile (Inductor: the elementwise work
          around the matrix products fused into Triton kernels): DDP's whole model, FSDP2's each
          block before it is sharded. Not a peer the issue names: a measure of what fusing the
          elementwise work is worth on this model.
  fsdp2+offload
          fsdp2 with offload_policy=CPUOffloadPolicy(): the sharded fp32 parameters, their
          gradients and AdamW's state live in pinned host memory, the optimizer steps on the
          CPU (fused AdamW where this PyTorch has it for the CPU, else foreach), and the GPU
          holds only the bf16 copies of the blocks being run and the activations. Issue 27's
          "plain training with CPU offload of optimizer state". Skipped where FSDP2 has no
          CPUOffloadPolicy.

--ac sets activation checkpointing (gpt_model.py's module docstring has the settings and what
each keeps): off; on (every block, torch.utils.checkpoint non-reentrant); every:K (every K-th
block); selective (op-level, torchtitan's: matrix products' and SDPA's outputs kept, the rest
recomputed; skipped before PyTorch 2.4); auto (the default: on for fsdp2 on the workloads that
need it, B and C, else off). They combine with every system (with +compile, each block is
compiled with its checkpoint inside).

Timing: 3 warm-up steps, then 10 timed steps (--warmup, --steps); each step (forward, backward,
optimizer step, zero_grad) between torch.cuda.synchronize() calls after a barrier, so every rank
starts it together; a step's time is the slowest rank's. Rank 0 prints one JSON line (and
appends it to --out): system, workload, gpus, step times, their median, tokens/s at the median,
model TFLOP/s per GPU and MFU (gpt_model.flops_per_token: 6N + 12*L*d*T; 989 TFLOP/s peak),
peak memory per GPU (torch.cuda.max_memory_allocated since the model was set up, so optimizer
state and the steps count but not the one-off init), time to the first step's end from the start
of setup, first and last loss; "ac" (the setting that ran), "ac_blocks" (how many blocks
recompute) and, for FSDP2, "peak_estimate_gib" (gpt_model.memory_estimate's arithmetic, to
compare with the measured peak). A system that cannot run prints {"skipped": why} instead; one
that fails prints {"error": why} (from whichever rank failed) and exits 1. Running out of device
memory is such a failure, marked: {"error": "out of memory: ...", "oom": true,
"peak_mem_gib_max": what was allocated at most before it}, so that a sweep goes on.

--profile DIR: after the timed steps every rank runs PROFILE_STEPS more, rank 0 under
torch.profiler (CUDA activity), which writes DIR/<system>.trace.json; the JSON line gets
"profile" (the path) and "kernels" (benchmarks/kernel_profile.py's summary of it).

Checked on this machine only with --device cpu (PyTorch 1.13, gloo): the ddp path, with --ac
off, on and every:K (selective is skipped there). The fsdp2, offload, selective and pipelining
paths use PyTorch 2.x APIs and run on the GPU machine (PyTorch 2.11).
"""

import argparse
import contextlib
import datetime
import inspect
import os
import resource
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model as gm  # noqa: E402

SYSTEMS = ("ddp", "fsdp2", "gpipe", "1f1b", "ddp+compile", "fsdp2+compile", "fsdp2+offload")
PROFILE_STEPS = 3
PIPELINE_STAGES = 2
MICRO_BATCHES = 8
GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    gm.add_workload_args(p)  # --model, --layers, --seq, --batch
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ac", default="auto", type=ac_setting, metavar="off|on|auto|every:K|selective",
                   help="activation checkpointing (auto: on for FSDP2 on workloads B and C)")
    p.add_argument("--attention", default="sdpa", choices=gm.ATTENTIONS,
                   help="sdpa: F.scaled_dot_product_attention (the issue's); math: written out")
    p.add_argument("--out", help="also append the JSON line to this file")
    p.add_argument("--profile", metavar="DIR",
                   help=f"profile {PROFILE_STEPS} more steps; the trace goes to DIR")
    args = p.parse_args(argv)
    args.base, *mods = args.system.split("+")
    args.compile = "compile" in mods
    args.offload = "offload" in mods
    return args


def ac_setting(spec):
    """--ac's argument: "auto" or a gpt_model.parse_ac setting."""
    if spec == "auto":
        return spec
    try:
        return gm.parse_ac(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_ac(args, cfg):
    """The activation-checkpointing setting that runs: --ac, with auto turned into on (FSDP2 on
    a workload that needs it, GPTConfig.recompute) or off."""
    if args.ac == "auto":
        return "on" if args.base == "fsdp2" and cfg.recompute else "off"
    return args.ac


def base_record(args, cfg, world):
    return {"system": args.system, "workload": cfg.name, "gpus": world, "device": args.device,
            "ac": resolve_ac(args, cfg)}


def make_adamw(params, args, device):
    """AdamW, fused on CUDA and, for fsdp2+offload's host parameters, on the CPU where this
    PyTorch has that kernel (2.4+; else foreach)."""
    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if device.type == "cuda":
        kwargs["fused"] = True
    elif args.offload:
        params = list(params)
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError):
            kwargs["foreach"] = True
    return torch.optim.AdamW(params, **kwargs)


def optimizer_name(opt):
    how = "fused" if opt.defaults.get("fused") else \
        "foreach" if opt.defaults.get("foreach") else "default"
    where = {p.device.type for g in opt.param_groups for p in g["params"]}
    return f"AdamW ({how}, {'/'.join(sorted(where))})"


def has_cpu_offload():
    try:
        import torch.distributed.fsdp as fsdp
    except Exception:  # noqa: BLE001 - 1.13's FSDP does not even import under Python 3.11
        return False
    return hasattr(fsdp, "CPUOffloadPolicy")


def is_oom(e):
    """Whether `e` is the device running out of memory (the caching allocator's error, or one
    of a library that could not allocate: cuBLAS, cuDNN, a compiler's kernel benchmarking)."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    text = str(e)
    return "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text


def state_bytes_per_gpu(cfg, system, world, offload=False):
    """fp32 parameters + gradients + AdamW's two moments (16 bytes a parameter) per GPU: what
    must fit before any activation does (none of it with fsdp2+offload)."""
    if offload:
        return 0
    if system == "ddp":
        n = gm.param_count(cfg)
    elif system == "fsdp2":
        n = gm.param_count(cfg) / world
    else:
        n = max(sum(p.numel() for p in gm.GPT(cfg, "meta", layers=gm.stage_layers(cfg, s, 2),
                                                embed=s == 0, head=s == 1).parameters())
                for s in range(PIPELINE_STAGES))
    return 16 * n


class Autocast(nn.Module):
    """Runs `inner` under bf16 autocast and hands fp32 on, so the tensors a pipeline stage sends
    (and the last stage's logits) have one dtype however the stage's metadata was inferred."""

    def __init__(self, inner, device_type):
        super().__init__()
        self.inner = inner
        self.device_type = device_type

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            y = self.inner(x)
        return y.float()


def setup_ddp(args, cfg, device, ac):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = gm.build(cfg, device, activation_checkpoint=ac, attention=args.attention)
    if args.compile:
        model.compile()
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    opt = make_adamw(model.parameters(), args, device)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


def setup_fsdp2(args, cfg, device, ac):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    if args.offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        shard["offload_policy"] = CPUOffloadPolicy()
    model = gm.build(cfg, device, activation_checkpoint=ac, attention=args.attention)
    for block in model.blocks:
        if args.compile:
            block.compile()
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    opt = make_adamw(model.parameters(), args,
                     torch.device("cpu") if args.offload else device)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


def setup_pipeline(args, cfg, device, ac):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank = dist.get_rank()
    part = gm.build(cfg, device, layers=gm.stage_layers(cfg, rank, PIPELINE_STAGES),
                    embed=rank == 0, head=rank == PIPELINE_STAGES - 1,
                    activation_checkpoint=ac, attention=args.attention)
    stage = PipelineStage(Autocast(part, device.type), stage_index=rank,
                          num_stages=PIPELINE_STAGES, device=device)
    schedule_cls = ScheduleGPipe if args.base == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=MICRO_BATCHES, loss_fn=gm.lm_loss)
    step_kwargs = {}
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        step_kwargs["return_outputs"] = False  # the logits are not needed once the loss is made
    opt = make_adamw(part.parameters(), args, device)
    last = rank == PIPELINE_STAGES - 1

    def step(x, y):
        loss = None
        if rank == 0:
            schedule.step(x, **step_kwargs)
        elif last:
            losses = []
            schedule.step(target=y, losses=losses, **step_kwargs)
            loss = torch.stack([l.detach().float() for l in losses]).mean()
        else:
            schedule.step(**step_kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


SETUP = {"ddp": setup_ddp, "fsdp2": setup_fsdp2, "gpipe": setup_pipeline, "1f1b": setup_pipeline}


def init_process_group(args):
    # Plain `python3 gpt_peers.py` runs as a world of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    timeout = datetime.timedelta(minutes=5)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(args, cfg, device, step, local_batch, gen):
    """PROFILE_STEPS more steps on every rank, rank 0's under torch.profiler; its trace's path."""
    from torch.profiler import ProfilerActivity, profile
    rank = dist.get_rank()
    activities = [ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]
    path = os.path.join(args.profile, f"{args.system}.trace.json")
    with profile(activities=activities) if rank == 0 else contextlib.nullcontext() as prof:
        for _ in range(PROFILE_STEPS):
            x, y = gm.batch(cfg, local_batch, gen, device)
            dist.barrier()
            step(x, y)
            sync(device)
    if rank != 0:
        return None
    os.makedirs(args.profile, exist_ok=True)
    prof.export_chrome_trace(path)
    return path


def run(args, cfg, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    ac = resolve_ac(args, cfg)
    data_parallel = args.base in ("ddp", "fsdp2")
    if data_parallel and cfg.batch % world:
        raise ValueError(f"the global batch {cfg.batch} does not split over {world} ranks")
    local_batch = cfg.batch // world if data_parallel else cfg.batch

    setup_start = time.perf_counter()
    low = gm.HostLowWater()  # the host's least free memory until the timed steps
    setup_low = None
    step, opt = SETUP[args.base](args, cfg, device, ac)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    # Data-parallel ranks draw different sequences; both pipeline stages need the same batch.
    gen = torch.Generator().manual_seed(gm.SEED + 1 + (rank if data_parallel else 0))
    times, losses, first_step_end = [], [], None
    pressure = gm.HostPressure()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            pressure.start()
            setup_low = low.stop()
        x, y = gm.batch(cfg, local_batch, gen, device)
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        loss = step(x, y)
        sync(device)
        t1 = time.perf_counter()
        if first_step_end is None:
            first_step_end = t1
        times.append(t1 - t0)
        losses.append(None if loss is None else float(loss))
        if i >= args.warmup:
            pressure.sample()

    trace = profile_steps(args, cfg, device, step, local_batch, gen) if args.profile else None
    mine = {"times": times[args.warmup:], "losses": losses,
            "time_to_first_step_s": first_step_end - setup_start}
    if device.type == "cuda":
        mine["peak"] = torch.cuda.max_memory_allocated(device)
        mine["reserved"] = torch.cuda.max_memory_reserved(device)
    # the process's peak resident set (KiB on Linux): host memory, which offload fills
    mine["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None

    step_s = [max(r["times"][i] for r in everyone) for i in range(args.steps)]
    median = statistics.median(step_s)
    loss_rank = next((r for r in everyone if any(l is not None for l in r["losses"])), None)
    known = [l for l in loss_rank["losses"] if l is not None] if loss_rank else []
    record = base_record(args, cfg, world)
    record.update({
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": gm.param_count(cfg),
        "flops_per_token": gm.flops_per_token(cfg),
        "global_batch": cfg.batch,
        "seq": cfg.seq,
        "tokens_per_step": cfg.tokens_per_step,
        "micro_batches": None if data_parallel else MICRO_BATCHES,
        "activation_checkpoint": ac != "off",
        "ac_blocks": gm.recomputed_blocks(cfg, ac),
        "offload": args.offload,
        "optimizer": optimizer_name(opt),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "attention": gm.effective_attention(args.attention),
        "warmup": args.warmup,
        "steps": args.steps,
        "step_s_median": median,
        "step_s": step_s,
        **gm.throughput(cfg, median, world),
        "time_to_first_step_s": max(r["time_to_first_step_s"] for r in everyone),
        "planning_s": None,
        "loss_first": known[0] if known else None,
        "loss_last": known[-1] if known else None,
    })
    if trace:
        import kernel_profile
        record["profile"] = trace
        if device.type == "cuda":
            record["kernels"] = kernel_profile.summarize(trace, PROFILE_STEPS)
    if device.type == "cuda":
        record["peak_mem_gib"] = [r["peak"] / GIB for r in everyone]
        record["peak_mem_gib_max"] = max(record["peak_mem_gib"])
        record["peak_reserved_gib"] = [r["reserved"] / GIB for r in everyone]
    else:
        record["peak_mem_gib"] = None
    record["peak_rss_gib"] = [r["peak_rss"] / GIB for r in everyone]
    record.update(pressure.record())  # the host's, seen from rank 0
    record["host_min_available_setup_gib"] = setup_low
    if args.base == "fsdp2":
        record["peak_estimate_gib"] = peak_estimate_gib(args, cfg, world)
    return record


def peak_estimate_gib(args, cfg, world):
    return gm.memory_estimate(cfg, resolve_ac(args, cfg), world, args.offload)["peak"] / GIB


def failure_record(args, cfg, world, rank, e):
    """The JSON line of a run that raised `e`: {"error": ...}, and for an out-of-memory
    {"error": "out of memory: ...", "oom": true} with the most this rank had allocated."""
    record = {**base_record(args, cfg, world), "rank": rank,
              "error": f"{type(e).__name__}: {e}"[:600]}
    if not is_oom(e):
        return record
    record["error"] = f"out of memory: {type(e).__name__}: {e}"[:600]
    record["oom"] = True
    if args.device == "cuda" and torch.cuda.is_available():
        try:
            record["peak_mem_gib_max"] = torch.cuda.max_memory_allocated() / GIB
            record["peak_reserved_gib_max"] = torch.cuda.max_memory_reserved() / GIB
        except RuntimeError:  # the device may be past answering
            pass
    if args.base == "fsdp2":
        record["peak_estimate_gib"] = peak_estimate_gib(args, cfg, world)
    return record


def main(argv=None):
    args = parse_args(argv)
    cfg = gm.workload_of(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    skip = None
    ac = resolve_ac(args, cfg)
    if args.compile and not hasattr(nn.Module, "compile"):
        skip = f"torch.compile of a module needs PyTorch 2.2 or later, not {torch.__version__}"
    elif ac == "selective" and not gm.HAS_SELECTIVE_CHECKPOINT:
        skip = ("selective activation checkpointing needs torch.utils.checkpoint's "
                "create_selective_checkpoint_contexts (PyTorch 2.4 or later), not "
                f"{torch.__version__}")
    elif args.offload and not has_cpu_offload():
        skip = ("fsdp2+offload needs FSDP2's CPUOffloadPolicy (torch.distributed.fsdp, "
                f"PyTorch 2.6 or later), not {torch.__version__}")
    elif args.base in ("gpipe", "1f1b") and world != PIPELINE_STAGES:
        skip = "needs 2 GPUs" if world < PIPELINE_STAGES else \
            f"runs on exactly {PIPELINE_STAGES} GPUs (2 stages, no data parallelism)"
    elif args.device == "cuda" and torch.cuda.is_available():
        need = state_bytes_per_gpu(cfg, args.base, world, args.offload)
        have = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))) \
            .total_memory
        if need > 0.95 * have:
            skip = (f"parameters, gradients and AdamW state alone need {need / GIB:.0f} GiB per "
                    f"GPU on {world} GPU(s); a GPU has {have / GIB:.0f} GiB")
    elif args.device == "cuda":
        skip = "no CUDA device"
    if skip:
        if rank == 0:
            gm.emit({**base_record(args, cfg, world), "skipped": skip}, args.out)
        return 0

    try:
        device = init_process_group(args)
        record = run(args, cfg, device)
        if record is not None:
            gm.emit(record, args.out)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as e:  # noqa: BLE001 - reported as the run's result, then re-raised as rc 1
        traceback.print_exc()
        gm.emit(failure_record(args, cfg, world, rank, e), args.out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a peer may be stuck in a collective; do not wait for it


if __name__ == "__main__":
    sys.exit(main())
