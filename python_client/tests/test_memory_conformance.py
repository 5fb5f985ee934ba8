"""RaNNCModule's memory switches (the memory and precision issue) against PyTorch on cpu:4,
with forced plans that have replicas.

enable_zero=True: gradients and optimizer state sharded over each stage's replicas. The runtime
issue's four conformance models (test_pipeline_conformance.MODELS: SGD with momentum or Adam)
must train exactly as PyTorch does (conftest.assert_close: rtol 1e-5, atol 1e-6): losses and
every gradient after each backward, clip_grad_norm, an undeploy with the sharded optimizer
state parked on the host in between, and the state after the last step. The devices must hold
the sharded share of gradients and optimizer state.
"""

import copy

import pytest
import torch

import pyrannc
from pyrannc import _daemon
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from conftest import assert_close
import models
import test_pipeline_conformance as tpc

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

# (partition_num, pipeline_num, replica_num): one stage on all four devices, and 2 stages x 2
# micro-batches x 2 replicas.
PLANS = {"1x1x4": (1, 1, 4), "2x2x2": (2, 2, 2)}


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(tpc.MODELS))
def test_zero_trains_like_pytorch(model_name, plan_name, monkeypatch):
    case = tpc.MODELS[model_name]
    tpc._set_plan_config(monkeypatch, PLANS[plan_name], "1f1b")
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=True)
    try:
        for step in range(tpc.STEPS):
            batch = case.batch(step)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, batch)
            ref_loss.backward()
            if step == 0:
                assert rmod.deployment.zero
                replicas = [len(s.devices) for s in rmod.deployment.stages]
                assert replicas == [PLANS[plan_name][2]] * PLANS[plan_name][0], replicas
            assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
            if step == 1:
                norm = rmod.clip_grad_norm(0.5)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                assert_close(norm, ref_norm, "clip_grad_norm's total norm")
            tpc._compare_grads(rmod, ref, step)
            if step == 2:
                rmod.undeploy()  # the shards' optimizer state goes to the host and comes back
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for name, value in ref.state_dict().items():
            assert_close(rmod.state_dict()[name], value, f"{name} after {tpc.STEPS} steps")
    finally:
        pyrannc.clear()


def _device_bytes(job_id):
    jobs = _daemon.connection().call("ListJobs", pb.Empty()).jobs
    return list(next(j for j in jobs if j.job_id == job_id).device_bytes)


@pytest.mark.parametrize("zero", [False, True])
def test_zero_devices_hold_a_replicas_share(zero, monkeypatch):
    # Adam over 4 replicas of one stage: each device holds the parameters (P bytes), and the
    # gradients (P) and two moments (2P) whole, or a quarter of them with ZeRO (plus padding
    # of fewer than 4 elements per tensor group).
    tpc._set_plan_config(monkeypatch, (1, 1, 4), "1f1b")
    monkeypatch.setenv("RANNC_DEFER_OPS", "0")  # backward and step run before ListJobs
    torch.manual_seed(0)
    model = tpc.DeepMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=zero)
    try:
        x, y = tpc._classification_batch(0, 8, 4)
        rmod(x, y).backward()
        opt.step()
        p = sum(t.numel() * t.element_size() for t in model.parameters())
        expected = p * (1 + 3 / 4) if zero else p * 4
        got = _device_bytes(rmod._job.id)
        assert len(got) == 4
        for b in got:
            assert abs(b - expected) <= 0.02 * expected, (got, expected)
    finally:
        pyrannc.clear()
