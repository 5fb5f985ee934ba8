"""optimizer.state_dict() and load_state_dict() through pyrannc, in PyTorch's own format.

The daemon of this suite has four devices (RANNC_DEVICES=cpu:4, set by the Bazel target) and
every job is forced to 2 stages x 2 micro-batches x 2 replicas, plain, with ZeRO or with
offload. A run saves its optimizer's state mid-way with torch.save and goes on from it in a new
module (loaded before the first forward), in plain torch.optim, and from plain torch.optim's
state loaded after the first forward; every continuation equals an uninterrupted PyTorch run
(conftest.assert_close: rtol 1e-5 / atol 1e-6).
"""

import copy
import io

import grpc
import pytest
import torch

import pyrannc
from conftest import assert_close, ref_copy, to_ref
from test_pipeline_conformance import MODELS, _set_plan_config

pytestmark = pytest.mark.usefixtures("pyrannc_daemon", "four_devices")

PLAN = (2, 2, 2)  # partition_num, pipeline_num (micro-batches), replica_num
OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1,
                                         amsgrad=True),
    # Not with momentum: its buffer holds grad / sqrt(square_avg), which turns the round-off of
    # gradients that nearly cancel (summed in another order over micro-batches and replicas)
    # into differences far above fp32's; test_conformance runs every option on one device.
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1,
                                             initial_accumulator_value=0.1),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=0.02),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "asgd": lambda m: torch.optim.ASGD(m.parameters(), lr=0.01, t0=1),
    "rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=0.01),
}
LAYOUTS = {"": {}, "zero": {"enable_zero": True}, "offload": {"offload_params": True}}
CASE = MODELS["mlp"]


@pytest.fixture
def clean():
    yield
    pyrannc.clear()


def _train(module, opt, steps, first):
    for step in range(first, first + steps):
        batch = CASE.batch(step)
        if not isinstance(module, pyrannc.RaNNCModule):
            batch = to_ref(batch)
        loss = CASE.loss(module, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _check_state(actual, expected, what):
    assert sorted(actual["state"]) == sorted(expected["state"]), what
    for index, entries in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(entries), f"{what}: param {index}"
        for key, value in entries.items():
            got = actual["state"][index][key]
            if not isinstance(value, torch.Tensor):  # PyTorch 1.x's int steps (RMSprop, ...)
                assert type(got) is type(value) and got == value, f"{what}: {index}.{key}"
                continue
            assert_close(got.cpu(), value, f"{what}: {index}.{key}")
    assert [g["params"] for g in actual["param_groups"]] == \
        [g["params"] for g in expected["param_groups"]], what


def _check_params(module, ref, what):
    for name, value in module.state_dict().items():
        assert_close(value, ref.state_dict()[name], f"{what}: {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_saved_state_resumes_in_a_new_module_and_in_torch_optim(optimizer, layout,
                                                                monkeypatch, clean):
    _set_plan_config(monkeypatch, PLAN, "1f1b")
    torch.manual_seed(0)
    model = CASE.make()
    ref = ref_copy(model)
    opt, ref_opt = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](ref)
    rmod = pyrannc.RaNNCModule(model, opt, **LAYOUTS[layout])
    # Before the first forward: torch.optim's own (empty, but Adagrad's made at construction).
    _check_state(opt.state_dict(), ref_opt.state_dict(), "before the first forward")
    _train(rmod, opt, 2, 0)
    _train(ref, ref_opt, 2, 0)
    saved = io.BytesIO()
    # RaNNC's keyword is accepted.
    torch.save({"model": rmod.state_dict(), "optimizer": opt.state_dict(from_global=True)},
               saved)
    _check_state(opt.state_dict(), ref_opt.state_dict(), "after 2 steps")
    # Each reader gets its own copy: PyTorch 2's load_state_dict keeps the very tensors it is
    # given where their device and dtype already fit, and training then changes them in place.
    def load():
        return torch.load(io.BytesIO(saved.getvalue()))

    # Into plain torch.optim: a fresh model and optimizer go on exactly as the uninterrupted
    # reference.
    checkpoint = load()
    plain = CASE.make()
    plain.load_state_dict(checkpoint["model"])
    plain = plain.to(next(ref.parameters()).device)
    plain_opt = OPTIMIZERS[optimizer](plain)
    plain_opt.load_state_dict(checkpoint["optimizer"])
    ref_end = copy.deepcopy(ref)
    ref_end_opt = OPTIMIZERS[optimizer](ref_end)
    ref_end_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _train(plain, plain_opt, 2, 2)
    _train(ref_end, ref_end_opt, 2, 2)
    for name, value in plain.state_dict().items():
        assert_close(value.cpu(), ref_end.state_dict()[name], f"torch.optim resumed: {name}")

    # Into a new pyrannc module, loaded before its first forward.
    checkpoint = load()
    pyrannc.clear()
    model2 = CASE.make()
    opt2 = OPTIMIZERS[optimizer](model2)
    rmod2 = pyrannc.RaNNCModule(model2, opt2, **LAYOUTS[layout])
    rmod2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    _train(rmod2, opt2, 2, 2)
    _check_params(rmod2, ref_end, "pyrannc resumed")
    _check_state(opt2.state_dict(), ref_end_opt.state_dict(), "pyrannc resumed")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_torch_optim_state_loads_after_the_first_forward(optimizer, monkeypatch, clean):
    _set_plan_config(monkeypatch, PLAN, "1f1b")
    torch.manual_seed(0)
    ref = ref_copy(CASE.make())
    ref_opt = OPTIMIZERS[optimizer](ref)
    _train(ref, ref_opt, 2, 0)

    model = CASE.make()
    opt = OPTIMIZERS[optimizer](model)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=True)
    with torch.no_grad():
        rmod(*CASE.batch(0))  # the job exists from here
    rmod.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _check_state(opt.state_dict(), ref_opt.state_dict(), "loaded")
    assert opt.state == {}  # the daemon holds it
    _train(rmod, opt, 2, 2)
    _train(ref, ref_opt, 2, 2)
    _check_params(rmod, ref, "after loading")


def test_bad_optimizer_state_is_refused_and_changes_nothing(monkeypatch, clean):
    _set_plan_config(monkeypatch, PLAN, "1f1b")
    torch.manual_seed(0)
    model = CASE.make()
    opt = OPTIMIZERS["sgd"](model)
    rmod = pyrannc.RaNNCModule(model, opt)
    _train(rmod, opt, 1, 0)
    before = opt.state_dict()
    bad = copy.deepcopy(before)
    first = next(iter(bad["state"]))
    bad["state"][first]["momentum_buffer"] = torch.zeros(3, 3)
    bad["param_groups"][0]["lr"] = 7.0
    with pytest.raises(pyrannc.RanncError) as err:
        opt.load_state_dict(bad)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "momentum_buffer" in str(err.value) and "shape [3, 3]" in str(err.value), err.value
    _check_state(opt.state_dict(), before, "unchanged")
    assert opt.param_groups[0]["lr"] == 0.1
    # A key this optimizer does not keep.
    worse = copy.deepcopy(before)
    worse["state"][first]["exp_avg"] = worse["state"][first].pop("momentum_buffer")
    with pytest.raises(pyrannc.RanncError) as err:
        opt.load_state_dict(worse)
    assert "this optimizer keeps momentum_buffer" in str(err.value), err.value
    _check_state(opt.state_dict(), before, "unchanged")
