"""The planner through pyrannc and the real ranncd: the deployment a job gets at its first
forward, saving it, loading it into a new job (which skips planning), printing it, and the
RANNC_* planner config keys. The daemon runs on --devices cpu:2 (conftest's default).

Numeric comparisons use torch.testing.assert_close(rtol=1e-5, atol=1e-6).
"""

import copy
import re

import grpc
import pytest
import torch
import torch.nn.functional as F

import pyrannc
from pyrannc import _daemon
from pyrannc.proto.rannc.v1 import deployment_pb2 as dpb
from conftest import assert_close
import models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")


class MLP3(torch.nn.Module):
    """Three linear layers: enough atomic nodes for a two-stage pipeline."""

    def __init__(self, d_in=8, hidden=32, classes=4):
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.l3 = torch.nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        return F.cross_entropy(self.l3(h), y)


def _check_covers(deployment):
    """Stages in index order run every atomic node exactly once, in order."""
    stages = sorted(deployment.stages, key=lambda s: s.index)
    assert [s.index for s in stages] == list(range(len(stages)))
    assert len(stages) >= 1
    assert stages[0].first_node == 0
    for prev, cur in zip(stages, stages[1:]):
        assert cur.first_node == prev.end_node, f"gap or overlap between stages {prev} {cur}"
    assert stages[-1].end_node == deployment.num_nodes
    assert all(s.first_node < s.end_node for s in stages)
    for s in stages:
        assert len(s.devices) >= 1
        assert all(d < deployment.num_devices for d in s.devices)


def _train_losses(rmod, opt, steps=3):
    losses = []
    for step in range(steps):
        loss = rmod(*models.mlp_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _module(model_fn=models.MLP, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return pyrannc.RaNNCModule(model, opt, **kwargs), opt


def test_deployment_after_first_forward_saves_and_shows(tmp_path):
    rmod, opt = _module()
    assert rmod.deployment is None and rmod.plan_summary is None
    with pytest.raises(RuntimeError, match="after the first forward"):
        rmod.save_deployment(tmp_path / "early.deployment")
    _train_losses(rmod, opt, steps=1)

    d = rmod.deployment
    assert isinstance(d, dpb.Deployment)
    assert d.format_version == 1
    assert d.model_hash
    assert d.num_nodes >= 1
    _check_covers(d)
    assert not d.loaded
    assert isinstance(rmod.plan_summary, str) and rmod.plan_summary.strip()

    path = tmp_path / "mlp.deployment"
    rmod.save_deployment(path)
    saved = dpb.Deployment.FromString(path.read_bytes())
    # The file is the daemon's plan plus pyrannc's trace of the model (test_saved_trace.py).
    assert saved.HasField("saved_trace") and not d.HasField("saved_trace")
    saved.ClearField("saved_trace")
    assert saved == d
    batch = d.batch_size or 16
    text = pyrannc.show_deployment(path, batch)
    assert d.model_hash in text
    assert "Stage 0: nodes [0, " in text
    assert f"-> stage {d.stages[0].index}, micro-batch size" in text


def test_loaded_deployment_trains_like_the_planned_one(tmp_path):
    first, first_opt = _module(seed=3)
    first_losses = _train_losses(first, first_opt)
    path = tmp_path / "mlp.deployment"
    first.save_deployment(path)

    second, second_opt = _module(seed=3, load_deployment=path)
    second_losses = _train_losses(second, second_opt)
    for i, (a, b) in enumerate(zip(second_losses, first_losses)):
        assert_close(a, b, f"loss of step {i}")
    assert second.deployment is not None and second.deployment.loaded
    assert second.deployment.model_hash == first.deployment.model_hash
    assert ([(s.first_node, s.end_node) for s in second.deployment.stages]
            == [(s.first_node, s.end_node) for s in first.deployment.stages])
    # A str path works as well as a pathlib one.
    third, third_opt = _module(seed=3, load_deployment=str(path))
    assert_close(_train_losses(third, third_opt, steps=1)[0], first_losses[0], "loss, str path")


def test_deployment_of_another_model_is_refused(tmp_path):
    other, other_opt = _module(model_fn=MLP3)
    _train_losses(other, other_opt, steps=1)
    path = tmp_path / "mlp3.deployment"
    other.save_deployment(path)

    rmod, _ = _module(load_deployment=path)
    with pytest.raises(pyrannc.RanncError) as info:
        rmod(*models.mlp_batch(0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in info.value.details.lower()
    assert str(path) in str(info.value)  # the client names the file it sent


def test_a_file_that_is_not_a_deployment_fails_before_the_daemon(tmp_path, monkeypatch):
    bad = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, bad)

    def no_daemon():
        raise AssertionError("the daemon was contacted")

    monkeypatch.setattr(_daemon, "connection", no_daemon)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        pyrannc.RaNNCModule(models.MLP(), load_deployment=bad)
    with pytest.raises(ValueError, match="cannot read"):
        pyrannc.RaNNCModule(models.MLP(), load_deployment=tmp_path / "missing.deployment")


def _train_beside_pytorch(model, steps=2):
    """Trains `model` through pyrannc and a copy of it in PyTorch (SGD, lr 0.1) on the same
    batches; the losses must agree at every step. Returns the RaNNCModule and the copy."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(steps):
        batch = models.mlp_batch(step)
        loss = rmod(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss.detach(), ref_loss.detach(), f"loss of step {step}")
    return rmod, ref


def test_partition_num_gives_that_many_stages(monkeypatch, tmp_path):
    monkeypatch.setenv("RANNC_PARTITION_NUM", "2")
    torch.manual_seed(0)
    rmod, _ = _train_beside_pytorch(MLP3())
    d = rmod.deployment
    assert len(d.stages) == 2
    _check_covers(d)
    path = tmp_path / "two_stages.deployment"
    rmod.save_deployment(path)
    text = pyrannc.show_deployment(path, d.batch_size or 16)
    assert "Stage 1: nodes [" in text


def test_schedule_config_reaches_the_plan(monkeypatch):
    monkeypatch.setenv("RANNC_SCHEDULE", "gpipe")
    rmod, opt = _module()
    _train_losses(rmod, opt, steps=1)
    assert rmod.deployment.schedule == dpb.SCHEDULE_GPIPE


def test_deployment_survives_clear(tmp_path):
    rmod, opt = _module()
    _train_losses(rmod, opt, steps=1)
    planned = rmod.deployment
    pyrannc.clear()
    # The job is gone; its plan can still be saved.
    rmod.save_deployment(tmp_path / "after_clear.deployment")
    saved = dpb.Deployment.FromString((tmp_path / "after_clear.deployment").read_bytes())
    assert saved.HasField("saved_trace")
    saved.ClearField("saved_trace")
    assert saved == planned


def test_trace_batch_traces_a_few_samples_and_plans_the_whole_batch(monkeypatch, tmp_path):
    """RANNC_TRACE_BATCH=2: the model is traced (and the daemon builds its IR) on 2 samples of
    the first batch of 16, the plan is for 16, and training equals PyTorch's on whole batches;
    the deployment saved from it loads into a job traced the same way."""
    monkeypatch.setenv("RANNC_TRACE_BATCH", "2")
    monkeypatch.setenv("RANNC_PARTITION_NUM", "2")

    class Recording(MLP3):
        traced_batches = []

        def forward(self, x, y):
            if torch.jit.is_tracing():
                Recording.traced_batches.append(x.shape[0])
            return super().forward(x, y)

    torch.manual_seed(0)
    rmod, ref = _train_beside_pytorch(Recording())
    ours = rmod.state_dict()
    for name, value in ref.state_dict().items():
        assert_close(ours[name], value, f"{name} after 2 steps")
    assert Recording.traced_batches == [2]
    d = rmod.deployment
    assert d.batch_size == 16
    assert len(d.stages) == 2
    path = tmp_path / "traced_on_two.deployment"
    rmod.save_deployment(path)

    torch.manual_seed(0)
    again = Recording()
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1)
    loaded = pyrannc.RaNNCModule(again, again_opt, load_deployment=str(path))
    loss = loaded(*models.mlp_batch(0))
    # The saved trace of 2 samples is reused: the model is not traced again.
    assert Recording.traced_batches == [2]
    assert loaded.deployment.loaded
    assert loaded.deployment.batch_size == 16
    assert torch.isfinite(loss).all()
