#!/usr/bin/python3
"""Train a small byte-level GPT through pyrannc: the model runs in ranncd, this script is an
ordinary PyTorch training loop.

    PYTHONPATH=python_client /usr/bin/python3 examples/train_gpt.py --steps 200

With RANNC_DAEMON unset, pyrannc starts a local ranncd (bazel-bin/daemon/ranncd, on
RANNC_DEVICES=cpu:2 by default) and stops it at exit. The text defaults to the licenses every
Debian system has under /usr/share/common-licenses; --data FILE trains on a file of your own.
"""

import argparse
import glob
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "python_client"))
import pyrannc  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads, max_len, dropout):
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(d // heads)  # a Python float, so tracing keeps it constant
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)).view(
            1, 1, max_len, max_len))

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d, heads, max_len, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, max_len, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """GPT over bytes; the LM head reuses the embedding matrix (tied weights)."""

    def __init__(self, layers, d, heads, max_len, dropout):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(d, heads, max_len, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos[:, :idx.size(1)])
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


def load_text(path):
    if path:
        with open(path, "rb") as f:
            return f.read()
    files = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))
    if not files:
        sys.exit("no text under /usr/share/common-licenses; pass --data FILE")
    return b"\n".join(open(p, "rb").read() for p in files)


def batches(data, batch, seq, generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def add_training_arguments(ap):
    """The data, model and training options (detached_gpt.py takes the same)."""
    ap.add_argument("--data", help="a text file (default: /usr/share/common-licenses/*)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(ap)
    ap.add_argument("--dropout", type=float, default=0.0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    raw = load_text(args.data)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    print(f"{len(raw) / 1e3:.0f} kB of text, {args.steps} steps of {args.batch}x{args.seq} bytes")

    model = ByteGPT(args.layers, args.dim, args.heads, args.seq, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    model = pyrannc.RaNNCModule(model, optimizer)

    train_batches = batches(train_data, args.batch, args.seq, torch.Generator().manual_seed(1))
    tokens_per_step = args.batch * args.seq
    first_loss = None
    ema = None
    start = time.monotonic()
    bar = tqdm(range(1, args.steps + 1), unit="step", dynamic_ncols=True)
    for step in bar:
        x, y = next(train_batches)
        loss = model(x, y)
        loss.backward()
        model.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        value = loss.item()
        first_loss = value if first_loss is None else first_loss
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        elapsed = time.monotonic() - start
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{step * tokens_per_step / elapsed:,.0f}")

    print(model.plan_summary.rstrip())
    model.eval()
    val_batches = batches(val_data, args.batch, args.seq, torch.Generator().manual_seed(2))
    with torch.no_grad():
        val = sum(model(*next(val_batches)).item() for _ in range(8)) / 8
    elapsed = time.monotonic() - start
    print(f"loss {first_loss:.3f} -> {ema:.3f} (train, smoothed), {val:.3f} (held out); "
          f"{args.steps * tokens_per_step / elapsed:,.0f} tokens/s over {elapsed:.0f} s")


if __name__ == "__main__":
    main()
