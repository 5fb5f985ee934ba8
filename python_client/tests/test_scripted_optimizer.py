"""An optimizer torch.optim does not have, run by ranncd: Lion (Chen et al., "Symbolic Discovery
of Optimization Algorithms", 2023) registered with pyrannc.register_optimizer as a TorchScript
update, against the same Lion written here as a plain torch.optim.Optimizer.

The daemon of this suite has four devices (RANNC_DEVICES=cpu:4, set by the Bazel target). Runs
on one device and on forced 2 stages x 2 micro-batches x 2 replicas, plain, with ZeRO (shards
stepped on their own) and with offload, train as the plain Lion does; optimizer.state_dict()
moves between them both ways. Tolerance: conftest.assert_close (rtol 1e-5 / atol 1e-6).
"""

import io
from typing import Dict

import grpc
import pytest
import torch

import pyrannc
from pyrannc.errors import RanncError
from conftest import assert_close, ref_copy, to_ref
from test_pipeline_conformance import MODELS, _set_plan_config

pytestmark = pytest.mark.usefixtures("pyrannc_daemon", "four_devices")

CASE = MODELS["mlp"]
STEPS = 5


class Lion(torch.optim.Optimizer):
    """Lion as its authors' pseudo-code has it, in plain PyTorch: the reference."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def lion_update(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
                group: Dict[str, float]) -> None:
    exp_avg = state["exp_avg"]
    beta1 = group["betas_0"]
    beta2 = group["betas_1"]
    param.mul_(1 - group["lr"] * group["weight_decay"])
    update = exp_avg.mul(beta1).add(grad, alpha=1 - beta1).sign_()
    param.add_(update, alpha=-group["lr"])
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


pyrannc.register_optimizer(Lion, lion_update, state=["exp_avg"])


def _lion(model):
    # Two groups, one with its own betas and weight decay.
    first = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return Lion([{"params": first, "weight_decay": 0.1, "betas": (0.8, 0.95)},
                 {"params": rest}], lr=3e-3)


@pytest.fixture
def clean():
    yield
    pyrannc.clear()


def _train(module, opt, first, steps, scheduler=None):
    for step in range(first, first + steps):
        batch = CASE.batch(step)
        if not isinstance(module, pyrannc.RaNNCModule):
            batch = to_ref(batch)
        loss = CASE.loss(module, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return loss.detach()


LAYOUTS = {"one device": (None, {}),
           "2x2x2": ((2, 2, 2), {}),
           "2x2x2 zero": ((2, 2, 2), {"enable_zero": True}),
           "2x2x2 offload": ((2, 2, 2), {"offload_params": True})}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lion_trains_as_plain_lion(layout, monkeypatch, clean):
    plan, switches = LAYOUTS[layout]
    _set_plan_config(monkeypatch, plan if plan is not None else (1, 1, 1), "1f1b")
    torch.manual_seed(0)
    model = CASE.make()
    ref = ref_copy(model)
    opt, ref_opt = _lion(model), _lion(ref)
    rmod = pyrannc.RaNNCModule(model, opt, **switches)
    # An lr schedule: each step sends the groups as they are then.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        loss = _train(rmod, opt, step, 1, sched)
        ref_loss = _train(ref, ref_opt, step, 1, ref_sched)
        assert_close(loss, ref_loss, f"loss at step {step}")
        for name, value in ref.state_dict().items():
            assert_close(rmod.state_dict()[name], value, f"{name} after step {step}")
    if plan is not None:
        assert [len(s.devices) for s in rmod.deployment.stages] == [2, 2]
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert sorted(state["state"]) == sorted(ref_state["state"])
    for index, entries in ref_state["state"].items():
        assert list(state["state"][index]) == ["exp_avg"]
        assert_close(state["state"][index]["exp_avg"].cpu(), entries["exp_avg"],
                     f"exp_avg of param {index}")


def test_lion_state_moves_between_pyrannc_and_plain_lion(monkeypatch, clean):
    _set_plan_config(monkeypatch, (2, 2, 2), "1f1b")
    torch.manual_seed(0)
    model = CASE.make()
    ref = ref_copy(model)
    opt, ref_opt = _lion(model), _lion(ref)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=True)
    _train(rmod, opt, 0, 2)
    _train(ref, ref_opt, 0, 2)
    saved = io.BytesIO()
    torch.save({"model": rmod.state_dict(), "optimizer": opt.state_dict()}, saved)

    # pyrannc's state into the plain Lion, which goes on as the uninterrupted reference.
    checkpoint = torch.load(io.BytesIO(saved.getvalue()))
    plain = ref_copy(CASE.make())
    plain.load_state_dict(checkpoint["model"])
    plain_opt = _lion(plain)
    plain_opt.load_state_dict(checkpoint["optimizer"])
    _train(plain, plain_opt, 2, 2)

    # The plain Lion's state into a new pyrannc module, after its first forward.
    pyrannc.clear()
    model2 = CASE.make()
    model2.load_state_dict(ref.state_dict())
    opt2 = _lion(model2)
    rmod2 = pyrannc.RaNNCModule(model2, opt2)
    loss = CASE.loss(rmod2, CASE.batch(2))
    opt2.load_state_dict(ref_opt.state_dict())
    loss.backward()
    opt2.step()
    opt2.zero_grad()
    _train(rmod2, opt2, 3, 1)

    _train(ref, ref_opt, 2, 2)
    for name, value in ref.state_dict().items():
        assert_close(plain.state_dict()[name].cpu(), value, f"plain Lion resumed: {name}")
        assert_close(rmod2.state_dict()[name], value, f"pyrannc resumed: {name}")


def test_an_update_that_fails_names_the_cause(clean):
    class Broken(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

    def needs_momentum(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
                       group: Dict[str, float]) -> None:
        param.add_(grad, alpha=-group["momentum"])

    pyrannc.register_optimizer(Broken, needs_momentum)
    torch.manual_seed(0)
    model = CASE.make()
    opt = Broken(model.parameters())
    rmod = pyrannc.RaNNCModule(model, opt)
    CASE.loss(rmod, CASE.batch(0)).backward()
    with pytest.raises(RanncError, match="momentum") as raised:
        opt.step()
        rmod.state_dict()  # the step is sent with the next call
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_register_optimizer_refuses_what_it_cannot_run():
    class Mine(torch.optim.Optimizer):
        pass

    def untyped(param, grad, state, group):
        param.add_(grad * state["x"])  # `state` is a Tensor to TorchScript without annotations

    with pytest.raises(TypeError, match="register_optimizer\\(.*Mine\\)"):
        pyrannc.register_optimizer(Mine, untyped)
    with pytest.raises(ValueError, match="already runs in the daemon"):
        pyrannc.register_optimizer(torch.optim.Adam, lion_update)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        pyrannc.register_optimizer(object, lion_update)
    with pytest.raises(ValueError, match="listed twice"):
        pyrannc.register_optimizer(Mine, lion_update, state=["m", "m"])
