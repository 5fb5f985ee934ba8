#!/usr/bin/python3
"""What the daemon's checkpoints cost: bytes, the time training is held, write throughput against
the disk's own, and the time from a daemon restart to the first resumed step.

    bazel build //daemon:ranncd && /usr/bin/python3 benchmarks/checkpoint_bench.py \
        [--size small|large|gpu-1b|workload-a] [--checkpoints 5] [--every 4] [--dir DIR]

    # workload A on one H200 (the daemon from tools/gpu_cmake_build.sh; ~16.1 GB a checkpoint):
    SYS=/tmp/sys tools/gpu_cmake_build.sh build/gpu && RANNC_DAEMON_BIN=build/gpu/daemon/ranncd \
        python3 benchmarks/checkpoint_bench.py --size workload-a --checkpoints 2 --every 2 \
        --warmup 2 --disk-reps 1

pyrannc starts an embedded ranncd (RANNC_DEVICES, default cpu:2, cuda:0 for workload-a; the
binary from RANNC_DAEMON_BIN, else bazel-bin/daemon/ranncd; its output to DIR/ranncd-N.log) and
trains a model of --size on random tokens:
- small, large, gpu-1b: examples/train_gpt.py's ByteGPT (fp32) with AdamW (lr 3e-3, betas
  0.9/0.95, weight decay 0.01) on random bytes. small is train_gpt.py's default model (2 layers,
  d_model 96, seq 64, batch 16: ~3 MB a checkpoint); large is 4 layers, d_model 512, seq 32,
  batch 4 (12.8 M parameters, ~150 MB a checkpoint); gpu-1b is 24 layers, d_model 2048, seq 512,
  batch 8 (1.21B parameters, ~14.5 GB a checkpoint).
- workload-a: workload A of docs/benchmarks.md, benchmarks/gpt_model.py's GPT as
  gpt_rannc.py trains it on one H200: 24 layers, d_model 2048, 16 heads, MLP 4x, seq 1024,
  vocab 32000, untied head (1,341,771,776 parameters), batch 16 sequences of random token ids
  in [0, 32000) (gpt_model.batch's draw), the loss gpt_model.lm_loss (cross-entropy in fp32)
  computed by the model; built on the meta device, materialized on the host and initialized
  from gpt_model.SEED (gpt_model.build, as gpt_rannc.py does: ~10 s); AdamW (lr 1e-4, betas
  0.9/0.95, weight decay 0.1: gpt_rannc.py's and gpt_peers.py's); RaNNCModule(...,
  enable_apex_amp=True) with RANNC_AMP_LEVEL=O2 unless set (the whole forward in bf16, fp32
  master parameters: what the H200 runs of gpt_rannc.py used, and what FSDP2's bf16 parameters
  run), RANNC_TRACE_BATCH=1 (pyrannc traces one sample, as gpt_rannc.py) and
  RANNC_CHECKPOINT_KEEP=1 (the H200 host's disk is 64 GiB) unless set.
A checkpoint holds the fp32 parameters and AdamW's exp_avg and exp_avg_sq: 12 bytes a parameter
(gradients are not in it); the script prints that expectation beside the measured bytes.
--dry-run builds the model, its optimizer and one batch, prints their sizes and stops (no
daemon). A training step is forward, loss.backward(), optimizer.step(), zero_grad() and the
flush of what pyrannc defers to the next forward, so each timed step holds one whole step.
Checkpoints go to DIR/ckpt (checkpoint_dir; job name RANNC_JOB=ckpt_bench; checkpoint_keep
RANNC_CHECKPOINT_KEEP, default 3), DIR a new directory under /tmp unless --dir names one
(removed at the end unless --dir or --keep).

1. Warm-up: --warmup steps (the first creates the job: trace, plan, placement).
2. Asynchronous: --checkpoints times, --every - 1 plain steps and then a step followed by
   checkpoint(wait=False). Reported: the step alone (median of the plain steps that overlap no
   write), the checkpointing step (step + checkpoint(wait=False) call; "extra" is its median
   less the plain step's), blocked_s (the daemon's copy to host memory, from CheckpointInfo),
   and the plain steps that ran while a write was in flight (the writer thread shares the cores
   with the devices), and the step right after each checkpoint: from CUDA devices the copies to
   host memory run during it and its optimizer step waits for them, so the training held per
   checkpoint is the call plus that step's extra. A write's span is taken from
   checkpoint(wait=False)'s return to that plus its write_s, which the daemon logs
   ("checkpoint of ... committed: N bytes in T s").
3. Synchronous: --checkpoints times, a plain step and then checkpoint(wait=True): bytes
   (CheckpointInfo.bytes), write_s (the wait for the copies from the devices, serialization,
   CRC, write, fsync, the manifest and the rename that commits; not the pruning of older
   checkpoints after it, which the daemon logs apart, as the disk's test below leaves out its
   file's removal) and bytes / write_s.
4. The disk: --disk-reps times, a file of the checkpoint's size written into DIR/ckpt with
   os.write in 8 MiB blocks, fsync'ed and closed (timed from open to close), then removed.
   Ratio = checkpoint throughput (3) / disk MB/s.
5. Restart (with --restart-deployment from the first job's saved deployment, as a training
   script that keeps its deployment file restarts: no trace, no planning): pyrannc.clear()
   and pyrannc._daemon.shutdown() stop the job and the daemon; then,
   with RANNC_RESUME=latest, the clock runs from a new RaNNCModule(...) through resumed_step (as
   a resuming training loop reads it, which starts the daemon) and the first forward, backward,
   step and flush. Its parts: the daemon's start (until pyrannc's "started ranncd" log record,
   i.e. until the daemon answers; the daemon's own "listening" line is printed beside it), the
   time until CreateJob is sent (resumed_step's ListCheckpoints, tracing the model on the
   host), CreateJob as the client saw it (pyrannc's debug record), and the rest of the first
   step. Within CreateJob the daemon logs its phases ("created job ... seconds: receive,
   tensors apart, import, IR, plan, place"); the resume (reading the files, checking sizes and
   CRC-32, unpickling, loading parameters and optimizer state) is not among them: it is taken as
   CreateJob less those phases, printed beside the same remainder for the first, fresh job.
   Both daemons share one profile cache (DIR/profiles.tsv, through RANNC_DAEMON_ARGS'
   --profile-cache), so the restart plans from cached profiles, as a daemon restarted on the
   same machine does by default. The resumed job's first loss is compared with the pre-restart
   model's (the state pyrannc.clear() copied back, the last checkpoint's) on the same batch in
   plain PyTorch, and printed beside the loss of the restart's fresh initial values (what a
   resume that loaded nothing would give). ByteGPT: fp32 on the host, as the daemon runs it,
   within 1e-4 relative. workload-a: in the daemon's precision, not a looser tolerance alone:
   at O2 a bf16 copy of the parameters and the whole forward in bf16 (the loss in fp32 from the
   bf16 logits, as lm_loss computes it), at O1 the fp32 model under bf16 autocast; on cuda:0
   when there is one (the daemon is stopped by then), else on the host; within 1e-3 relative,
   for kernels that may differ from the daemon's (bf16's own step is 2^-8; averaged over 16,384
   tokens, differences in rounding stay far below 1e-3 of a loss of ~10.4).

Medians throughout; Markdown tables on stdout, progress on stderr.
"""

import argparse
import logging
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import importlib.util  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if importlib.util.find_spec("pyrannc") is None:  # else PYTHONPATH's pyrannc
    sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.append(os.path.join(ROOT, "examples"))
if HERE not in sys.path:
    sys.path.append(HERE)

import torch  # noqa: E402

import gpt_model as gm  # noqa: E402

SIZES = {  # ByteGPT's (layers, d_model, heads, seq, batch), or a gpt_model.GPTConfig
    "small": (2, 96, 4, 64, 16),  # examples/train_gpt.py's defaults
    "large": (4, 512, 8, 32, 4),
    "gpu-1b": (24, 2048, 16, 512, 8),  # 1.2B parameters, a ~14.5 GB checkpoint (GPU runs)
    "workload-a": gm.WORKLOADS["A"],  # 1.34B, seq 1024, batch 16: ~16.1 GB (one H200)
}
# AdamW's hyper-parameters: ByteGPT's (train_gpt.py's betas), and workload A's as gpt_rannc.py's
# make_optimizer and gpt_peers.py's make_adamw set them (lr: their --lr default).
BYTEGPT_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
GPT_ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
# A checkpoint's bytes a parameter: the fp32 parameter and AdamW's exp_avg and exp_avg_sq.
CHECKPOINT_BYTES_PER_PARAM = 12
JOB = "ckpt_bench"
BLOCK = 8 << 20
MB = 1e6


class Workload:
    """What --size trains: the model, its batches, its optimizer and the plain-PyTorch loss the
    restart is checked against (module doc). Shared with checkpoint_dcp.py."""

    def __init__(self, size):
        spec = SIZES[size]
        self.size = size
        self.gpt = isinstance(spec, gm.GPTConfig)  # gpt_model's GPT, trained in bf16
        if self.gpt:
            self.cfg = spec
            self.layers, self.dim, self.heads = spec.layers, spec.d_model, spec.heads
            self.seq, self.batch, self.vocab = spec.seq, spec.batch, spec.vocab
            self.params = gm.param_count(spec)
        else:
            self.cfg = None
            self.layers, self.dim, self.heads, self.seq, self.batch = spec
            self.vocab = 256
            self.params = None  # counted on the model (its head is tied to its embedding)
        self.adamw = GPT_ADAMW if self.gpt else BYTEGPT_ADAMW
        self.rel_tol = 1e-3 if self.gpt else 1e-4

    def model(self, seed, device="cpu"):
        """The model from `seed` (0 the benchmark's, 1 the restart's other initial values), fp32
        on `device`. workload-a: built on the meta device and initialized in place on `device`
        (gpt_model.build, from gpt_model.SEED + seed), never first in host memory elsewhere."""
        if self.gpt:
            return gm.build(self.cfg, device, seed=gm.SEED + seed)
        from train_gpt import ByteGPT
        torch.manual_seed(seed)
        return ByteGPT(self.layers, self.dim, self.heads, self.seq, 0.0).to(device)

    def optimizer(self, params, fused=False):
        """AdamW with the workload's hyper-parameters; fused=True as gpt_peers.py on CUDA."""
        return torch.optim.AdamW(params, **self.adamw, **({"fused": True} if fused else {}))

    def batch_of(self, gen):
        """(inputs, next-token targets): random token ids drawn from `gen` on the host (for
        workload-a the draw of gpt_model.batch)."""
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def expected_bytes(self, params):
        return CHECKPOINT_BYTES_PER_PARAM * params

    def describe(self, amp_level=None):
        if not self.gpt:
            return (f"{self.size}: ByteGPT {self.layers}x{self.dim}, seq {self.seq}, "
                    f"batch {self.batch}")
        amp = f", bf16 {amp_level}" if amp_level else ""
        return (f"{self.size}: GPT {self.cfg.name} {self.layers}x{self.dim}, {self.heads} heads, "
                f"vocab {self.vocab}, seq {self.seq}, batch {self.batch}{amp}")

    def reference_loss(self, model, inputs, amp_level="O1"):
        """`model`'s loss on `inputs` in plain PyTorch, without grad, in the daemon's precision
        (module doc, phase 5); `model` itself is left as it is."""
        with torch.no_grad():
            if not self.gpt:
                return float(model(*inputs))
            device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
            o2 = amp_level.upper() == "O2"
            ref = gm.GPT(self.cfg, device="meta")
            ref.to_empty(device=device)
            if o2:
                ref.to(torch.bfloat16)  # load_state_dict's copy_ then rounds each fp32 value
            ref.load_state_dict(model.state_dict())
            for m in ref.modules():  # the mask is no state_dict entry (PyTorch without SDPA)
                if isinstance(m, gm.CausalSelfAttention) and not m.sdpa:
                    m.mask.copy_(torch.ones_like(m.mask).tril())
            x = [t.to(device) for t in inputs]
            if o2:
                loss = float(ref(*x))
            else:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = float(ref(*x))
        del ref, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return loss


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--checkpoints", type=int, default=5, help="checkpoints per phase")
    p.add_argument("--every", type=int, default=4,
                   help="steps per asynchronous checkpoint (the last of them checkpoints)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--disk-reps", type=int, default=3)
    p.add_argument("--dir", help="where checkpoints, daemon logs and the profile cache go "
                   "(default: a new directory under /tmp, removed at the end)")
    p.add_argument("--restart-deployment", action="store_true",
                   help="the first job saves its deployment (RaNNCModule.save_deployment, with "
                   "the trace) and the restart loads it (load_deployment=), as a restarted "
                   "training script that keeps its deployment file does: no trace, no planning")
    p.add_argument("--keep", action="store_true", help="keep the default directory")
    p.add_argument("--verbose", action="store_true", help="pyrannc's log on stderr")
    p.add_argument("--dry-run", action="store_true", help="build the model, its optimizer and "
                   "one batch, print their sizes and the expected checkpoint bytes, and stop")
    return p.parse_args(argv)


def note(msg):
    print(msg, file=sys.stderr, flush=True)


class Records(logging.Handler):
    """pyrannc's log records (the embedded daemon's lines included), with their times."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.created, record.name, record.getMessage()))

    def since(self, t):
        return [r for r in self.records if r[0] >= t]


def first_match(records, pattern):
    for t, _, msg in records:
        m = re.search(pattern, msg)
        if m:
            return t, m
    return None, None


SPDLOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\]")


def log_lines(path):
    """(unix time or None, line) of a daemon log (spdlog's "[YYYY-mm-dd HH:MM:SS.mmm]" is local
    time)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = SPDLOG_TIME.match(line)
            t = None
            if m:
                stamp, frac = m.group(1).split(".")
                t = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + float("0." + frac)
            out.append((t, line.rstrip("\n")))
    return out


COPIED = re.compile(r"checkpoint of step (\d+) copied to host memory")
COMMITTED = re.compile(r"checkpoint of '[^']*' step (\d+) committed: (\d+) bytes in ([\d.]+) s")
CREATED = re.compile(r"created job (\S+) .*?seconds: receive ([\d.]+), tensors apart ([\d.]+) "
                     r"\((\d+) of them\), import ([\d.]+), IR ([\d.]+), plan ([\d.]+), "
                     r"place ([\d.]+)", re.S)


def committed_writes(path):
    """{step: (bytes, write_s)} from the daemon's log; write_s from the log's times of "copied to
    host memory" and "committed" (ms resolution; the line's own figure has 10 ms)."""
    copied, out = {}, {}
    for t, line in log_lines(path):
        m = COPIED.search(line)
        if m:
            copied[int(m.group(1))] = t
        m = COMMITTED.search(line)
        if m:
            s = int(m.group(1))
            w = t - copied[s] if s in copied and t is not None else float(m.group(3))
            out[s] = (int(m.group(2)), w)
    return out


def created_phases(path):
    """(log time, {phase: s}) of the daemon's first "created job" message (several lines: the
    plan summary's)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    m = CREATED.search(text)
    if not m:
        return None, None
    start = text.rfind("\n[", 0, m.start()) + 1
    t = SPDLOG_TIME.match(text[start:])
    stamp, frac = t.group(1).split(".")
    when = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + float("0." + frac)
    names = ("receive", "tensors", "import", "ir", "plan", "place")
    return when, dict(zip(names, (float(m.group(i)) for i in (2, 3, 5, 6, 7, 8))))


def line_time(path, pattern):
    for t, line in log_lines(path):
        if re.search(pattern, line):
            return t, line
    return None, None


def create_job_s(records):
    _, m = first_match(records, r"CreateJob \(.*\) took ([\d.]+) s")
    return float(m.group(1)) if m else None


def disk_write(path, size):
    """Seconds to write `size` bytes to a new file at `path` in 8 MiB os.write calls, fsync and
    close."""
    block = memoryview(bytearray(os.urandom(BLOCK)))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            n = os.write(fd, block[:min(left, BLOCK)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    t = time.perf_counter() - t0
    os.remove(path)
    return t


def dry_run(work):
    """--dry-run: the model, its optimizer and one batch, built and described; no daemon."""
    t = time.perf_counter()
    model = work.model(0)
    build_s = time.perf_counter() - t
    opt = work.optimizer(model.parameters())
    inputs, targets = work.batch_of(torch.Generator().manual_seed(1))
    params = sum(p.numel() for p in model.parameters())
    if work.params is not None and params != work.params:
        raise AssertionError(f"the model has {params} parameters, gpt_model says {work.params}")
    print(f"{work.describe()}: {params:,} parameters, built in {build_s:.1f} s "
          f"({sum(p.numel() * p.element_size() for p in model.parameters()) / MB:.0f} MB "
          f"{next(model.parameters()).dtype}); AdamW {opt.defaults['lr']}, betas "
          f"{opt.defaults['betas']}, weight decay {opt.defaults['weight_decay']}; batch "
          f"{tuple(inputs.shape)} {inputs.dtype} in [{int(inputs.min())}, {int(inputs.max())}], "
          f"targets {tuple(targets.shape)}; expected checkpoint "
          f"{work.expected_bytes(params) / MB:.1f} MB ({CHECKPOINT_BYTES_PER_PARAM} bytes a "
          "parameter)")
    return 0


def main(argv=None):
    args = parse_args(argv)
    work = Workload(args.size)
    if args.dry_run:
        return dry_run(work)
    own_dir = args.dir is None
    base = args.dir or tempfile.mkdtemp(prefix="rannc-ckpt-bench.", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    ckpt_dir = os.path.join(base, "ckpt")
    logs = [os.path.join(base, "ranncd-1.log"), os.path.join(base, "ranncd-2.log")]
    for p in logs:
        if os.path.exists(p):
            os.remove(p)

    os.environ.setdefault("RANNC_DEVICES", "cuda:0" if work.gpt else "cpu:2")
    if work.gpt:  # module doc: as gpt_rannc.py runs workload A
        os.environ.setdefault("RANNC_AMP_LEVEL", "O2")
        os.environ.setdefault("RANNC_TRACE_BATCH", "1")
        os.environ.setdefault("RANNC_CHECKPOINT_KEEP", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the daemon inherits it
    amp_level = os.environ.get("RANNC_AMP_LEVEL", "O1") if work.gpt else None
    rannc_kwargs = {"enable_apex_amp": True} if work.gpt else {}
    os.environ["RANNC_CHECKPOINT_DIR"] = ckpt_dir
    os.environ["RANNC_JOB"] = JOB
    os.environ.pop("RANNC_RESUME", None)
    os.environ.pop("RANNC_CHECKPOINT_EVERY", None)
    os.environ["RANNC_DAEMON_ARGS"] = (os.environ.get("RANNC_DAEMON_ARGS", "") +
                                       f" --profile-cache {base}/profiles.tsv").strip()
    os.environ["RANNC_DAEMON_LOG"] = logs[0]
    deployment = os.path.join(base, "deployment.pb")

    records = Records()
    plog = logging.getLogger("pyrannc")
    plog.setLevel(logging.DEBUG)
    plog.addHandler(records)
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s")

    import pyrannc
    from pyrannc import _daemon

    gen = torch.Generator().manual_seed(1)

    def batch_of():
        return work.batch_of(gen)

    def make(seed):
        model = work.model(seed)
        return model, work.optimizer(model.parameters())

    def step(rmod, opt, inputs):
        loss = rmod(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rmod._flush()  # pyrannc defers backward, step and zero_grad to the next forward
        return loss

    t = time.perf_counter()
    model, opt = make(0)
    build_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    expected = work.expected_bytes(params)
    free = shutil.disk_usage(base).free
    note(f"{work.describe(amp_level)}: {params:,} parameters (built in {build_s:.1f} s); expected "
         f"checkpoint {expected / MB:.1f} MB; directory {base} ({free / MB:,.0f} MB free)")

    w_first = time.time()
    t = time.perf_counter()
    _daemon.connection()
    daemon_start_first = time.perf_counter() - t
    rmod = pyrannc.RaNNCModule(model, opt, **rannc_kwargs)
    steps_done = 0
    warm = []
    for _ in range(args.warmup):
        x = batch_of()
        t0 = time.perf_counter()
        step(rmod, opt, x)
        warm.append(time.perf_counter() - t0)
        steps_done += 1
    first_create_s = create_job_s(records.records)
    if args.restart_deployment:
        rmod.save_deployment(deployment)  # with the trace, for the restart
    note(f"first step {warm[0]:.2f} s (job creation included); {rmod.plan_summary.strip()}")

    # 2. Asynchronous checkpoints.
    plain = []   # (step number after it, t_start, t_end) on the monotonic clock
    ckpt_steps = []  # (step, step_s, call_s, blocked_s, t_return)
    next_steps = []  # the step right after each checkpoint (whose optimizer step waits for the
                     # copies from a CUDA device, if they are still running)

    def plain_step():
        nonlocal steps_done
        x = batch_of()
        t0 = time.monotonic()
        step(rmod, opt, x)
        steps_done += 1
        plain.append((steps_done, t0, time.monotonic()))
        if ckpt_steps and steps_done == ckpt_steps[-1][0] + 1:
            next_steps.append(plain[-1][2] - t0)

    for i in range(args.checkpoints):
        for _ in range(args.every - 1):
            plain_step()
        x = batch_of()
        t0 = time.monotonic()
        step(rmod, opt, x)
        t1 = time.monotonic()
        info = rmod.checkpoint(wait=False)
        t2 = time.monotonic()
        steps_done += 1
        if info.step != steps_done:
            note(f"note: checkpoint step {info.step}, client counted {steps_done}")
        ckpt_steps.append((info.step, t1 - t0, t2 - t1, info.blocked_s, t2, t2 - t0))
        note(f"async checkpoint {i + 1}: step {info.step}, blocked_s {info.blocked_s:.3f}, "
             f"call {t2 - t1:.3f} s")
    for _ in range(args.every - 1):  # steps after the last one, as after the others
        plain_step()
    # Wait for the last write to commit.
    deadline = time.monotonic() + 600
    while True:
        listed = rmod.checkpoints()
        if listed and listed[-1].committed and listed[-1].step == ckpt_steps[-1][0]:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the last asynchronous checkpoint did not commit: {listed}")
        time.sleep(0.05)
    # The daemon logs a write once it is committed and pruned, a moment after the commit.
    while not all(c[0] in committed_writes(logs[0]) for c in ckpt_steps):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    writes = committed_writes(logs[0])
    spans = []
    async_bytes, async_write = [], []
    for s, _, _, _, t_ret, _ in ckpt_steps:
        if s not in writes:
            raise RuntimeError(f"no 'committed' line for step {s} in {logs[0]}")
        b, w = writes[s]
        async_bytes.append(b)
        async_write.append(w)
        spans.append((t_ret, t_ret + w))
    clean, during = [], []
    for _, a, b in plain:
        (during if any(a < e and b > s for s, e in spans) else clean).append(b - a)

    # 3. Synchronous checkpoints.
    sync = []  # (step_s, call_s, info)
    for i in range(args.checkpoints):
        x = batch_of()
        t0 = time.perf_counter()
        step(rmod, opt, x)
        t1 = time.perf_counter()
        info = rmod.checkpoint(wait=True)
        t2 = time.perf_counter()
        steps_done += 1
        if not info.committed:
            raise RuntimeError(f"checkpoint(wait=True) returned uncommitted: {info}")
        sync.append((t1 - t0, t2 - t1, info))
        clean.append(t1 - t0)  # no write in flight during these steps
        note(f"sync checkpoint {i + 1}: step {info.step}, {info.bytes / MB:.1f} MB, write_s "
             f"{info.write_s:.3f}, blocked_s {info.blocked_s:.3f}, call {t2 - t1:.3f} s")
    last_step = sync[-1][2].step
    ckpt_bytes = int(statistics.median(i.bytes for _, _, i in sync))

    # 4. The disk's own sequential write speed, same directory, same size.
    disk = [disk_write(os.path.join(ckpt_dir, f".disk-test-{r}"), ckpt_bytes)
            for r in range(args.disk_reps)]
    note("disk: " + ", ".join(f"{ckpt_bytes / t / MB:.0f} MB/s" for t in disk))

    # 5. Restart and resume.
    t = time.perf_counter()
    pyrannc.clear()  # the job's state into `model`: the last checkpoint's
    t_clear = time.perf_counter() - t
    proc = _daemon.current_connection().embedded.proc
    t = time.perf_counter()
    _daemon.shutdown()
    t_shutdown = time.perf_counter() - t
    exit_status = proc.returncode  # -9: it outlived pyrannc's stop timeout after SIGTERM
    os.environ["RANNC_RESUME"] = "latest"
    os.environ["RANNC_DAEMON_LOG"] = logs[1]
    del rmod
    model2, opt2 = make(1)  # other initial values: the checkpoint's replace them
    x = batch_of()
    expect = work.reference_loss(model, x, amp_level or "O1")
    fresh = work.reference_loss(model2, x, amp_level or "O1")
    mark = len(records.records)
    w0 = time.time()
    kwargs2 = dict(rannc_kwargs, load_deployment=deployment if args.restart_deployment else None)
    rmod2 = pyrannc.RaNNCModule(model2, opt2, **kwargs2)
    start = rmod2.resumed_step
    loss = step(rmod2, opt2, x)
    restart_s = time.time() - w0
    got = float(loss)
    after = records.records[mark:]
    t_started, _ = first_match(after, r"pyrannc started ranncd")
    resume_create_s = create_job_s(after)
    create_end, _ = first_match(after, r"CreateJob \(.*\) took")
    created_t, phases2 = created_phases(logs[1])
    _, phases1 = created_phases(logs[0])
    resumed_t, resumed_line = line_time(logs[1], r"resumed from")
    listening_t, _ = line_time(logs[1], r"ranncd listening on")
    more = []
    for _ in range(2):
        xx = batch_of()
        t1 = time.perf_counter()
        step(rmod2, opt2, xx)
        more.append(time.perf_counter() - t1)

    # Tables.
    med = statistics.median
    step_clean = med(clean)
    ck_total = med(c[5] for c in ckpt_steps)
    ck_step = med(c[1] for c in ckpt_steps)
    ck_call = med(c[2] for c in ckpt_steps)
    blocked = med(c[3] for c in ckpt_steps)
    sync_write = med(i.write_s for _, _, i in sync)
    sync_call = med(c for _, c, _ in sync)
    sync_blocked = med(i.blocked_s for _, _, i in sync)
    tput = med(i.bytes / i.write_s for _, _, i in sync if i.write_s > 0) / MB
    async_tput = med(b / w for b, w in zip(async_bytes, async_write) if w > 0) / MB
    disk_mbs = med(ckpt_bytes / t for t in disk) / MB
    name = work.describe(amp_level)

    print(f"host: {os.cpu_count()} cores, torch {torch.__version__}, RANNC_DEVICES="
          f"{os.environ['RANNC_DEVICES']}; {rmod2.plan_summary.strip().splitlines()[0]}")
    print(f"checkpoint dir: {ckpt_dir}; {args.checkpoints} checkpoints per phase, medians\n")
    print("| model | parameters | checkpoint | step | step + checkpoint(wait=False) | extra "
          "| blocked_s | step during a write | write_s (wait=True) | write MB/s | disk MB/s "
          "| ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    during_txt = (f"{med(during) * 1e3:.0f} ms (n={len(during)})" if during else "none")
    print(f"| {name} | {params:,} | {ckpt_bytes / MB:.1f} MB | {step_clean * 1e3:.0f} ms "
          f"| {ck_total * 1e3:.0f} ms | {(ck_total - step_clean) * 1e3:+.0f} ms "
          f"({(ck_total - step_clean) / step_clean * 100:+.0f}%) | {blocked * 1e3:.0f} ms "
          f"| {during_txt} | {sync_write:.3f} s | {tput:.0f} | {disk_mbs:.0f} "
          f"| {tput / disk_mbs * 100:.0f}% |")
    print()
    print(f"- asynchronous: the checkpointing step's own part {ck_step * 1e3:.0f} ms, the "
          f"checkpoint(wait=False) call {ck_call * 1e3:.0f} ms (blocked_s "
          f"{blocked * 1e3:.0f} ms); writes {med(async_write):.3f} s, {async_tput:.0f} MB/s "
          f"behind training; plain steps: {len(clean)} clean, {len(during)} during a write")
    if next_steps:
        next_extra = med(next_steps) - step_clean
        print(f"- training held per asynchronous checkpoint: the call {ck_call * 1e3:.0f} ms + "
              f"the next step's extra {next_extra * 1e3:+.0f} ms (that step "
              f"{med(next_steps) * 1e3:.0f} ms, n={len(next_steps)}) = "
              f"{(ck_call + next_extra) * 1e3:.0f} ms, {(ck_call + next_extra) / step_clean:.2f} "
              f"steps")
    print(f"- synchronous: checkpoint(wait=True) call {sync_call:.3f} s (blocked_s "
          f"{sync_blocked * 1e3:.0f} ms + write_s {sync_write:.3f} s); bytes per checkpoint "
          f"{sorted(set(i.bytes for _, _, i in sync))}")
    print(f"- disk: {', '.join(f'{ckpt_bytes / t / MB:.0f}' for t in disk)} MB/s "
          f"({ckpt_bytes / MB:.1f} MB, 8 MiB os.write + fsync)")
    print(f"- checkpoint {ckpt_bytes:,} bytes; expected {expected:,} "
          f"({CHECKPOINT_BYTES_PER_PARAM} bytes x {params:,} parameters: fp32 parameters, "
          f"AdamW exp_avg and exp_avg_sq), {(ckpt_bytes - expected) / expected * 100:+.2f}%")
    listening1, _ = line_time(logs[0], r"ranncd listening on")
    print(f"- first daemon start {daemon_start_first:.2f} s (its log's 'listening' at "
          f"+{(listening1 or w_first) - w_first:.2f} s); first step {warm[0]:.2f} s "
          f"(CreateJob {first_create_s:.2f} s); pyrannc.clear() {t_clear:.2f} s, "
          f"_daemon.shutdown() {t_shutdown:.2f} s (ranncd's exit status {exit_status})")
    print()

    def rest(create_s, ph):
        if create_s is None or ph is None:
            return None
        return create_s - sum(ph.values())

    rest1, rest2 = rest(first_create_s, phases1), rest(resume_create_s, phases2)
    daemon_s = (t_started - w0) if t_started else float("nan")
    if resume_create_s is None or create_end is None or phases2 is None or rest1 is None:
        raise RuntimeError("the restart's CreateJob was not found in pyrannc's log or the "
                           f"daemon's ({logs[1]})")
    create_start = create_end - resume_create_s
    print("| restart -> first resumed step | daemon start | until CreateJob (resumed_step, "
          "trace) | CreateJob | of it: load checkpoint (fresh job) | of it: daemon phases "
          "logged | first step after CreateJob | resumed at step |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    ph_txt = ", ".join(f"{k} {v:.2f}" for k, v in phases2.items())
    print(f"| {restart_s:.2f} s | {daemon_s:.2f} s | {create_start - w0 - daemon_s:.2f} s "
          f"| {resume_create_s:.2f} s | {rest2:.2f} s ({rest1:.2f} s) | {ph_txt} "
          f"| {w0 + restart_s - create_end:.2f} s | {start} |")
    print()
    how = ("loaded the first job's saved deployment (no trace, no planning)"
           if args.restart_deployment else "traced and planned again (no saved deployment)")
    print(f"- the restart {how}")
    if resumed_t is not None and created_t is not None and listening_t is not None:
        print(f"- daemon log, after RaNNCModule(...): 'listening' at +{listening_t - w0:.2f} s, "
              f"pyrannc connected at +{daemon_s:.2f} s, 'resumed from' at "
              f"+{resumed_t - w0:.2f} s, 'created job' at +{created_t - w0:.2f} s")
    print(f"- {resumed_line.split('] ', 2)[-1] if resumed_line else 'no resumed-from line'}")
    ok = start == last_step and math.isclose(got, expect, rel_tol=work.rel_tol, abs_tol=1e-5)
    ref_txt = "" if amp_level is None else f" (bf16 {amp_level}, as the daemon)"
    print(f"- resumed at step {start} (last checkpoint {last_step}); first loss {got:.6f} vs "
          f"the pre-restart model's {expect:.6f} in plain PyTorch{ref_txt}: "
          f"{'match' if ok else 'MISMATCH'} (difference {got - expect:+.2e}, tolerance "
          f"{work.rel_tol:g} relative; the fresh initial values' loss {fresh:.6f}); next steps "
          f"{', '.join(f'{s:.3f}' for s in more)} s")

    pyrannc.clear()
    _daemon.shutdown()
    if own_dir and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"- kept {base}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
