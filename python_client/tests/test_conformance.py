"""Conformance: pyrannc through the real ranncd gives plain PyTorch's results.

Each test builds a model with a fixed seed, deep-copies it as the PyTorch reference, and trains
both for several steps on the same batches (dropout off). After every backward it compares the
loss and every parameter's gradient (get_param_grad, by every name including tied aliases);
after every step it compares every parameter and buffer (state_dict, which pulls from the
daemon). Tolerance everywhere: torch.testing.assert_close(rtol=1e-5, atol=1e-6).

The reference runs on RANNC_TEST_REF_DEVICE (default cpu; "cuda" against a daemon on CUDA
devices, see conftest): model, optimizer and batches there, its values compared on the CPU.
"""

import pytest
import torch
import torch.nn.functional as F

import pyrannc
from conftest import assert_close, ref_copy, to_ref
import models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")


def _compare_grads(rmod, ref, step):
    for name, p in ref.named_parameters():
        got = rmod.get_param_grad(name)
        if p.grad is None:
            assert got is None, f"{name} has a gradient in ranncd but not in PyTorch"
        else:
            assert got is not None, f"{name} has no gradient in ranncd at step {step}"
            assert_close(got, p.grad, f"grad of {name} at step {step}")


def _compare_state(rmod, ref, step):
    ours = rmod.state_dict()
    theirs = ref.state_dict()
    assert list(ours.keys()) == list(theirs.keys())
    for name, value in theirs.items():
        assert_close(ours[name], value, f"{name} after step {step}")


def train_both(model_fn, opt_fn, batch_fn, loss_fn, steps=4, after_step=None, seed=0):
    """Trains pyrannc and PyTorch side by side, comparing as the module docstring says."""
    torch.manual_seed(seed)
    model = model_fn()
    ref = ref_copy(model)
    opt, ref_opt = opt_fn(model), opt_fn(ref)
    local_params = list(model.parameters())
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(steps):
        batch = batch_fn(step)
        loss = loss_fn(rmod, batch)
        loss.backward()
        ref_loss = loss_fn(ref, to_ref(batch))
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
        _compare_grads(rmod, ref, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if after_step is not None:
            after_step(step, opt, ref_opt)
        _compare_state(rmod, ref, step)
    # The local tensors are refreshed in place: references taken before training still work.
    synced = list(rmod.parameters())
    assert all(a is b for a, b in zip(local_params, synced))
    for (name, p), q in zip(ref.named_parameters(), synced):
        assert_close(q.detach(), p.detach(), f"local copy of {name}")
    return rmod, ref


def _model_loss(m, batch):
    return m(*batch)


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum_dampening_wd": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov_wd": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
    "sgd_maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam_wd_amsgrad": lambda m: torch.optim.Adam(
        m.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    # The other torch.optim optimizers with per-parameter state, each option away from its
    # default at least once; 8 steps (RAdam rectifies from its 6th, ASGD averages from t0).
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    "rmsprop_centered_momentum_wd": lambda m: torch.optim.RMSprop(
        m.parameters(), lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5,
        centered=True),
    "rmsprop_maximize": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, maximize=True),
    "adagrad": lambda m: torch.optim.Adagrad(
        m.parameters(), lr=0.1, lr_decay=0.01, weight_decay=0.01,
        initial_accumulator_value=0.1, eps=1e-8),
    "adamax": lambda m: torch.optim.Adamax(
        m.parameters(), lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
    "nadam": lambda m: torch.optim.NAdam(
        m.parameters(), lr=0.01, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.01,
        momentum_decay=0.005),
    "radam": lambda m: torch.optim.RAdam(
        m.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01),
    "adadelta": lambda m: torch.optim.Adadelta(
        m.parameters(), lr=1.0, rho=0.8, eps=1e-5, weight_decay=0.01),
    "adadelta_maximize": lambda m: torch.optim.Adadelta(m.parameters(), maximize=True),
    "asgd": lambda m: torch.optim.ASGD(
        m.parameters(), lr=0.01, lambd=1e-3, alpha=0.7, t0=3, weight_decay=0.01),
    "rprop": lambda m: torch.optim.Rprop(
        m.parameters(), lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)),
    "rprop_maximize": lambda m: torch.optim.Rprop(m.parameters(), lr=0.01, maximize=True),
}
_CLASSIC = ("sgd", "adam")  # SGD, Adam and AdamW were first: 4 steps show them


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_mlp_optimizers(opt_name):
    steps = 4 if opt_name.startswith(_CLASSIC) else 8
    train_both(models.MLP, OPTIMIZERS[opt_name], models.mlp_batch, _model_loss, steps=steps)


@pytest.mark.parametrize("kind", ["rmsprop", "adagrad", "nadam", "asgd", "rprop"])
def test_new_optimizers_with_param_groups_and_a_scheduler(kind):
    # Two param groups with different hyper-parameters, and an lr schedule: each step's
    # hyper-parameters come from the client's param_groups, as for SGD and Adam.
    cls = {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad,
           "nadam": torch.optim.NAdam, "asgd": torch.optim.ASGD, "rprop": torch.optim.Rprop}[kind]
    # Adagrad's group also sets its own initial_accumulator_value, which PyTorch 1.13 ignores
    # (the constructor's fills every sum, in __init__) and 2.x takes: the client's optimizer's
    # state goes to the daemon with the job, so the daemon starts from the client's sums.
    other = {"rmsprop": {"momentum": 0.9, "alpha": 0.95},
             "adagrad": {"lr_decay": 0.1, "initial_accumulator_value": 0.3},
             "nadam": {"betas": (0.5, 0.9)}, "asgd": {"t0": 2, "lambd": 0.01},
             "rprop": {"etas": (0.3, 1.5)}}[kind]
    schedulers = []

    def opt_fn(m):
        opt = cls([{"params": [m.l1.weight], "lr": 0.03, **other},
                   {"params": [m.l1.bias, m.l2.weight, m.l2.bias]}], lr=0.01)
        schedulers.append(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        return opt

    def after_step(step, opt, ref_opt):
        for s in schedulers:
            s.step()

    train_both(models.MLP, opt_fn, models.mlp_batch, _model_loss, steps=6,
               after_step=after_step)


def test_gpt_tied_embedding(monkeypatch):
    # One device, one micro-batch, exact AdamW. The model has no qkv bias: the key bias's true
    # gradient is zero, and AdamW turns whatever round-off stands in for it into lr-sized steps,
    # so it would only match where every fp32 reduction runs in the same order (the CPU here;
    # not CUDA's kernels against eager PyTorch's, nor micro-batches or replicas, nor DDP).
    # test_pipeline_conformance covers the biased GPT across devices with SGD.
    for key in ("PARTITION_NUM", "PIPELINE_NUM", "REPLICA_NUM"):
        monkeypatch.setenv(f"RANNC_{key}", "1")
    rmod, ref = train_both(lambda: models.TinyGPT(qkv_bias=False),
                           lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
                           models.gpt_batch, _model_loss)
    # The tied weight answers to both of its names, with one value.
    assert_close(rmod.get_param("head.weight"), ref.tok.weight.detach(), "head.weight")
    assert_close(rmod.get_param("tok.weight"), ref.tok.weight.detach(), "tok.weight")
    sd = rmod.state_dict()
    assert "head.weight" in sd and "tok.weight" in sd


def test_cnn_batchnorm_buffers():
    def loss_fn(m, batch):
        x, y = batch
        return F.cross_entropy(m(x), y)

    rmod, ref = train_both(models.CNN,
                           lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                           models.cnn_batch, loss_fn)
    buffers = dict(rmod.named_buffers())
    for name, b in ref.named_buffers():
        assert_close(buffers[name], b, name)
    assert int(buffers["bn1.num_batches_tracked"]) == 4


def test_caller_computed_loss_from_structured_outputs():
    def loss_fn(m, batch):
        x, y = batch
        out = m(x)
        assert isinstance(out, dict) and set(out) == {"logits", "aux", "pred"}
        h, nothing = out["aux"]
        assert nothing is None
        assert out["pred"].dtype == torch.int64 and not out["pred"].requires_grad
        return F.cross_entropy(out["logits"], y) + 0.1 * h.pow(2).mean()

    train_both(models.MultiOutput, lambda m: torch.optim.Adam(m.parameters(), lr=0.02),
               models.multi_batch, loss_fn)


def test_two_inputs_shared_parameter():
    def loss_fn(m, batch):
        a, b, y = batch
        return F.mse_loss(m(a, b), y)

    train_both(models.TwoInputs,
               lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5),
               models.two_inputs_batch, loss_fn)


def test_param_groups_with_different_lrs():
    def groups(m):
        return torch.optim.SGD([
            {"params": m.l1.parameters(), "lr": 0.2, "momentum": 0.9},
            {"params": m.l2.parameters()},
        ], lr=0.01, weight_decay=0.001)

    train_both(models.MLP, groups, models.mlp_batch, _model_loss)


def test_adam_param_groups():
    def groups(m):
        return torch.optim.Adam([
            {"params": [m.l1.weight], "lr": 0.03, "weight_decay": 0.1},
            {"params": [m.l1.bias, m.l2.weight, m.l2.bias], "betas": (0.5, 0.9)},
        ], lr=0.005)

    train_both(models.MLP, groups, models.mlp_batch, _model_loss)


def test_step_lr_scheduler_created_before_wrapping():
    schedulers = []

    def opt_fn(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
        # For pyrannc's optimizer this runs before RaNNCModule patches step(): the scheduler's
        # step counter must survive the patch.
        schedulers.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        return opt

    def after_step(step, opt, ref_opt):
        for s in schedulers:
            s.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        # PyTorch 1.x counts steps in _step_count; 2.x has none (it tracks _opt_called).
        assert getattr(opt, "_step_count", None) == getattr(ref_opt, "_step_count", None)

    train_both(models.MLP, opt_fn, models.mlp_batch, _model_loss, steps=5, after_step=after_step)
    assert schedulers[0].get_last_lr()[0] == pytest.approx(0.2 / 32)


def test_scheduler_created_after_wrapping():
    torch.manual_seed(0)
    model = models.MLP()
    ref = ref_copy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    rmod = pyrannc.RaNNCModule(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    for step in range(5):
        batch = models.mlp_batch(step)
        loss = rmod(*batch)
        loss.backward()
        ref_loss = ref(*to_ref(batch))
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
        opt.step()
        ref_opt.step()
        rmod.zero_grad()
        ref_opt.zero_grad()
        sched.step()
        ref_sched.step()
        # PyTorch 1.x counts steps in _step_count; 2.x has none (it tracks _opt_called).
        assert getattr(opt, "_step_count", None) == getattr(ref_opt, "_step_count", None)
    _compare_state(rmod, ref, 5)


def test_manual_lr_change_between_steps():
    def after_step(step, opt, ref_opt):
        for o in (opt, ref_opt):
            for g in o.param_groups:
                g["lr"] = 0.5 if step % 2 == 0 else 0.01

    train_both(models.MLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), models.mlp_batch,
               _model_loss, steps=4, after_step=after_step)


def test_set_to_none_zero_grad_matches():
    torch.manual_seed(0)
    model = models.MLP()
    ref = ref_copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    batch = models.mlp_batch(0)
    rmod(*batch).backward()
    opt.zero_grad(set_to_none=True)
    for name, _ in ref.named_parameters():
        assert rmod.get_param_grad(name) is None
    rmod(*batch).backward()
    ref(*to_ref(batch)).backward()
    opt.zero_grad(set_to_none=False)
    for name, _ in ref.named_parameters():
        g = rmod.get_param_grad(name)
        assert g is not None and torch.count_nonzero(g) == 0


def test_frozen_parameters_stay_put():
    def model_fn():
        m = models.MLP()
        m.l1.weight.requires_grad_(False)
        return m

    rmod, ref = train_both(model_fn, lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                               weight_decay=0.1),
                           models.mlp_batch, _model_loss)
    assert rmod.get_param_grad("l1.weight") is None


def test_batch_size_changes_between_steps():
    sizes = [16, 5, 16, 1]

    def batch_fn(step):
        return models.mlp_batch(step, batch=sizes[step])

    train_both(models.MLP, OPTIMIZERS["adam"], batch_fn, _model_loss, steps=len(sizes))


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening_wd", "adamw"])
def test_unbatched_calls_match(opt_name, monkeypatch):
    """RANNC_DEFER_OPS=0: backward, step and zero_grad each go at once, with the same result."""
    monkeypatch.setenv("RANNC_DEFER_OPS", "0")
    train_both(models.MLP, OPTIMIZERS[opt_name], models.mlp_batch, _model_loss)
