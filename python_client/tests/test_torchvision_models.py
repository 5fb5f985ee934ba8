"""Real models nobody here wrote (torchvision's, random init) train exactly like PyTorch on the
daemon's devices (RANNC_DEVICES: the Bazel targets run cpu:1, cpu:2 and cpu:4), under the
planner's own plan and under forced ones.

  - MobileNetV3-small and ResNet-18 in training mode: their BatchNorms normalize over the
    batch, so every plan keeps it whole (and says so: Deployment.batch_whole names the
    BatchNorm); a forced plan that would split it is refused; stages alone are allowed.
    Adam, as a user would train them.
  - A VisionTransformer (2 layers, width 32, 8x8 patches) and torch.nn.TransformerEncoder (2
    layers over the patches): their nn.MultiheadAttention merges the batch with the sequence
    for its output projection ((length * batch, embed) rows), which the analysis follows
    (graph/batch_flow.h, kInterleaved): forced plans split the batch. SGD.
  - MobileNetV3-small with its BatchNorms frozen in eval mode (fine-tuning) and SqueezeNet (no
    normalization): samples independent, so forced plans split the batch into micro-batches
    and replicas, and the results still equal PyTorch's. SGD with momentum: a split reorders
    fp32 sums, and Adam would turn the round-off of gradients whose true value is zero into
    lr-sized steps (test_pipeline_conformance.py says more).

Losses, every gradient and every parameter and buffer after two steps: rtol 1e-5, atol 1e-6.
"""

import re

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import pyrannc
from pyrannc.errors import RanncError
from conftest import assert_close, daemon_device_names

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

PLAN_KEYS = ("RANNC_PARTITION_NUM", "RANNC_PIPELINE_NUM", "RANNC_REPLICA_NUM")
STEPS = 2
BATCH = 8


class WithLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def _mobilenet():
    return torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)


def _frozen_bn_mobilenet():
    net = _mobilenet()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
            m.eval()
    return net


def _squeezenet():
    net = torchvision.models.squeezenet1_1(num_classes=10)
    net.classifier[0].p = 0.0
    return net


def _vit():
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        dropout=0.0, attention_dropout=0.0, num_classes=10)


class PatchEncoder(nn.Module):
    """torch.nn.TransformerEncoder over an image's 8x8 patches, mean-pooled into 10 classes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3 * 8 * 8, 32)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        patches = x.unfold(2, 8, 8).unfold(3, 8, 8)  # B, 3, 4, 4, 8, 8
        tokens = patches.permute(0, 2, 3, 1, 4, 5).reshape(x.size(0), 16, 3 * 8 * 8)
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-3)


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


_BATCH_NORM = "BatchNorm2d.*normalizes over the batch"

# name -> (model factory, optimizer, image size, why the plan keeps the batch whole: a regular
# expression of Deployment.batch_whole, or None when the batch may be split)
MODELS = {
    "mobilenet_v3_small": (_mobilenet, _adam, 32, _BATCH_NORM),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), _adam, 32, _BATCH_NORM),
    "mobilenet_v3_small_frozen_bn": (_frozen_bn_mobilenet, _sgd, 32, None),
    "squeezenet1_1": (_squeezenet, _sgd, 64, None),
    "vit_tiny": (_vit, _sgd, 32, None),
    "transformer_encoder": (PatchEncoder, _sgd, 32, None),
}

# Per device count: forced (partition, pipeline, replica) plans, up to 4 stages.
FORCED = {
    1: [(1, 2, 1), (1, 4, 1), (1, 1, 1)],
    2: [(1, 1, 2), (2, 2, 1), (2, 1, 1)],
    4: [(1, 2, 4), (2, 2, 2), (4, 2, 1)],
}


def _batch(step, size):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _run(name, plan, monkeypatch):
    for key in PLAN_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in zip(PLAN_KEYS, plan or ()):
        monkeypatch.setenv(key, str(value))
    make, optimizer, size, _ = MODELS[name]
    torch.manual_seed(0)
    model = WithLoss(make())
    ref = WithLoss(make())
    ref.load_state_dict(model.state_dict())
    for a, b in zip(model.modules(), ref.modules()):
        b.train(a.training)
    opt, ref_opt = optimizer(model), optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    try:
        for step in range(STEPS):
            x, y = _batch(step, size)
            loss = rmod(x, y)
            loss.backward()
            ref_loss = ref(x, y)
            ref_loss.backward()
            what = f"{name}, plan {plan or 'default'}, step {step}"
            assert_close(loss.detach(), ref_loss.detach(), f"{what}: loss")
            for pname, p in ref.named_parameters():
                assert_close(rmod.get_param_grad(pname), p.grad, f"{what}: grad of {pname}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        ours = rmod.state_dict()
        for key, value in ref.state_dict().items():
            assert_close(ours[key], value, f"{name}, plan {plan or 'default'}: {key}")
        return rmod.deployment
    finally:
        pyrannc.clear()


@pytest.mark.parametrize("name", list(MODELS))
def test_default_plan_trains_like_pytorch(name, monkeypatch):
    whole = MODELS[name][3]
    deployment = _run(name, None, monkeypatch)
    if whole:
        assert re.search(whole, deployment.batch_whole), deployment.batch_whole
        assert deployment.micro_batches == 1
        assert all(len(s.devices) == 1 for s in deployment.stages)
    else:
        assert not deployment.batch_whole, deployment.batch_whole


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_forced_plan_trains_like_pytorch_or_is_refused(name, index, monkeypatch):
    plan = FORCED[len(daemon_device_names())][index]
    splits = plan[1] > 1 or plan[2] > 1
    if MODELS[name][3] and splits:
        with pytest.raises(RanncError,
                           match=MODELS[name][3] + ".*splitting it would change the results"):
            _run(name, plan, monkeypatch)
        return
    deployment = _run(name, plan, monkeypatch)
    assert len(deployment.stages) == plan[0]
    assert deployment.micro_batches == plan[1]
    assert all(len(s.devices) == plan[2] for s in deployment.stages)
