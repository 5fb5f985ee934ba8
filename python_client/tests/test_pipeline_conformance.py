"""Pipeline conformance on four devices: every plan shape trains like single-device PyTorch.

Needs a daemon with exactly four devices: RANNC_DEVICES=cpu:4 (set by the Bazel target), or
e.g. cuda:0,1,2,3 on a GPU machine (with RANNC_TEST_REF_DEVICE=cuda, see conftest). With any
other number the daemon's tests fail at setup saying so (conftest's four_devices); the job's
devices are expected to be the daemon's, by the names it gives them.
For each of four models (an MLP, a GPT with a tied embedding, a two-input model that uses one
weight twice, and a model whose loss the client computes from its logits), each plan
(partition_num x pipeline_num [x replica_num] forced through RANNC_* config, or nothing forced so
the planner chooses) and each schedule (1F1B, GPipe), a case:

  - copies the model (same initial values) into a RaNNCModule and a PyTorch reference;
  - runs 4 optimizer steps on batches of 16, comparing after every backward the loss and the
    gradient of every parameter name (tied aliases included);
  - after the last step compares every parameter and buffer, and the local module's refreshed
    tensors;
  - checks that the deployment honours the forced plan (stages, micro-batches, replicas when
    forced, schedule) and that the job runs on all four devices (use_all_devices, the default);
  - compares one forward under torch.no_grad() (train mode) and one in eval mode;
  - deletes its daemon job, so jobs do not pile up in the session's daemon.

Tolerance: conftest.assert_close, rtol 1e-5 / atol 1e-6, for SGD with momentum (mlp, gpt_tied)
and Adam (two_inputs_shared, client_loss) alike. A pipeline changes only the order of fp32
reductions (micro-batch losses combined as a batch-weighted mean, gradients accumulated over
micro-batches and all-reduced over replicas), which moves values by a few ulps. Emulating that in
plain PyTorch (test_reordered_reductions_stay_within_tolerance) keeps every loss, gradient and
parameter of these cases within a tenth of this tolerance after 4 steps. Adam is kept off the
GPT for the reason given at its entry in MODELS.

The reference (and both models of test_reordered_reductions_stay_within_tolerance) runs on
RANNC_TEST_REF_DEVICE: model, optimizer and batches there, its values compared on the CPU.
"""

import copy
import dataclasses
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyrannc
from pyrannc.proto.rannc.v1 import deployment_pb2 as dpb
from conftest import REF_DEVICE, assert_close, daemon_device_names, ref_copy, to_cpu, to_ref
import models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

NUM_DEVICES = 4  # what the four_devices fixture (conftest) requires of the daemon
# Divisible by every forced micro-batch x replica count below; the planner's own plans may split
# it unevenly (it gave the GPT 3 replicas), which the runtime must handle too.
BATCH = 16
STEPS = 4
TWO_INPUTS_DIM = 32


# ----------------------------------------------------------------------------------------------
# Models (deterministic: no dropout, no batch statistics).


class DeepMLP(nn.Module):
    """Computes its own mean loss from (x, y); four linear layers so four stages have work."""

    def __init__(self, d_in=8, hidden=48, classes=4, depth=4):
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x, y):
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.out(x), y)


class TwoInputsLoss(models.TwoInputs):
    """models.TwoInputs (two inputs, `w` used twice) with its mean-squared loss inside."""

    def __init__(self):
        super().__init__(d=TWO_INPUTS_DIM)

    def forward(self, a, b, y):
        return F.mse_loss(super().forward(a, b), y)


class LogitsNet(nn.Module):
    """Returns logits [B, C]; the test computes the loss from pyrannc's outputs."""

    def __init__(self, d_in=10, hidden=48, classes=5):
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, hidden)
        self.l4 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.gelu(self.l1(x))
        x = torch.tanh(self.l2(x))
        x = F.gelu(self.l3(x)) + x
        return self.l4(x)


def _classification_batch(seed, d_in, classes):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, d_in, generator=g), torch.randint(0, classes, (BATCH,), generator=g)


@dataclasses.dataclass(frozen=True)
class ModelCase:
    make: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: Callable[[int], tuple]           # step -> inputs (and targets)
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    output: Callable[[nn.Module, tuple], torch.Tensor]  # what the eval check compares


def _model_loss(m, batch):
    return m(*batch)


def _client_loss(m, batch):
    x, y = batch
    return F.cross_entropy(m(x), y)


def _logits(m, batch):
    return m(batch[0])


MODELS: Dict[str, ModelCase] = {
    "mlp": ModelCase(
        make=DeepMLP,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        batch=lambda step: _classification_batch(6000 + step, 8, 4),
        loss=_model_loss, output=_model_loss),
    "gpt_tied": ModelCase(
        make=lambda: models.TinyGPT(layers=3),
        # Not Adam: the key part of each qkv bias has an exactly-zero true gradient (softmax
        # ignores a constant added to every key), so its computed gradient is pure round-off,
        # ordered differently by a pipeline; Adam normalises that noise into updates of size
        # lr: with Adam here, test_reordered_reductions_stay_within_tolerance fails on
        # blocks.0.attn.qkv.bias (1e-4 apart for 3e-3 updates).
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        batch=lambda step: models.gpt_batch(step, batch=BATCH),
        loss=_model_loss, output=_model_loss),
    "two_inputs_shared": ModelCase(
        make=TwoInputsLoss,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        batch=lambda step: models.two_inputs_batch(step, batch=BATCH, d=TWO_INPUTS_DIM),
        loss=_model_loss, output=_model_loss),
    "client_loss": ModelCase(
        make=LogitsNet,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        batch=lambda step: _classification_batch(7000 + step, 10, 5),
        loss=_client_loss, output=_logits),
}

# Forced plans, (partition_num, pipeline_num, replica_num); None leaves that key to the
# planner. "planner" forces nothing but the schedule, which every case sets.
PLANS = {
    "2x1": (2, 1, None),
    "2x4": (2, 4, None),
    "4x2": (4, 2, None),
    "2x2x2": (2, 2, 2),
    "planner": None,
}

SCHEDULES = {"1f1b": dpb.SCHEDULE_1F1B, "gpipe": dpb.SCHEDULE_GPIPE}

PLAN_KEYS = ("RANNC_PARTITION_NUM", "RANNC_PIPELINE_NUM", "RANNC_REPLICA_NUM")


def _set_plan_config(monkeypatch, plan, schedule):
    """The job reads RANNC_* config when it is created (first forward)."""
    for key in PLAN_KEYS:
        monkeypatch.delenv(key, raising=False)
    if plan is not None:
        for key, value in zip(PLAN_KEYS, plan):
            if value is not None:
                monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("RANNC_SCHEDULE", schedule)


def _check_deployment(rmod, plan, schedule, client_loss):
    d = rmod.deployment
    assert d is not None, "the job has no deployment"
    stages = sorted(d.stages, key=lambda s: s.index)
    shape = [(s.first_node, s.end_node, list(s.devices)) for s in stages]
    # Logits for a loss the client computes: the backwards wait for the client's gradients, so
    # the runtime runs (and the planner plans) GPipe's order whatever was asked.
    expected = SCHEDULES["gpipe"] if client_loss else SCHEDULES[schedule]
    assert d.schedule == expected, f"schedule {d.schedule} in {d}"
    assert d.num_devices == NUM_DEVICES
    devices = [dev for s in stages for dev in s.devices]
    assert all(s.devices for s in stages), f"a stage without devices: {shape}"
    assert len(devices) == len(set(devices)), f"a device runs two stages: {shape}"
    assert all(dev < NUM_DEVICES for dev in devices), shape
    assert stages[0].first_node == 0 and stages[-1].end_node == d.num_nodes, shape
    assert sorted(devices) == list(range(NUM_DEVICES)), f"not every device is used: {shape}"
    assert list(rmod._job.devices) == daemon_device_names()
    assert all(a.end_node == b.first_node for a, b in zip(stages, stages[1:])), shape
    if plan is None:
        assert 1 <= len(stages) <= NUM_DEVICES and d.micro_batches >= 1
        return
    partition_num, pipeline_num, replica_num = plan
    assert len(stages) == partition_num, f"stages: {shape}"
    assert d.micro_batches == pipeline_num
    if replica_num is not None:
        assert [len(s.devices) for s in stages] == [replica_num] * partition_num, shape


def _named_params_with_aliases(model):
    """Every parameter by every name, tied aliases included (GPT's head.weight is tok.weight),
    which named_parameters() would list once."""
    params = {id(p) for p in model.parameters()}
    return [(n, t) for n, t in model.state_dict(keep_vars=True).items() if id(t) in params]


def _compare_grads(rmod, ref, step):
    for name, p in _named_params_with_aliases(ref):
        got = rmod.get_param_grad(name)
        assert got is not None, f"{name} has no gradient in ranncd at step {step}"
        assert_close(got, p.grad, f"grad of {name} at step {step}")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.usefixtures("four_devices")
def test_pipeline_matches_pytorch(model_name, plan_name, schedule, monkeypatch):
    case, plan = MODELS[model_name], PLANS[plan_name]
    _set_plan_config(monkeypatch, plan, schedule)
    torch.manual_seed(0)
    model = case.make()
    ref = ref_copy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    try:
        for step in range(STEPS):
            batch = case.batch(step)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, to_ref(batch))
            ref_loss.backward()
            if step == 0:
                _check_deployment(rmod, plan, schedule, case.loss is _client_loss)
            assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
            _compare_grads(rmod, ref, step)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()

        ours, theirs = rmod.state_dict(), ref.state_dict()
        assert list(ours) == list(theirs)
        for name, value in theirs.items():
            assert_close(ours[name], value, f"{name} after {STEPS} steps")
        for (name, p), (ref_name, q) in zip(rmod.named_parameters(), ref.named_parameters()):
            assert name == ref_name
            assert_close(p.detach(), q.detach(), f"local copy of {name}")

        batch = case.batch(STEPS)
        with torch.no_grad():
            assert_close(case.output(rmod, batch), case.output(ref, to_ref(batch)),
                         "no_grad output in train mode")
        rmod.eval()
        ref.eval()
        with torch.no_grad():
            assert_close(case.output(rmod, batch), case.output(ref, to_ref(batch)),
                         "no_grad output in eval mode")
    finally:
        pyrannc.clear()


@pytest.mark.parametrize("micro_batches", [2, 4, 8])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_reordered_reductions_stay_within_tolerance(model_name, micro_batches):
    """The suite's tolerance holds for a pipeline's reduction order, in plain PyTorch: each
    micro-batch's loss weighted by its share of the batch, gradients accumulated over the
    micro-batches last to first. Guards the choice of models and optimizers (Adam on the GPT
    fails here) rather than ranncd."""
    case = MODELS[model_name]
    torch.manual_seed(0)
    whole = case.make().to(REF_DEVICE)
    split = copy.deepcopy(whole)
    whole_opt, split_opt = case.optimizer(whole), case.optimizer(split)
    for step in range(STEPS):
        batch = to_ref(case.batch(step))
        whole_loss = case.loss(whole, batch)
        whole_loss.backward()
        split_loss = 0
        for i in reversed(range(micro_batches)):
            part = tuple(x.chunk(micro_batches)[i] for x in batch)
            loss = case.loss(split, part) * (part[0].shape[0] / BATCH)
            loss.backward()
            split_loss = split_loss + loss.detach()
        assert_close(to_cpu(split_loss), whole_loss.detach(), f"loss at step {step}")
        for (name, p), (_, q) in zip(_named_params_with_aliases(whole),
                                     _named_params_with_aliases(split)):
            assert_close(to_cpu(q.grad), p.grad, f"grad of {name} at step {step}")
        whole_opt.step()
        split_opt.step()
        whole_opt.zero_grad()
        split_opt.zero_grad()
    for (name, p), (_, q) in zip(whole.named_parameters(), split.named_parameters()):
        assert_close(to_cpu(q.detach()), p.detach(), f"{name} after {STEPS} steps")


