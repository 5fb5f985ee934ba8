"""The GPT of issue 7's benchmark, shared by every system it is trained with (gpt_peers.py: torch
DDP, FSDP2, torch.distributed.pipelining; gpt_rannc.py: pyrannc against ranncd).

Workloads (WORKLOADS):
  A     24 layers, d_model 2048, 16 heads, MLP 4x, sequence 1024, vocab 32000: 1.34B parameters;
        global batch 16 sequences.
  B     the same family at ~10B: 40 layers, d_model 4608, 36 heads (head dim 128 as in A),
        sequence 2048, vocab 32000: 10.5B parameters; global batch 16 sequences.
  C     the same family at 3.0B for one H200 (issue 27), sized so that it fits only with
        recomputation: 36 layers, d_model 2560, 20 heads (head dim 128), MLP 4x, sequence 2048,
        vocab 32000: 3,001,441,280 parameters; global batch 20 sequences (40,960 tokens). The
        arithmetic behind the sizes is below ("Memory of FSDP2 on workload C").
  D     the same family with offload on one GPU and its host (issue 27's workload D): d_model
        4096, 32 heads (head dim 128), sequence 2048, vocab 32000, global batch 8 sequences;
        16 layers (3.49B parameters) by default, --layers for the larger sizes (each layer
        201M parameters).
  Dmini D at L = 34 shrunk 256 times in each term that sets its memory (d_model 256, 2 heads,
        sequence 128, vocab 2000: d_model^2, vocab x d_model, tokens x d_model and tokens x
        vocab): the planner's estimate of an offloaded, streamed D checked on a CPU, with
        offload_block_bytes and the device's memory shrunk alike (docs/benchmarks.md).
  tiny  2 layers, d_model 64, sequence 32, vocab 256: for checking the harnesses on a CPU.

The harnesses take --layers, --seq and --batch to override a workload's (add_workload_args,
workload_of).

The model: learned token and position embeddings, pre-LayerNorm blocks (causal self-attention
through F.scaled_dot_product_attention(is_causal=True), GELU MLP), a final LayerNorm and an
untied LM head without bias; no dropout. forward(idx, targets) returns the mean cross-entropy
(computed in fp32), forward(idx) the logits. A GPT can hold a slice of the model (one pipeline
stage): `layers=(lo, hi)`, `embed`, `head`; a stage without the embedding takes hidden states,
one without the head returns them.

Models are built on the meta device and materialized where they train (`build`), then
initialized from a fixed seed (init_weights): every system starts from the same recipe (the same
values wherever the device and the slice are the same).

FLOPs per token follow the issue: 6N + 12*L*d*T (N every parameter, embeddings included; L
layers, d d_model, T sequence length); MFU divides model TFLOP/s per GPU by the H100/H200 dense
bf16 peak, 989 TFLOP/s.

Activation checkpointing (the `activation_checkpoint` setting of GPT and build; parse_ac):
  off         every block keeps what its backward needs;
  on          every block recomputes its activations in backward (torch.utils.checkpoint,
              non-reentrant, around the block's body);
  every:K     every K-th block does (blocks K-1, 2K-1, ... counted from 0 over the whole model, as
              torchtitan's selective layer checkpointing picks them); every:1 is on;
  selective   op-level, as torchtitan's "selective op" checkpointing: every block runs under
              torch.utils.checkpoint with a context_fn from create_selective_checkpoint_contexts
              whose policy saves the outputs of the matrix products (aten.mm, addmm, bmm) and of
              SDPA (its flash, efficient and cuDNN kernels) and recomputes everything else
              (LayerNorm, GELU, the residual sums, the attention output's copy). Needs PyTorch 2.4
              or later (HAS_SELECTIVE_CHECKPOINT); 1.13 has no such API.

Memory of FSDP2 on workload C (memory_estimate; not yet measured). FSDP2 on one GPU with
MixedPrecisionPolicy(bf16 params, fp32 reduce) and fused AdamW; N = 3,001,441,280, B*T = 20 x 2048
= 40,960 tokens a step, d = 2560, L = 36, V = 32000; GiB = 2^30 bytes.
  state       fp32 parameters 4N + AdamW's two fp32 moments 8N = 12N = 33.5 GiB, held all the
              time; the fp32 gradients (4N = 11.2 GiB more) grow during backward while the
              activations are freed, so 16N = 44.7 GiB is the peak only around the optimizer
              step. FSDP2's bf16 copies exist for one or two blocks at a time (2 x 12d^2 bytes,
              0.15 GiB a block) plus the root's embeddings and head (2(2V + T)d = 0.32 GiB):
              inside "misc".
  per block   what a block saves for backward, bf16 (2 bytes an element), per token, with SDPA's
              flash/cuDNN kernel (which saves q, k, v, its output and a log-sum-exp of `heads`
              fp32 values a token: no T^2 term; the written-out "math" attention would also
              keep softmax's bf16 output, 2 x heads x T = 80 KiB a token, about doubling it)
              and no dropout (no masks):
              LayerNorm 1 in (d) + out (d), q/k/v (3d), SDPA out (d), its transposed copy into
              proj (d), LayerNorm 2 in (d) + out (d), fc out = GELU in (4d), GELU out (4d):
              17d elements = 34d bytes = 85 KiB a token (Korthikanti et al.'s 34sbh less its two
              dropout masks, sbh each, plus SDPA's saved output, 2sbh; the log-sum-exp's 80
              bytes ignored).
              checkpointed (on, every:K): only its input, 2d bytes, and in backward one block
              at a time recomputed (34d) with its gradients (~16d).
              selective: its input (2d) + the matrix products' outputs (qkv 3d, proj d, fc 4d,
              out d: 18d bytes) + SDPA's output (2d) = 22d bytes.
  head        ln_f in and out (4d bytes), the bf16 logits (2V) cast to fp32 (4V) for the loss,
              log_softmax's fp32 output saved (4V); in the loss's backward its gradient and the
              logits' (4V each) are alive with the saved output: ~12V + 4d bytes a token = 15.0
              GiB at the start of backward, when every block's activations are still held.
  misc        2 GiB: cuBLAS/cuDNN workspaces, NCCL, the bf16 copies above, allocator slack.
  peak        state + blocks + head + misc at the start of backward (the optimizer step's 16N +
              misc is less for every setting below):
                 off          33.5 + 36 x 34d x 40960 (119.5) + 15.0 + 2 = 170.1 GiB
                 selective    33.5 + 36 x 22d (77.3) + 17.0              = 127.9 GiB
                 every:2      33.5 + 18 x 34d + 18 x 2d (63.3) + 17.0    = 113.9 GiB
                 every:3      33.5 + 24 x 34d + 12 x 2d (82.0) + 17.0    = 132.6 GiB
                 every:4      33.5 + 27 x 34d +  9 x 2d (91.4) + 17.0    = 142.0 GiB
                 on           33.5 + 36 x 2d (7.0) + 17.0                =  57.6 GiB
                 offload, off      119.5 + 17.0 (no state on the GPU)    = 136.6 GiB
              An H200 has ~139 GiB: without recomputation the batch needs 1.22x what there is,
              with full recomputation it takes 41% (80 GiB free), and between them the sweep
              has something to find (every:2 and selective fit by these numbers; every:3 and
              offload without recomputation are at the edge; every:4 does not fit).
  check       the same arithmetic for workload A (1.34B, 16 x 1024 tokens, no recomputation)
              gives 15.0 + 25.5 + 6.0 + 2 = 48.5 GiB (46.5 without misc); FSDP2 measured 45.3
              GiB there (docs/benchmarks.md, 2026-12-02): the arithmetic errs 3-7% high, on the
              safe side for "does not fit", the unsafe side for the settings at the edge.

Runs on PyTorch 1.13 (the CPU checks here) and 2.x: where F.scaled_dot_product_attention is
missing (1.13), attention is written out with a causal mask, as attention="math" asks anyway.
"""

import dataclasses
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
import torch.utils.checkpoint as torch_checkpoint

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM, dense bf16 (the MFU denominator)
SEED = 1234

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
# Op-level selective checkpointing (torch.utils.checkpoint's context_fn with a policy): 2.4+.
HAS_SELECTIVE_CHECKPOINT = (hasattr(torch_checkpoint, "create_selective_checkpoint_contexts")
                            and hasattr(torch_checkpoint, "CheckpointPolicy"))
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    name: str
    layers: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    batch: int  # global batch, in sequences
    mlp_ratio: int = 4
    # FSDP2 runs out of memory without activation checkpointing (gpt_peers.py's --ac auto)
    recompute: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


WORKLOADS = {
    "A": GPTConfig("A", layers=24, d_model=2048, heads=16, seq=1024, vocab=32000, batch=16),
    "B": GPTConfig("B", layers=40, d_model=4608, heads=36, seq=2048, vocab=32000, batch=16,
                   recompute=True),
    "C": GPTConfig("C", layers=36, d_model=2560, heads=20, seq=2048, vocab=32000, batch=20,
                   recompute=True),
    "D": GPTConfig("D", layers=16, d_model=4096, heads=32, seq=2048, vocab=32000, batch=8),
    "Dmini": GPTConfig("Dmini", layers=34, d_model=256, heads=2, seq=128, vocab=2000, batch=8),
    "tiny": GPTConfig("tiny", layers=2, d_model=64, heads=4, seq=32, vocab=256, batch=16),
}


def add_workload_args(p) -> None:
    """--model and the overrides of its sizes, for an argparse parser."""
    p.add_argument("--model", default="A", choices=sorted(WORKLOADS))
    p.add_argument("--layers", type=int, help="override the workload's layer count")
    p.add_argument("--seq", type=int, help="override the workload's sequence length")
    p.add_argument("--batch", type=int, help="override the workload's global batch")


def workload_of(args) -> GPTConfig:
    """The workload add_workload_args's arguments name, with their overrides (its name gets
    them too, e.g. "D-layers24", so that results say what ran)."""
    cfg = WORKLOADS[args.model]
    overrides = {k: getattr(args, k) for k in ("layers", "seq", "batch")
                 if getattr(args, k, None) is not None}
    if not overrides:
        return cfg
    name = "-".join([cfg.name] + [f"{k}{v}" for k, v in overrides.items()])
    return dataclasses.replace(cfg, name=name, **overrides)


def block_params(cfg: GPTConfig) -> int:
    d, m = cfg.d_model, cfg.mlp_ratio
    layer_norms = 2 * 2 * d
    attention = (3 * d * d + 3 * d) + (d * d + d)
    mlp = (m * d * d + m * d) + (m * d * d + d)
    return layer_norms + attention + mlp


def param_count(cfg: GPTConfig) -> int:
    """Parameters of the whole model (equals sum(p.numel()) of a full GPT; checked by
    check_param_count)."""
    d = cfg.d_model
    embeddings = cfg.vocab * d + cfg.seq * d
    head = 2 * d + cfg.vocab * d  # final LayerNorm + untied head
    return cfg.layers * block_params(cfg) + embeddings + head


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token, the issue's 6N + 12*L*d*T."""
    return 6.0 * param_count(cfg) + 12.0 * cfg.layers * cfg.d_model * cfg.seq


def throughput(cfg: GPTConfig, step_seconds: float, gpus: int) -> dict:
    """tokens/s, model TFLOP/s per GPU and MFU for one training step of the global batch."""
    tokens_per_s = cfg.tokens_per_step / step_seconds
    tflops_per_gpu = tokens_per_s * flops_per_token(cfg) / max(gpus, 1) / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops_per_gpu,
            "mfu": tflops_per_gpu / PEAK_BF16_TFLOPS}


AC_SETTINGS = "off | on | every:K | selective"
MISC_BYTES = 2 * GIB  # workspaces, NCCL, FSDP2's bf16 copies, allocator slack (module docstring)


def parse_ac(spec) -> str:
    """An activation-checkpointing setting (module docstring) in its normal form: "off", "on",
    "every:K" (K >= 2; every:1 is "on") or "selective". True and False stand for "on" and
    "off". Raises ValueError for anything else."""
    if spec is True or spec is False:
        return "on" if spec else "off"
    if spec in ("off", "on", "selective"):
        return spec
    kind, _, k = str(spec).partition(":")
    if kind == "every" and k.isdigit() and int(k) >= 1:
        return "on" if int(k) == 1 else f"every:{int(k)}"
    raise ValueError(f"activation checkpointing must be {AC_SETTINGS}, not {spec!r}")


def block_recompute(ac, index: int):
    """What block `index` (from 0, over the whole model) recomputes under setting `ac`: None
    (nothing: it keeps its activations), "full" or "selective"."""
    ac = parse_ac(ac)
    if ac == "off":
        return None
    if ac in ("on", "selective"):
        return "full" if ac == "on" else "selective"
    k = int(ac.partition(":")[2])
    return "full" if (index + 1) % k == 0 else None


def recomputed_blocks(cfg: "GPTConfig", ac) -> int:
    """How many of the model's blocks recompute (fully or selectively) under `ac`."""
    return sum(block_recompute(ac, i) is not None for i in range(cfg.layers))


def saved_bytes_per_token(cfg: "GPTConfig", recompute) -> int:
    """What one block holds for its backward, per token, in bf16 with flash SDPA (module
    docstring): 34d kept, 2d (its input) checkpointed, 22d selective."""
    return {None: 34, "full": 2, "selective": 22}[recompute] * cfg.d_model


def memory_estimate(cfg: "GPTConfig", ac="off", gpus: int = 1, offload: bool = False) -> dict:
    """The peak device memory of FSDP2 (bf16 params, fp32 master weights, gradients and AdamW
    state) per GPU, in bytes, by the module docstring's arithmetic: the peak at the start of
    backward (state + every block's saved tensors + the loss's + misc) or around the optimizer
    step (16N sharded + misc), whichever is more. offload: FSDP2's CPUOffloadPolicy (no
    parameters, gradients or optimizer state on the GPU). An estimate, not a measurement."""
    n = param_count(cfg)
    tokens = cfg.tokens_per_step / gpus
    state = 0 if offload else 12 * n / gpus
    blocks = tokens * sum(saved_bytes_per_token(cfg, block_recompute(ac, i))
                          for i in range(cfg.layers))
    head = tokens * (12 * cfg.vocab + 4 * cfg.d_model)
    backward = state + blocks + head + MISC_BYTES
    optimizer = (0 if offload else 16 * n / gpus) + MISC_BYTES
    return {"state": state, "blocks": blocks, "head": head, "misc": MISC_BYTES,
            "peak": max(backward, optimizer)}


def mem_available():
    """/proc/meminfo's MemAvailable in bytes; None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostPressure:
    """The host's memory pressure over the timed steps, from /proc (Linux; empty elsewhere): the
    least MemAvailable seen at `sample()`, and the major page faults and pages swapped in and out
    since `start()`. A host short of memory drops file pages (code included) and reads them back:
    major faults say so."""

    _COUNTERS = ("pgmajfault", "pswpin", "pswpout")

    def __init__(self):
        self._start = None
        self._min_available = None

    @staticmethod
    def _vmstat() -> dict:
        try:
            with open("/proc/vmstat", encoding="ascii") as f:
                fields = dict(line.split() for line in f)
        except OSError:
            return {}
        return {k: int(fields[k]) for k in HostPressure._COUNTERS if k in fields}

    def start(self) -> None:
        self._start = self._vmstat()
        self.sample()

    def sample(self) -> None:
        available = mem_available()
        if available is not None and (self._min_available is None
                                      or available < self._min_available):
            self._min_available = available

    def record(self) -> dict:
        """The fields a result line gets: host_min_available_gib, host_major_faults,
        host_pages_swapped (None where /proc does not say)."""
        end = self._vmstat()
        start = self._start or {}
        delta = {k: end[k] - start[k] for k in end if k in start}
        swapped = (delta["pswpin"] + delta["pswpout"]
                   if "pswpin" in delta and "pswpout" in delta else None)
        return {
            "host_min_available_gib": None if self._min_available is None
            else self._min_available / 2**30,
            "host_major_faults": delta.get("pgmajfault"),
            "host_pages_swapped": swapped,
        }


class HostLowWater:
    """The least MemAvailable over a stretch of a run, sampled every `period` seconds by a
    thread: for the set-up (model build, trace, the job's creation, the first step), where the
    host's memory peaks before HostPressure's timed steps start, and where several processes
    (client, daemon) hold copies at once, so that no one process's peak says it."""

    def __init__(self, period: float = 0.2):
        import threading
        self._period = period
        self._low = mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-low-water", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            available = mem_available()
            if available is not None and (self._low is None or available < self._low):
                self._low = available

    def stop(self):
        """Stops sampling; the least MemAvailable seen, in GiB (None where /proc does not
        say)."""
        self._stop.set()
        self._thread.join()
        return None if self._low is None else self._low / 2**30


def emit(record: dict, out=None) -> None:
    """Prints `record` as one JSON line (the harnesses' result format) and, with `out`, appends
    it to that file."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def stage_layers(cfg: GPTConfig, stage: int, stages: int):
    """The layers [lo, hi) of pipeline stage `stage` of `stages`: an even split."""
    per = cfg.layers // stages
    extra = cfg.layers % stages
    lo = stage * per + min(stage, extra)
    return lo, lo + per + (1 if stage < extra else 0)


ATTENTIONS = ("sdpa", "math")


def effective_attention(attention: str) -> str:
    """What `attention` runs as with this PyTorch ("math" where there is no SDPA)."""
    return "sdpa" if attention == "sdpa" and _HAS_SDPA else "math"


class CausalSelfAttention(nn.Module):
    """attention "sdpa": F.scaled_dot_product_attention(is_causal=True), the issue's; "math":
    written out with a causal mask (what PyTorch 1.13 gets, and a fallback for a runtime that
    cannot run the fused op)."""

    def __init__(self, cfg: GPTConfig, device, attention="sdpa"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")
        d = cfg.d_model
        self.heads = cfg.heads
        self.sdpa = attention == "sdpa" and _HAS_SDPA
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        if not self.sdpa:
            self.scale = 1.0 / math.sqrt(d // cfg.heads)
            # float, not bool: gloo (DDP's buffer broadcast on CPU) has no bool
            self.register_buffer("mask", torch.empty(cfg.seq, cfg.seq, device=device),
                                 persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(self.mask[:t, :t] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def _selective_save_ops():
    """The ops whose outputs selective checkpointing keeps: the matrix products and SDPA's
    kernels, those this PyTorch has."""
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    ops = set()
    for name in names:
        try:
            ops.add(getattr(torch.ops.aten, name).default)
        except (AttributeError, RuntimeError):  # an op this PyTorch lacks
            pass
    return frozenset(ops)


def selective_checkpoint_context():
    """torch.utils.checkpoint's context_fn for selective checkpointing: save the outputs of
    _selective_save_ops, recompute everything else (torchtitan's policy, with every matrix
    product kept)."""
    save = _selective_save_ops()
    policy_enum = torch_checkpoint.CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return policy_enum.MUST_SAVE if op in save else policy_enum.PREFER_RECOMPUTE

    return torch_checkpoint.create_selective_checkpoint_contexts(policy)


class Block(nn.Module):
    """A pre-LayerNorm transformer block. recompute "full" (or True) recomputes its activations
    in backward (non-reentrant torch.utils.checkpoint of the block's body, inside the block's
    own forward, so a wrapper's hooks on the block, FSDP2's all-gather, run once per forward as
    with torch's checkpoint_wrapper); "selective" does the same with
    selective_checkpoint_context, so only what is not a matrix product or attention is
    recomputed; None (or False) keeps everything."""

    def __init__(self, cfg: GPTConfig, device, attention="sdpa", recompute=None):
        super().__init__()
        d, m = cfg.d_model, cfg.mlp_ratio
        self.ln1 = nn.LayerNorm(d, device=device)
        self.attn = CausalSelfAttention(cfg, device, attention)
        self.ln2 = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, m * d, device=device)
        self.act = nn.GELU()
        self.out = nn.Linear(m * d, d, device=device)
        if recompute is True or recompute is False:
            recompute = "full" if recompute else None
        if recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute must be None, 'full' or 'selective', not {recompute!r}")
        if recompute == "selective" and not HAS_SELECTIVE_CHECKPOINT:
            raise RuntimeError("selective checkpointing needs torch.utils.checkpoint's "
                               "create_selective_checkpoint_contexts (PyTorch 2.4 or later), "
                               f"not {torch.__version__}")
        self.recompute = recompute

    def body(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))

    def forward(self, x):
        if self.recompute and self.training and torch.is_grad_enabled():
            kwargs = {}
            if self.recompute == "selective":
                kwargs["context_fn"] = selective_checkpoint_context
            return torch_checkpoint.checkpoint(self.body, x, use_reentrant=False, **kwargs)
        return self.body(x)


def lm_loss(logits, targets):
    """Mean cross-entropy over every token, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """The GPT, or the slice of it one pipeline stage holds (see the module docstring).

    activation_checkpoint: which blocks recompute their activations in backward, and how: a
    setting of parse_ac ("off", "on", "every:K", "selective"; False and True are "off" and
    "on"), applied by each block's index in the whole model (block_recompute), so a pipeline
    stage's slice recomputes the blocks the whole model would. attention: see
    CausalSelfAttention.
    """

    def __init__(self, cfg: GPTConfig, device="meta", layers=None, embed=True, head=True,
                 activation_checkpoint=False, attention="sdpa"):
        super().__init__()
        self.cfg = cfg
        lo, hi = layers if layers is not None else (0, cfg.layers)
        d = cfg.d_model
        self.tok = nn.Embedding(cfg.vocab, d, device=device) if embed else None
        self.pos = nn.Parameter(torch.empty(1, cfg.seq, d, device=device)) if embed else None
        self.ac = parse_ac(activation_checkpoint)
        self.blocks = nn.ModuleList([Block(cfg, device, attention, block_recompute(self.ac, i))
                                     for i in range(lo, hi)])
        self.ln_f = nn.LayerNorm(d, device=device) if head else None
        self.head = nn.Linear(d, cfg.vocab, bias=False, device=device) if head else None

    def forward(self, x, targets=None):
        if self.tok is not None:
            x = self.tok(x) + self.pos[:, :x.size(1)]
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return lm_loss(logits, targets)

    @torch.no_grad()
    def init_weights(self, seed: int = SEED) -> None:
        """GPT-2's recipe: N(0, 0.02) weights and embeddings, zero biases, unit LayerNorms;
        from `seed` (CPU and CUDA generators alike)."""
        torch.manual_seed(seed)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, CausalSelfAttention) and not m.sdpa:
                m.mask.copy_(torch.ones_like(m.mask).tril())
        if self.pos is not None:
            nn.init.normal_(self.pos, std=0.02)


def build(cfg: GPTConfig, device, seed: int = SEED, **kwargs) -> GPT:
    """A GPT (or a slice, see GPT) materialized on `device` and initialized from `seed`, without
    first allocating it anywhere else."""
    model = GPT(cfg, device="meta", **kwargs)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def batch(cfg: GPTConfig, sequences: int, generator: torch.Generator, device="cpu"):
    """Random token ids (inputs, next-token targets) of `sequences` sequences, made on the CPU
    from `generator` so every system can draw the same batches."""
    ids = torch.randint(0, cfg.vocab, (sequences, cfg.seq + 1), generator=generator)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def check_param_count(cfg: GPTConfig) -> None:
    model = GPT(cfg, device="meta")
    got = sum(p.numel() for p in model.parameters())
    if got != param_count(cfg):
        raise AssertionError(f"{cfg.name}: the model has {got} parameters, param_count says "
                             f"{param_count(cfg)}")
    halves = [GPT(cfg, device="meta", layers=stage_layers(cfg, s, 2), embed=s == 0,
                  head=s == 1) for s in range(2)]
    split = sum(p.numel() for h in halves for p in h.parameters())
    if split != got:
        raise AssertionError(f"{cfg.name}: two stages hold {split} parameters, not {got}")


def main():
    for cfg in WORKLOADS.values():
        check_param_count(cfg)
        print(f"{cfg.name}: {param_count(cfg) / 1e9:.3f}B parameters, "
              f"{flops_per_token(cfg) / 1e9:.2f} GFLOP/token, "
              f"{cfg.tokens_per_step} tokens/step, "
              f"{flops_per_token(cfg) * cfg.tokens_per_step / 1e12:.1f} TFLOP/step")
    # The module docstring's arithmetic: FSDP2's estimated peak on one GPU.
    for name, settings in (("A", ("off",)),
                           ("C", ("off", "selective", "every:2", "every:3", "every:4", "on"))):
        cfg = WORKLOADS[name]
        for ac in settings:
            for offload in (False, True) if (name, ac) == ("C", "off") else (False,):
                e = memory_estimate(cfg, ac, 1, offload)
                print(f"{name} FSDP2 ac={ac}{' offload' if offload else ''}: peak "
                      f"{e['peak'] / GIB:.1f} GiB (state {e['state'] / GIB:.1f}, blocks "
                      f"{e['blocks'] / GIB:.1f}, head {e['head'] / GIB:.1f}, misc "
                      f"{e['misc'] / GIB:.1f})")


if __name__ == "__main__":
    main()
