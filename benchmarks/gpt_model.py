"""The GPT of issue 7's benchmark, shared by every system it is trained with (gpt_peers.py: torch
DDP, FSDP2, torch.distributed.pipelining; gpt_rannc.py: pyrannc against ranncd).

Workloads (WORKLOADS):
  A     24 layers, d_model 2048, 16 heads, MLP 4x, sequence 1024, vocab 32000: 1.34B parameters;
        global batch 16 sequences.
  B     the same family at ~10B: 40 layers, d_model 4608, 36 heads (head dim 128 as in A),
        sequence 2048, vocab 32000: 10.5B parameters; global batch 16 sequences.
  tiny  2 layers, d_model 64, sequence 32, vocab 256: for checking the harnesses on a CPU.

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

Runs on PyTorch 1.13 (the CPU checks here) and 2.x: where F.scaled_dot_product_attention is
missing (1.13), attention is written out with a causal mask, as attention="math" asks anyway.
"""

import dataclasses
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM, dense bf16 (the MFU denominator)
SEED = 1234

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


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

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


WORKLOADS = {
    "A": GPTConfig("A", layers=24, d_model=2048, heads=16, seq=1024, vocab=32000, batch=16),
    "B": GPTConfig("B", layers=40, d_model=4608, heads=36, seq=2048, vocab=32000, batch=16),
    "tiny": GPTConfig("tiny", layers=2, d_model=64, heads=4, seq=32, vocab=256, batch=16),
}


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


class Block(nn.Module):
    """A pre-LayerNorm transformer block. activation_checkpoint=True recomputes its activations
    in backward (non-reentrant torch.utils.checkpoint of the block's body, inside the block's
    own forward, so a wrapper's hooks on the block, FSDP2's all-gather, run once per forward as
    with torch's checkpoint_wrapper)."""

    def __init__(self, cfg: GPTConfig, device, attention="sdpa", activation_checkpoint=False):
        super().__init__()
        d, m = cfg.d_model, cfg.mlp_ratio
        self.ln1 = nn.LayerNorm(d, device=device)
        self.attn = CausalSelfAttention(cfg, device, attention)
        self.ln2 = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, m * d, device=device)
        self.act = nn.GELU()
        self.out = nn.Linear(m * d, d, device=device)
        self.activation_checkpoint = activation_checkpoint

    def body(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))

    def forward(self, x):
        if self.activation_checkpoint and self.training and torch.is_grad_enabled():
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


def lm_loss(logits, targets):
    """Mean cross-entropy over every token, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """The GPT, or the slice of it one pipeline stage holds (see the module docstring).

    activation_checkpoint=True recomputes each block's activations in backward (see Block), for
    FSDP2 on workload B. attention: see CausalSelfAttention.
    """

    def __init__(self, cfg: GPTConfig, device="meta", layers=None, embed=True, head=True,
                 activation_checkpoint=False, attention="sdpa"):
        super().__init__()
        self.cfg = cfg
        lo, hi = layers if layers is not None else (0, cfg.layers)
        d = cfg.d_model
        self.tok = nn.Embedding(cfg.vocab, d, device=device) if embed else None
        self.pos = nn.Parameter(torch.empty(1, cfg.seq, d, device=device)) if embed else None
        self.blocks = nn.ModuleList([Block(cfg, device, attention, activation_checkpoint)
                                     for _ in range(lo, hi)])
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


if __name__ == "__main__":
    main()
