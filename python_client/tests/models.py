"""Small models for the suites. Dropout defaults to off so results are comparable with PyTorch.

No forward creates a tensor of its own (the GPT's causal mask is a buffer), so a reference moved
with .to(device) (conftest.ref_copy, RANNC_TEST_REF_DEVICE) runs there whole; a forward that
needs a new tensor must make it on its input's device (torch.ones(..., device=x.device)).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """RaNNC style: the model computes its own loss from (x, y)."""

    def __init__(self, d_in=8, hidden=16, classes=4):
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


def mlp_batch(step, batch=16, d_in=8, classes=4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads, max_len, dropout=0.0, qkv_bias=True):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)
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
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, heads, max_len, dropout=0.0, qkv_bias=True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, max_len, dropout, qkv_bias)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT whose LM head shares the token embedding's weight (tied: two names, one tensor).

    With qkv_bias (the default) the attention's key bias is a parameter whose true gradient is
    zero (softmax ignores a shift shared by a query's logits): its gradient is round-off."""

    def __init__(self, vocab=32, d=16, heads=2, layers=2, max_len=8, dropout=0.0,
                 qkv_bias=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(d, heads, max_len, dropout, qkv_bias)
                                      for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.drop(self.tok(idx) + self.pos[:, :t])
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_batch(step, batch=4, seq=8, vocab=32):
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class CNN(nn.Module):
    """Conv + BatchNorm; returns logits, the caller computes the loss."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def cnn_batch(step, batch=8, classes=10):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, classes, (batch,),
                                                                   generator=g)


class MultiOutput(nn.Module):
    """Returns a dict with a tuple inside, a constant, and an integer tensor."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 12)
        self.cls = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        logits = self.cls(h)
        return {"logits": logits, "aux": (h, None), "pred": logits.argmax(-1)}


def multi_batch(step, batch=10):
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)


class TwoInputs(nn.Module):
    """Two inputs and one weight used twice in the graph."""

    def __init__(self, d=6):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.bias = nn.Parameter(torch.zeros(d))
        self.out = nn.Linear(d, 1)

    def forward(self, a, b):
        h = torch.tanh(a @ self.w + self.bias)
        h = torch.tanh(h @ self.w + b)
        return self.out(h).squeeze(-1)


def two_inputs_batch(step, batch=12, d=6):
    g = torch.Generator().manual_seed(5000 + step)
    return (torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g),
            torch.randn(batch, generator=g))


class DropoutNet(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(p)
        self.l2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.l2(self.drop(torch.relu(self.l1(x))))
