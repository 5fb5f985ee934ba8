"""Gradient accumulation (delay_grad_allreduce + allreduce_grads) and keep_graph on a plan with
data-parallel replicas, against plain PyTorch.

The daemon of this suite has four devices (RANNC_DEVICES=cpu:4, set by the Bazel target; on a GPU
machine e.g. cuda:0,1,2,3: with any other number every test fails at setup saying so) and every
job is forced to 2 stages x 2 micro-batches x 2 replicas, so each backward's gradients are
split over two replicas per stage: with delay_grad_allreduce(True) they stay on their replica
until allreduce_grads(). The models are test_pipeline_conformance's: an MLP and a GPT with a tied
embedding, whose loss the daemon differentiates during the forward (fused), and a net returning
logits, whose backward waits for the client's gradients. Tolerance: conftest.assert_close
(rtol 1e-5 / atol 1e-6). The PyTorch reference runs on RANNC_TEST_REF_DEVICE (see conftest):
model, optimizer and batches there, its values compared on the CPU.
"""

import grpc
import pytest
import torch

import pyrannc
from conftest import assert_close, ref_copy, to_ref
from test_pipeline_conformance import MODELS, _compare_grads, _set_plan_config

pytestmark = pytest.mark.usefixtures("pyrannc_daemon", "four_devices")

STEPS = 3
ACCUMULATE = 3
PLAN = (2, 2, 2)  # partition_num, pipeline_num (micro-batches), replica_num


@pytest.fixture
def flags():
    """Puts pyrannc's process-wide flags back, and deletes the test's jobs."""
    yield
    pyrannc.delay_grad_allreduce(False)
    pyrannc.keep_graph(False)
    pyrannc.clear()


def _modules(model_name, monkeypatch, zero=False, offload=False):
    case = MODELS[model_name]
    _set_plan_config(monkeypatch, PLAN, "1f1b")
    torch.manual_seed(0)
    model = case.make()
    ref = ref_copy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=zero, offload_params=offload)
    return case, rmod, opt, ref, ref_opt


def _check_replicated_plan(rmod):
    stages = rmod.deployment.stages
    assert [len(s.devices) for s in stages] == [PLAN[2]] * PLAN[0], rmod.deployment


# With enable_zero the sharded gradients are reduce-scattered after every backward anyway (the
# delay applies to the rest: tied parameters); accumulation must be just as exact. With
# offload_params the unreduced gradients wait in host memory.
@pytest.mark.parametrize("zero,offload", [(False, False), (True, False), (False, True)],
                         ids=["", "zero", "offload"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt_tied", "client_loss"])
def test_delayed_allreduce_accumulates_like_pytorch(model_name, zero, offload, monkeypatch,
                                                    flags):
    case, rmod, opt, ref, ref_opt = _modules(model_name, monkeypatch, zero, offload)
    pyrannc.delay_grad_allreduce(True)
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            batch = case.batch(10 * step + micro)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, to_ref(batch))
            ref_loss.backward()
            assert_close(loss.detach(), ref_loss.detach(), f"loss {micro} of step {step}")
        if step == 0:
            _check_replicated_plan(rmod)
        # Reading a gradient before allreduce_grads() gives the reduced one all the same.
        _compare_grads(rmod, ref, step)
        rmod.allreduce_grads()
        _compare_grads(rmod, ref, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours, theirs = rmod.state_dict(), ref.state_dict()
    for name, value in theirs.items():
        assert_close(ours[name], value, f"{name} after {STEPS} steps")


def test_step_before_allreduce_grads_is_refused(monkeypatch, flags):
    case, rmod, opt, ref, ref_opt = _modules("mlp", monkeypatch)
    pyrannc.delay_grad_allreduce(True)
    case.loss(rmod, case.batch(0)).backward()
    with pytest.raises(pyrannc.RanncError) as info:
        rmod.clip_grad_norm(1.0)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "allreduce_grads()" in str(info.value)
    opt.step()  # deferred: sent with the next call that reaches the daemon
    with pytest.raises(pyrannc.RanncError) as info:
        rmod.get_param("out.weight")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "allreduce_grads()" in str(info.value)
    # Nothing was lost: the gradients are still there to reduce, and the step then runs.
    ref_loss = case.loss(ref, to_ref(case.batch(0)))
    ref_loss.backward()
    rmod.allreduce_grads()
    _compare_grads(rmod, ref, 0)
    opt.step()
    ref_opt.step()
    for name, value in ref.state_dict().items():
        assert_close(rmod.state_dict()[name], value, name)


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("model_name", ["mlp", "client_loss"])
def test_keep_graph_second_backward_equals_retain_graph(model_name, delay, monkeypatch, flags):
    case, rmod, opt, ref, ref_opt = _modules(model_name, monkeypatch)
    pyrannc.keep_graph(True)
    pyrannc.delay_grad_allreduce(delay)
    for step in range(2):
        batch = case.batch(step)
        loss = case.loss(rmod, batch)
        loss.backward(retain_graph=True)  # the client's own part of the graph (a loss on logits)
        loss.backward()
        ref_loss = case.loss(ref, to_ref(batch))
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        if step == 0:
            _check_replicated_plan(rmod)
        _compare_grads(rmod, ref, step)
        if delay:
            rmod.allreduce_grads()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, value in ref.state_dict().items():
        assert_close(rmod.state_dict()[name], value, name)
