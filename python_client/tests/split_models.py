"""Models assembled at random from a library of layers, for the differential test of splitting
the batch (test_batch_split.py).

`random_case(seed)` draws a model family (images, token sequences or feature vectors), a stack
of layers from that family's library, a head and a loss, and returns a Case: the model, its
batches, and whether its samples interact (ground truth, by construction: a layer or loss that
mixes samples was drawn). The same seed always gives the same case, so `RANNC_SPLIT_SEED=<seed>`
reproduces a failure.

The library covers what real models do to a batch: convolutions (plain, depthwise, residual),
norms of every kind (BatchNorm in training and in eval mode, GroupNorm, InstanceNorm with and
without running statistics, LayerNorm, an RMS norm written out), in-place activations,
squeeze-excitation, pooling, dropout (p=0, so that results stay comparable), causal
self-attention, embeddings, reductions over features, and layers that mix samples on purpose
(a batch mean subtracted, a softmax over the batch, in-batch similarity logits). Losses: cross
entropy (mean, sum, with ignore_index padding, class weights, label smoothing, class
probabilities as targets), NLL, MSE, L1,
binary cross entropy, KL divergence with batchmean, and a mean loss plus a weight penalty.
"""

import copy
import dataclasses
import random
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

# Layers and losses whose results for a sample depend on the other samples of the batch.
MIXING = {"bn_train", "bn1d_train", "instnorm_running", "batch_center", "batch_softmax",
          "in_batch_logits", "sum_plus_penalty", "numbered_other_rows"}


@dataclasses.dataclass
class Case:
    seed: int
    family: str
    layers: List[str]
    loss: str
    batch: int
    model: nn.Module
    make_batch: Callable[[int], Tuple[torch.Tensor, ...]]  # step -> forward arguments

    @property
    def mixes_samples(self) -> bool:
        return any(name in MIXING for name in self.layers + [self.loss])

    def describe(self) -> str:
        return (f"seed {self.seed}: {self.family} model, batch {self.batch}, layers "
                f"[{', '.join(self.layers)}], loss {self.loss}"
                f"{' (mixes samples)' if self.mixes_samples else ''}")


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class Lambda(nn.Module):
    """A named function of the activations (for the layers that are one expression)."""

    def __init__(self, name, fn):
        super().__init__()
        self.name = name
        self.fn = fn

    def forward(self, x):
        return self.fn(x)

    def extra_repr(self):
        return self.name


class RmsNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class CausalAttention(nn.Module):
    def __init__(self, dim, heads, seq):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x, key_bias=None):
        """`key_bias`: [B, T], added to each sample's scores of its keys."""
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        hd = c // self.heads
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / hd ** 0.5)
        if key_bias is not None:
            att = att + key_bias[:, None, None, :]
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NumberedMaskAttention(CausalAttention):
    """Causal attention that also down-weights keys by a per-sample mask picked with the
    samples' numbers, as Hugging Face's masks are built: keep[arange(B)[:, None], arange(L)].
    With `other_rows`, each sample picks the mask of the sample numbered after it: mixing."""

    def __init__(self, dim, heads, seq, other_rows):
        super().__init__(dim, heads, seq)
        self.other_rows = other_rows

    def forward(self, x):
        b, t, c = x.size()
        keep = x[..., 0] > -0.5  # per sample
        rows = torch.arange(b)
        if self.other_rows:
            rows = rows.roll(1)
        mask = keep[rows[:, None], torch.arange(t)[None, :]]
        return super().forward(x, key_bias=-4.0 * (~mask).to(x.dtype))


class InBatchLogits(nn.Module):
    """Contrastive-style similarity of every sample with every other: [B, D] -> [B, D]."""

    def forward(self, x):
        sim = F.softmax(x @ x.t(), dim=1)
        return sim @ x


def _image_layer(name, c):
    if name == "conv":
        return nn.Conv2d(c, c, 3, padding=1)
    if name == "dwconv":
        return nn.Conv2d(c, c, 3, padding=1, groups=c)
    if name == "pwconv":
        return nn.Conv2d(c, c, 1)
    if name in ("bn_train", "bn_eval"):
        bn = nn.BatchNorm2d(c)
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
        return bn
    if name == "groupnorm":
        return nn.GroupNorm(2, c)
    if name == "instnorm":
        return nn.InstanceNorm2d(c, affine=True)
    if name == "instnorm_running":
        return nn.InstanceNorm2d(c, affine=True, track_running_stats=True)
    if name == "relu_":
        return nn.ReLU(inplace=True)
    if name == "hardswish_":
        return nn.Hardswish(inplace=True)
    if name == "hardswish":
        return nn.Hardswish()
    if name == "relu":
        return nn.ReLU()
    if name == "silu":
        return nn.SiLU()
    if name == "gelu":
        return nn.GELU()
    if name == "se":
        return torchvision.ops.SqueezeExcitation(c, max(1, c // 2), scale_activation=nn.Hardsigmoid)
    if name == "dropout":
        return nn.Dropout(0.0)
    if name == "dropout2d":
        return nn.Dropout2d(0.0)
    if name == "residual_conv":
        return Residual(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()))
    if name == "stochastic_depth":
        return torchvision.ops.StochasticDepth(0.0, "row")
    if name == "batch_center":
        return Lambda(name, lambda x: x - x.mean(dim=0, keepdim=True))
    if name == "batch_softmax":
        return Lambda(name, lambda x: F.softmax(x, dim=0))
    raise KeyError(name)


def _token_layer(name, d, seq):
    if name == "attention":
        return Residual(CausalAttention(d, 2, seq))
    if name in ("numbered_mask_attention", "numbered_other_rows"):
        return Residual(NumberedMaskAttention(d, 2, seq, name == "numbered_other_rows"))
    if name == "layernorm":
        return nn.LayerNorm(d)
    if name == "rmsnorm":
        return RmsNorm(d)
    if name == "mlp":
        return Residual(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)))
    if name == "relu_":
        return nn.ReLU(inplace=True)
    if name == "relu":
        return nn.ReLU()
    if name == "dropout":
        return nn.Dropout(0.0)
    if name == "tanh":
        return nn.Tanh()
    if name == "batch_center":
        return Lambda(name, lambda x: x - x.mean(dim=0, keepdim=True))
    raise KeyError(name)


def _feature_layer(name, d):
    if name == "linear":
        return nn.Linear(d, d)
    if name == "tanh":
        return nn.Tanh()
    if name == "relu_":
        return nn.ReLU(inplace=True)
    if name == "relu":
        return nn.ReLU()
    if name == "layernorm":
        return nn.LayerNorm(d)
    if name in ("bn1d_train", "bn1d_eval"):
        return nn.BatchNorm1d(d)
    if name == "dropout":
        return nn.Dropout(0.0)
    if name == "residual_mlp":
        return Residual(nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d)))
    if name == "batch_center":
        return Lambda(name, lambda x: x - x.mean(dim=0, keepdim=True))
    if name == "in_batch_logits":
        return InBatchLogits()
    raise KeyError(name)


IMAGE_LAYERS = ["conv", "dwconv", "pwconv", "bn_train", "bn_eval", "groupnorm", "instnorm",
                "instnorm_running", "relu_", "hardswish_", "silu", "gelu", "se", "dropout",
                "dropout2d", "residual_conv", "stochastic_depth", "batch_center",
                "batch_softmax"]
TOKEN_LAYERS = ["attention", "layernorm", "rmsnorm", "mlp", "relu_", "dropout", "tanh",
                "batch_center"]
FEATURE_LAYERS = ["linear", "tanh", "relu_", "layernorm", "bn1d_train", "bn1d_eval", "dropout",
                  "residual_mlp", "batch_center", "in_batch_logits"]
CLASS_LOSSES = ["ce", "ce_sum", "ce_ignore", "ce_weight_ignore", "ce_smooth", "ce_probs", "nll",
                "mse_onehot", "l1_sum", "bce", "kl_batchmean", "mean_plus_penalty",
                "sum_plus_penalty"]
TOKEN_LOSSES = ["ce", "ce_ignore", "ce_weight_ignore", "ce_smooth", "ce_sum", "pooled_ce"]
# Common layers come up more often than the ones that mix samples.
RARE = {"bn_train": 0.5, "bn1d_train": 0.5, "instnorm_running": 0.3, "batch_center": 0.3,
        "batch_softmax": 0.3, "in_batch_logits": 0.3, "sum_plus_penalty": 0.3}


def _pick(rng, names):
    weights = [RARE.get(n, 1.0) for n in names]
    return rng.choices(names, weights)[0]


# Layers whose output their backward does not read, so an in-place activation may follow them.
WRITABLE = {"conv", "dwconv", "pwconv", "bn_train", "bn_eval", "groupnorm", "instnorm",
            "instnorm_running", "residual_conv", "se", "linear", "layernorm", "residual_mlp",
            "mlp", "attention", "rmsnorm", "batch_center", "bn1d_train", "bn1d_eval"}
OUT_OF_PLACE = {"relu_": "relu", "hardswish_": "hardswish"}


def _stack(rng, names, depth):
    """`depth` layers. An in-place activation only follows a layer whose backward does not read
    its output (PyTorch itself refuses the others), or comes first (after the stem)."""
    layers = []
    for _ in range(depth):
        name = _pick(rng, names)
        if name in OUT_OF_PLACE and layers and layers[-1] not in WRITABLE:
            name = OUT_OF_PLACE[name]
        layers.append(name)
    return layers


class ClassLoss(nn.Module):
    """Wraps a network that returns class logits [B, K] with a loss of (x, y)."""

    def __init__(self, net, loss, classes):
        super().__init__()
        self.net = net
        self.loss = loss
        self.classes = classes
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, classes))

    def forward(self, x, y):
        logits = self.net(x)
        name = self.loss
        if name == "ce":
            return F.cross_entropy(logits, y)
        if name == "ce_sum":
            return F.cross_entropy(logits, y, reduction="sum")
        if name == "ce_ignore":
            return F.cross_entropy(logits, y, ignore_index=0)
        if name == "ce_weight_ignore":
            return F.cross_entropy(logits, y, weight=self.class_weight, ignore_index=1)
        if name == "ce_smooth":
            return F.cross_entropy(logits, y, label_smoothing=0.1)
        if name == "ce_probs":
            return F.cross_entropy(logits, F.softmax(F.one_hot(y, self.classes).float() * 3, 1))
        if name == "nll":
            return F.nll_loss(F.log_softmax(logits, dim=1), y)
        if name == "mse_onehot":
            return F.mse_loss(logits, F.one_hot(y, self.classes).float())
        if name == "l1_sum":
            return F.l1_loss(logits, F.one_hot(y, self.classes).float(), reduction="sum")
        if name == "bce":
            return F.binary_cross_entropy_with_logits(logits, F.one_hot(y, self.classes).float())
        if name == "kl_batchmean":
            target = F.softmax(F.one_hot(y, self.classes).float() * 2, dim=1)
            return F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
        penalty = sum((p * p).sum() for p in self.net.parameters()) * 1e-3
        if name == "mean_plus_penalty":
            return F.cross_entropy(logits, y) + penalty
        if name == "sum_plus_penalty":
            return F.cross_entropy(logits, y, reduction="sum") + penalty
        raise KeyError(name)


class TokenModel(nn.Module):
    def __init__(self, layers, loss, vocab, dim, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, dim))
        self.layers = nn.Sequential(*[_token_layer(n, dim, seq) for n in layers])
        self.head = nn.Linear(dim, vocab)
        self.loss = loss
        self.vocab = vocab
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, vocab))

    def forward(self, ids, targets):
        h = self.layers(self.emb(ids) + self.pos[: ids.size(1)])
        if self.loss == "pooled_ce":
            return F.cross_entropy(self.head(h.mean(dim=1)), targets[:, 0] % self.vocab)
        # Next-token prediction over shifted targets; 0 is padding.
        logits = self.head(h)[:, :-1].reshape(-1, self.vocab)
        t = targets[:, 1:].reshape(-1)
        if self.loss == "ce":
            return F.cross_entropy(logits, t)
        if self.loss == "ce_ignore":
            return F.cross_entropy(logits, t, ignore_index=0)
        if self.loss == "ce_weight_ignore":
            return F.cross_entropy(logits, t, weight=self.class_weight, ignore_index=0)
        if self.loss == "ce_smooth":
            return F.cross_entropy(logits, t, ignore_index=0, label_smoothing=0.1)
        if self.loss == "ce_sum":
            return F.cross_entropy(logits, t, ignore_index=0, reduction="sum")
        raise KeyError(self.loss)


def token_case(seed: int, layers: List[str], loss: str, batch: int) -> Case:
    """A TokenModel of `layers` (_token_layer's names) and `loss` (TOKEN_LOSSES)."""
    torch.manual_seed(seed)
    vocab, dim, seq = 11, 8, 6
    model = TokenModel(layers, loss, vocab, dim, seq)

    def make_batch(step, g=torch.Generator()):
        g.manual_seed(seed * 1000 + step)
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        targets = ids.clone()
        # Padding: each sample ends after its own length (at least 2 tokens).
        lengths = torch.randint(2, seq + 1, (batch,), generator=g)
        targets[torch.arange(seq).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
        return ids, targets
    return Case(seed, "tokens", layers, loss, batch, model, make_batch)


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    family = rng.choice(["image", "image", "tokens", "features"])
    # Uneven batches now and then: micro-batches and replicas of different sizes.
    batch = rng.choice([8, 8, 12, 7, 10])
    depth = rng.randint(2, 6)
    if family == "image":
        c, size, classes = 4, 6, 5
        layers = _stack(rng, IMAGE_LAYERS, depth)
        loss = _pick(rng, CLASS_LOSSES)
        modules = [nn.Conv2d(3, c, 3, padding=1)] + [_image_layer(n, c) for n in layers]
        modules += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(c, classes)]
        model = ClassLoss(nn.Sequential(*modules), loss, classes)

        def make_batch(step, g=torch.Generator()):
            g.manual_seed(seed * 1000 + step)
            return (torch.randn(batch, 3, size, size, generator=g),
                    torch.randint(0, classes, (batch,), generator=g))
    elif family == "tokens":
        layers = _stack(rng, TOKEN_LAYERS, depth)
        return token_case(seed, layers, rng.choice(TOKEN_LOSSES), batch)
    else:
        d, classes = 6, 4
        layers = _stack(rng, FEATURE_LAYERS, depth)
        loss = _pick(rng, CLASS_LOSSES)
        modules = [nn.Linear(5, d)] + [_feature_layer(n, d) for n in layers] + [nn.Linear(d, classes)]
        model = ClassLoss(nn.Sequential(*modules), loss, classes)

        def make_batch(step, g=torch.Generator()):
            g.manual_seed(seed * 1000 + step)
            return (torch.randn(batch, 5, generator=g),
                    torch.randint(0, classes, (batch,), generator=g))
    # Eval-mode norms: their statistics are the running ones, the same for every sample.
    for name, module in zip(layers, _layer_modules(model, family)):
        if name in ("bn_eval", "bn1d_eval"):
            module.eval()
    return Case(seed, family, layers, loss, batch, model, make_batch)


def _layer_modules(model, family):
    if family == "tokens":
        return list(model.layers)
    return list(model.net)[1:-3] if family == "image" else list(model.net)[1:-1]


def copy_model(model: nn.Module) -> nn.Module:
    """The PyTorch reference: the same initial values, modes and buffers."""
    return copy.deepcopy(model)
