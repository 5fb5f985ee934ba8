"""Real models nobody here wrote, on CUDA devices, against PyTorch on the CPU; and the client's
numeric settings (TF32) reaching the daemon. For the GPU machine only, whose PyTorch has
`transformers` and `timm` (docs/building.md, "GPU conformance"):

    RANNC_DAEMON_BIN=build/gpu/daemon/ranncd RANNC_DEVICES=cuda:0/4 \\
      PYTHONPATH=python_client python3 -m pytest python_client/tests/test_gpu_models.py

Models, random init, dropout off, tiny configs: Hugging Face GPT-2, Llama and BERT (eager
attention), timm's ConvNeXt-atto, torchvision's ResNet-18, MobileNetV3-small and
VisionTransformer and torch.nn.TransformerEncoder (test_torchvision_models.py's). Each trains
two SGD steps under the planner's plan and under a forced 2-stage one (with micro-batches and
replicas where the batch may be split), with TF32 off in the client, which the job carries.

Tolerance: CPU and GPU kernels round differently (other summation orders, cuDNN's algorithms),
so values are compared on the scale of their kind: a loss or a parameter within rtol 1e-4 /
atol 1e-5; every gradient within rtol 1e-4 and atol 1e-5 times the largest gradient magnitude
of the model, since a parameter whose true gradient is zero (a key bias under softmax, a bias
before a normalization) has a computed gradient of pure round-off. Where PyTorch itself on the
GPU strays further from the CPU (a model that amplifies round-off), ranncd may stray as far as
twice GPU PyTorch's distance: the same PyTorch model, optimizer and batches run on the GPU
beside it, and every deviation is measured against both.
"""

import json
import os

import pytest
import timm
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import pyrannc
from conftest import daemon_device_names
import test_torchvision_models as tvm

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

PLAN_KEYS = ("RANNC_PARTITION_NUM", "RANNC_PIPELINE_NUM", "RANNC_REPLICA_NUM")
STEPS = 2
BATCH = 8
SEQ = 16
VOCAB = 96
RTOL = 1e-4
ATOL = 1e-5
# Where the measured deviations go (max |ours - ref| / (ATOL-scale + RTOL |ref|) per model).
REPORT = os.environ.get("RANNC_GPU_MODELS_REPORT")


@pytest.fixture(autouse=True, scope="module")
def cuda_daemon_without_tf32(pyrannc_daemon):
    names = daemon_device_names()
    assert names and all(n.startswith("cuda") for n in names), (
        f"this suite needs a daemon on CUDA devices (RANNC_DEVICES=cuda:0/4); it has {names}")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class TokensLoss(nn.Module):
    """A Hugging Face model's own loss, as a tuple's first item (no ModelOutput to trace)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, use_cache=False, return_dict=False)[0]


class BertLoss(TokensLoss):
    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, return_dict=False)[0]


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return TokensLoss(transformers.GPT2LMHeadModel(config))


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation="eager")
    return TokensLoss(transformers.LlamaForCausalLM(config))


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
    return BertLoss(transformers.BertForSequenceClassification(config))


def _convnext():
    return tvm.WithLoss(timm.create_model("convnext_atto", num_classes=10, drop_path_rate=0.0))


def _tokens(step, labels):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, (ids if labels == "tokens" else torch.randint(0, 3, (BATCH,), generator=g))


def _images(size):
    return lambda step: tvm._batch(step, size)


def _vision(name):
    return lambda: tvm.WithLoss(tvm.MODELS[name][0]())


# name -> (model factory, batch(step), forced plan: (partition, pipeline, replica))
MODELS = {
    "hf_gpt2": (_gpt2, lambda s: _tokens(s, "tokens"), (2, 2, 2)),
    "hf_llama": (_llama, lambda s: _tokens(s, "tokens"), (2, 2, 2)),
    "hf_bert": (_bert, lambda s: _tokens(s, "classes"), (2, 2, 2)),
    "timm_convnext_atto": (_convnext, _images(32), (2, 2, 2)),
    # BatchNorm in training mode: the batch stays whole (see test_torchvision_models.py), so
    # the forced plans are stages only.
    "resnet18": (_vision("resnet18"), _images(32), (2, 1, 1)),
    "mobilenet_v3_small": (_vision("mobilenet_v3_small"), _images(32), (2, 1, 1)),
    "vit_tiny": (_vision("vit_tiny"), _images(32), (2, 2, 2)),
    "transformer_encoder": (_vision("transformer_encoder"), _images(32), (2, 2, 2)),
}


def _deviation(actual, expected, atol, rtol=RTOL):
    """max |a - e| / (atol + rtol |e|): at most 1 is within tolerance."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs() / (atol + rtol * expected.abs())).max().item()


def _record(name, plan, worst):
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"model": name, "plan": plan, **worst}) + "\n")


class _Worst:
    """The largest deviations seen, of ranncd and of GPU PyTorch from CPU PyTorch, by kind."""

    def __init__(self):
        self.values = {}

    def check(self, kind, what, ours, gpu, cpu, atol):
        d = _deviation(ours, cpu, atol)
        g = _deviation(gpu, cpu, atol)
        for key, value in ((kind, d), (kind + "_gpu_torch", g),
                           (kind + "_to_gpu_torch", _deviation(ours, gpu, atol))):
            self.values[key] = max(self.values.get(key, 0.0), value)
        assert d <= max(1.0, 2 * g), (
            f"{what} deviates {d:.2f}x the tolerance from CPU PyTorch (GPU PyTorch: {g:.2f}x)")


def _train(name, plan, monkeypatch):
    for key in PLAN_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in zip(PLAN_KEYS, plan or ()):
        monkeypatch.setenv(key, str(value))
    make, batch_fn, _ = MODELS[name]
    torch.manual_seed(0)
    model = make()
    ref, gpu = make(), make()
    ref.load_state_dict(model.state_dict())
    gpu.load_state_dict(model.state_dict())
    for a, b, c in zip(model.modules(), ref.modules(), gpu.modules()):
        b.train(a.training)
        c.train(a.training)
    gpu = gpu.cuda()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref, gpu)]
    rmod = pyrannc.RaNNCModule(model, opts[0])
    worst = _Worst()
    try:
        for step in range(STEPS):
            inputs = batch_fn(step)
            loss = rmod(*inputs)
            loss.backward()
            ref_loss = ref(*inputs)
            ref_loss.backward()
            gpu_loss = gpu(*[x.cuda() for x in inputs])
            gpu_loss.backward()
            what = f"{name}, plan {plan or 'default'}, step {step}"
            worst.check("loss", f"{what}: loss", loss, gpu_loss, ref_loss, ATOL)
            scale = max(p.grad.abs().max().item() for p in ref.parameters()
                        if p.grad is not None)
            gpu_params = dict(gpu.named_parameters())
            for pname, p in ref.named_parameters():
                if p.grad is None:
                    assert rmod.get_param_grad(pname) is None, f"{what}: {pname} has a grad"
                    continue
                worst.check("grad", f"{what}: grad of {pname}", rmod.get_param_grad(pname),
                            gpu_params[pname].grad, p.grad, ATOL * scale)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        ours, gpu_state = rmod.state_dict(), gpu.state_dict()
        for key, value in ref.state_dict().items():
            if not value.is_floating_point():
                assert torch.equal(ours[key].cpu(), value), f"{name}: {key}"
                continue
            worst.check("param", f"{name}, plan {plan or 'default'}: {key}", ours[key],
                        gpu_state[key], value, ATOL)
        _record(name, plan, worst.values)
        return rmod.deployment
    finally:
        pyrannc.clear()


@pytest.mark.parametrize("forced", [False, True], ids=["default plan", "forced plan"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_cpu_pytorch(name, forced, monkeypatch):
    plan = MODELS[name][2] if forced else None
    deployment = _train(name, plan, monkeypatch)
    if forced:
        assert len(deployment.stages) == plan[0]
        assert deployment.micro_batches == plan[1]
        assert all(len(s.devices) == plan[2] for s in deployment.stages)


def test_tf32_convolutions_follow_the_client(monkeypatch):
    # ResNet-18's BatchNorm gradients: ~0.15 (relative) from CPU PyTorch's with TF32
    # convolutions, ~1e-5 without. With the client's TF32 on, ranncd computes as the client's
    # PyTorch on the GPU does; with it off (the other tests), as the CPU does.
    for key in PLAN_KEYS:
        monkeypatch.delenv(key, raising=False)
    torch.backends.cudnn.allow_tf32 = True
    try:
        torch.manual_seed(0)
        model = tvm.WithLoss(tvm.MODELS["resnet18"][0]())
        gpu_ref = tvm.WithLoss(tvm.MODELS["resnet18"][0]())
        gpu_ref.load_state_dict(model.state_dict())
        cpu_ref = tvm.WithLoss(tvm.MODELS["resnet18"][0]())
        cpu_ref.load_state_dict(model.state_dict())
        gpu_ref = gpu_ref.cuda()
        rmod = pyrannc.RaNNCModule(model)
        x, y = tvm._batch(0, 32)
        rmod(x, y).backward()
        gpu_ref(x.cuda(), y.cuda()).backward()
        cpu_ref(x, y).backward()
        scale = max(p.grad.abs().max().item() for p in cpu_ref.parameters())
        # TF32 keeps 10 bits of mantissa: GPU PyTorch and ranncd (whose cuDNN may pick other
        # algorithms) agree to TF32's precision, 1e-2 relative.
        to_gpu = max(_deviation(rmod.get_param_grad(n), p.grad, 1e-3 * scale, rtol=1e-2)
                     for n, p in gpu_ref.named_parameters())
        to_cpu = max(_deviation(rmod.get_param_grad(n), p.grad, ATOL * scale)
                     for n, p in cpu_ref.named_parameters())
        _record("resnet18 tf32", None, {"to_gpu_tf32": to_gpu, "to_cpu": to_cpu})
        assert to_gpu <= 1, f"with TF32 on, {to_gpu:.2f}x TF32's tolerance from GPU PyTorch"
        assert to_cpu > 10, f"with TF32 on, only {to_cpu:.2f}x the tolerance from CPU PyTorch"
    finally:
        torch.backends.cudnn.allow_tf32 = False
        pyrannc.clear()
