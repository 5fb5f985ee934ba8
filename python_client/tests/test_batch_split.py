"""Differential test: splitting the batch never changes the result.

Models assembled at random from a library of layers (split_models.py: convolutions, norms of
every kind in both modes, attention, embeddings, in-place activations, pooling,
squeeze-excitation, reductions, and layers that mix samples on purpose; losses with and without
ignore_index) run through ranncd on the daemon's devices (RANNC_DEVICES: the Bazel targets run
cpu:1, cpu:2 and cpu:4), each under the planner's own plan and under a forced one that splits
the batch (micro-batches, replicas, stages; seeded), against one-device PyTorch:

  - whatever the plan, losses, gradients and parameters after two SGD steps equal PyTorch's
    (rtol 1e-5, atol 1e-6);
  - a model whose samples interact (by construction: a layer that mixes them was drawn) is
    planned with its batch whole, and the plan says why (Deployment.batch_whole); a forced plan
    that would split its batch is refused with that reason;
  - a model whose samples do not interact is split when asked (forced plans), and its plan does
    not claim otherwise: the rules that keep a batch whole must not miss the library's layers.

RANNC_SPLIT_SEED (default 0) and RANNC_SPLIT_MODELS (default 60) pick the seeds; a failure names
its seed and model, and `RANNC_SPLIT_SEED=<seed> RANNC_SPLIT_MODELS=1` runs that case alone.
"""

import os

import pytest
import torch

import pyrannc
from pyrannc.errors import RanncError
from conftest import assert_close, daemon_device_names
import split_models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

FIRST = int(os.environ.get("RANNC_SPLIT_SEED", "0"))
COUNT = int(os.environ.get("RANNC_SPLIT_MODELS", "60"))
STEPS = 2
PLAN_KEYS = ("RANNC_PARTITION_NUM", "RANNC_PIPELINE_NUM", "RANNC_REPLICA_NUM")


def _forced_plan(seed, devices):
    """A plan that splits the batch, on `devices` devices: (partition, pipeline, replica)."""
    options = {
        1: [(1, 2, 1), (1, 3, 1), (1, 4, 1)],
        2: [(1, 1, 2), (1, 2, 2), (2, 2, 1), (2, 3, 1)],
        4: [(1, 1, 4), (2, 2, 2), (1, 3, 2), (2, 1, 2), (4, 2, 1)],
    }[devices]
    return options[seed % len(options)]


def _set_plan(monkeypatch, plan):
    for key in PLAN_KEYS:
        monkeypatch.delenv(key, raising=False)
    if plan is not None:
        for key, value in zip(PLAN_KEYS, plan):
            monkeypatch.setenv(key, str(value))


def _plan_text(d):
    stages = ", ".join(f"nodes [{s.first_node}, {s.end_node}) on {list(s.devices)}"
                       for s in sorted(d.stages, key=lambda s: s.index))
    whole = f"; batch kept whole: {d.batch_whole}" if d.batch_whole else ""
    return f"plan: {d.micro_batches} micro-batch(es), {stages}{whole}"


def _train_and_compare(case, what):
    """Trains the case's model through pyrannc and PyTorch side by side; returns the
    RaNNCModule's deployment."""
    torch.manual_seed(case.seed)
    model = case.model
    ref = split_models.copy_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt)
    try:
        for step in range(STEPS):
            batch = case.make_batch(step)
            loss = rmod(*batch)
            loss.backward()
            if step == 0:
                what = f"{what} ({_plan_text(rmod.deployment)})"
            ref_loss = ref(*batch)
            ref_loss.backward()
            assert_close(loss.detach(), ref_loss.detach(), f"{what}: loss at step {step}")
            for name, p in ref.named_parameters():
                got = rmod.get_param_grad(name)
                if p.grad is None:
                    continue
                assert got is not None, f"{what}: {name} has no gradient at step {step}"
                assert_close(got, p.grad, f"{what}: grad of {name} at step {step}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        ours, theirs = rmod.state_dict(), ref.state_dict()
        for name, value in theirs.items():
            assert_close(ours[name], value, f"{what}: {name} after {STEPS} steps")
        return rmod.deployment
    finally:
        pyrannc.clear()


@pytest.mark.parametrize("seed", range(FIRST, FIRST + COUNT))
def test_split_equals_one_device(seed, monkeypatch):
    devices = len(daemon_device_names())
    case = split_models.random_case(seed)
    what = f"{case.describe()} on {devices} device(s)"
    rerun = f"(rerun: RANNC_SPLIT_SEED={seed} RANNC_SPLIT_MODELS=1 RANNC_DEVICES=cpu:{devices})"

    # The planner's own plan.
    _set_plan(monkeypatch, None)
    deployment = _train_and_compare(split_models.random_case(seed), f"{what}, default plan")
    if case.mixes_samples:
        assert deployment.batch_whole, f"{what}: the batch was not kept whole {rerun}"
        assert deployment.micro_batches == 1, what
        assert all(len(s.devices) == 1 for s in deployment.stages), what
    else:
        assert not deployment.batch_whole, (
            f"{what}: kept whole, but its samples are independent: {deployment.batch_whole} "
            f"{rerun}")

    # A forced plan that splits the batch.
    plan = _forced_plan(seed, devices)
    _set_plan(monkeypatch, plan)
    forced = f"{what}, forced plan {plan}"
    if case.mixes_samples:
        with pytest.raises(RanncError, match="splitting it would change the results"):
            _train_and_compare(split_models.random_case(seed), forced)
        return
    try:
        deployment = _train_and_compare(split_models.random_case(seed), forced)
    except RanncError as e:
        # A model with fewer atomic nodes than the forced stages keeps its batch split over
        # fewer stages.
        if "atomic nodes to split between stages" not in str(e):
            raise
        _set_plan(monkeypatch, (1,) + plan[1:])
        deployment = _train_and_compare(split_models.random_case(seed), forced + " in 1 stage")
    assert deployment.micro_batches == plan[1] or case.batch < plan[1] * plan[2], forced


@pytest.mark.parametrize("layer", ["numbered_mask_attention", "numbered_other_rows"])
def test_samples_numbered_with_arange(layer, monkeypatch):
    # torch.arange(batch) picking each sample's own row (Hugging Face's attention masks) splits
    # exactly; picking another sample's row keeps the batch whole.
    devices = len(daemon_device_names())
    make = lambda: split_models.token_case(5, [layer, "mlp"], "ce_ignore", 8)
    case = make()
    what = f"{case.describe()} on {devices} device(s)"
    plan = _forced_plan(1, devices)
    _set_plan(monkeypatch, plan)
    if case.mixes_samples:
        with pytest.raises(RanncError, match="samples' numbers.*splitting it would change"):
            _train_and_compare(make(), f"{what}, forced plan {plan}")
        _set_plan(monkeypatch, None)
        deployment = _train_and_compare(make(), f"{what}, default plan")
        assert "samples' numbers" in deployment.batch_whole, deployment.batch_whole
        return
    deployment = _train_and_compare(make(), f"{what}, forced plan {plan}")
    assert not deployment.batch_whole, deployment.batch_whole
    assert deployment.micro_batches * len(deployment.stages[0].devices) > 1, _plan_text(
        deployment)
