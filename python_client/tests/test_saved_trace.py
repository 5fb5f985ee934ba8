"""A start from a saved deployment that reuses the trace kept in the file (pyrannc._saved_trace)
instead of tracing the model again, against the real ranncd: it trains bitwise like a traced
start, it really skips torch.jit.trace, a changed model falls back to tracing and says why,
RANNC_REUSE_TRACE=0 traces, a file without a saved trace still loads, and the daemon refuses a
stand-in no tensor was sent for. The fingerprint and the outputs' codec are tested without a
daemon in test_unit.py.

Jobs are forced onto one device (RANNC_PARTITION_NUM=1, RANNC_REPLICA_NUM=1) so that two starts
of the same model are bitwise comparable.
"""

import importlib.util
import io
import json
import logging
import sys

import grpc
import pytest
import torch

import pyrannc
from pyrannc import _daemon, _saved_trace
from pyrannc.proto.rannc.v1 import deployment_pb2 as dpb
import models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

STEPS = 3


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setenv("RANNC_PARTITION_NUM", "1")
    monkeypatch.setenv("RANNC_REPLICA_NUM", "1")
    monkeypatch.delenv("RANNC_REUSE_TRACE", raising=False)


@pytest.fixture
def traces(monkeypatch):
    """Counts torch.jit.trace calls."""
    calls = []
    real = torch.jit.trace

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "trace", counting)
    return calls


def _no_trace(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.jit.trace was called although the trace could be reused")

    monkeypatch.setattr(torch.jit, "trace", refuse)


def _gpt():
    torch.manual_seed(7)
    return models.TinyGPT()


def _run(model, steps=STEPS, load=None, save=None, batch_fn=models.gpt_batch):
    """Trains `model` with AdamW for `steps` steps; returns losses, the first step's grads and
    the parameters and buffers at the end, all as the daemon has them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rmod = pyrannc.RaNNCModule(model, opt, load_deployment=load)
    losses, grads = [], None
    for step in range(steps):
        loss = rmod(*batch_fn(step))
        loss.backward()
        if grads is None:
            grads = {n: rmod.get_param_grad(n) for n, _ in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    if save is not None:
        rmod.save_deployment(save)
    state = {k: v.clone() for k, v in rmod.state_dict().items()}
    pyrannc.clear()
    return losses, grads, state


def _assert_bitwise(a, b):
    (losses_a, grads_a, state_a), (losses_b, grads_b, state_b) = a, b
    for i, (x, y) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(x, y), f"loss of step {i}: {x} vs {y}"
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), f"grad of {n}"
    assert state_a.keys() == state_b.keys()
    for n in state_a:
        assert torch.equal(state_a[n], state_b[n]), f"{n} after {STEPS} steps"


@pytest.fixture
def saved_gpt(tmp_path):
    path = tmp_path / "gpt.deployment"
    _run(_gpt(), steps=1, save=path)
    return path


def test_the_saved_file_holds_a_graph_only_trace(saved_gpt):
    d = dpb.Deployment.FromString(saved_gpt.read_bytes())
    assert d.HasField("saved_trace")
    fp = json.loads(d.saved_trace.fingerprint)
    assert fp["mode"] == {"training": True, "dropout": True}
    assert [t[0] for t in fp["tensors"]][:2] == ["pos", "tok.weight"]
    assert ["head.weight", "parameter", "torch.float32", [32, 16], True, "tok.weight"] in \
        fp["tensors"]  # tied
    # Every tensor is a stand-in: the archive is far smaller than the parameters.
    archive = torch.jit.load(io.BytesIO(d.saved_trace.archive))
    for name, t in archive.state_dict().items():
        if t.numel() > 1:
            assert 0 in t.stride(), f"{name} is not a stand-in"
    # show_deployment still reads it.
    assert "Stage 0" in pyrannc.show_deployment(saved_gpt, d.batch_size or 4)


def test_a_reused_start_trains_bitwise_like_a_traced_start(saved_gpt, monkeypatch, caplog,
                                                           traces):
    monkeypatch.setenv("RANNC_REUSE_TRACE", "0")
    with caplog.at_level(logging.INFO, logger="pyrannc"):
        traced = _run(_gpt(), load=saved_gpt)
    assert len(traces) == 1
    assert "reuse_trace (RANNC_REUSE_TRACE) is off" in caplog.text

    monkeypatch.delenv("RANNC_REUSE_TRACE")
    _no_trace(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pyrannc"):
        reused = _run(_gpt(), load=saved_gpt)
    assert "reusing the trace saved in" in caplog.text
    _assert_bitwise(reused, traced)


def test_a_reused_start_saves_the_trace_again(saved_gpt, tmp_path, monkeypatch):
    _no_trace(monkeypatch)
    again = tmp_path / "again.deployment"
    _run(_gpt(), steps=1, load=saved_gpt, save=again)
    first = dpb.Deployment.FromString(saved_gpt.read_bytes())
    second = dpb.Deployment.FromString(again.read_bytes())
    assert second.saved_trace == first.saved_trace
    _run(_gpt(), steps=1, load=again)


def test_eval_mode_falls_back_to_tracing_and_says_why(saved_gpt, caplog, traces):
    rmod = pyrannc.RaNNCModule(_gpt().eval(), load_deployment=saved_gpt)
    with caplog.at_level(logging.INFO, logger="pyrannc"), torch.no_grad():
        # The eval graph is another model to the daemon, which refuses the training plan.
        with pytest.raises(pyrannc.RanncError) as info:
            rmod(*models.gpt_batch(0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(traces) == 1
    assert ("it was traced in mode {'training': True, 'dropout': True}, the model is now in "
            "{'training': False, 'dropout': False}") in caplog.text


def test_other_shapes_fall_back_to_tracing_and_say_why(saved_gpt, caplog, traces):
    torch.manual_seed(7)
    wider = models.TinyGPT(d=24)
    rmod = pyrannc.RaNNCModule(wider, load_deployment=saved_gpt)
    with caplog.at_level(logging.INFO, logger="pyrannc"):
        # The plan is another model's, which the daemon refuses once the model is traced.
        with pytest.raises(pyrannc.RanncError) as info:
            rmod(*models.gpt_batch(0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(traces) == 1
    assert "the parameters and buffers (name, kind, dtype, shape" in caplog.text
    assert "[1, 8, 16], True, ''] in the saved trace, ['pos'" in caplog.text


_NET_SOURCE = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        # {note}
        return torch.nn.functional.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)
'''


def _net_module(tmp_path, note):
    """Net from a file of its own, so its source can change between two starts."""
    path = tmp_path / "saved_trace_net.py"
    path.write_text(_NET_SOURCE.format(note=note))
    spec = importlib.util.spec_from_file_location("saved_trace_net", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["saved_trace_net"] = module
    spec.loader.exec_module(module)
    return module


def test_changed_class_source_falls_back_to_tracing_and_says_why(tmp_path, monkeypatch, caplog,
                                                                 traces):
    path = tmp_path / "net.deployment"
    torch.manual_seed(0)
    _run(_net_module(tmp_path, "first").Net(), steps=1, save=path, batch_fn=models.mlp_batch)
    assert len(traces) == 1

    # Same module tree and shapes; only a comment in the forward changed, so the new trace is
    # the same graph and the daemon still takes the plan. (A change to the graph makes the
    # daemon refuse the plan, as test_other_shapes... shows.)
    net = _net_module(tmp_path, "a longer second comment")
    torch.manual_seed(0)
    ref = net.Net()
    ref_loss = ref(*models.mlp_batch(0))
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="pyrannc"):
        losses, _, _ = _run(net.Net(), steps=1, load=path, batch_fn=models.mlp_batch)
    monkeypatch.delitem(sys.modules, "saved_trace_net")
    assert len(traces) == 2
    assert "the source of module class saved_trace_net.Net changed" in caplog.text
    torch.testing.assert_close(losses[0], ref_loss.detach(), rtol=1e-5, atol=1e-6)


def test_an_old_deployment_without_a_trace_still_loads(saved_gpt, tmp_path, caplog, traces):
    old = dpb.Deployment.FromString(saved_gpt.read_bytes())
    old.ClearField("saved_trace")
    path = tmp_path / "old.deployment"
    path.write_bytes(old.SerializeToString())
    with caplog.at_level(logging.INFO, logger="pyrannc"):
        losses, _, _ = _run(_gpt(), steps=1, load=path)
    assert len(traces) == 1
    assert "holds no saved trace" in caplog.text
    assert torch.isfinite(losses[0])


def test_the_daemon_refuses_a_stand_in_left_unbound(saved_gpt, monkeypatch):
    _no_trace(monkeypatch)
    every = _saved_trace.model_tensors
    monkeypatch.setattr(_saved_trace, "model_tensors",
                        lambda model: [(n, t) for n, t in every(model) if n != "ln_f.bias"])
    rmod = pyrannc.RaNNCModule(_gpt(), load_deployment=saved_gpt)
    with pytest.raises(pyrannc.RanncError) as info:
        rmod(*models.gpt_batch(0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'ln_f.bias'" in info.value.details and "stand-in" in info.value.details


def test_without_shared_memory_small_tensors_go_inline(saved_gpt, monkeypatch):
    """RANNC_SHM=0: every tensor rides inline in the JobSpec (the model is small)."""
    traced = _run(_gpt(), load=saved_gpt)
    _daemon.shutdown()
    monkeypatch.setenv("RANNC_SHM", "0")
    _no_trace(monkeypatch)
    try:
        assert _daemon.connection().shm is None
        reused = _run(_gpt(), load=saved_gpt)
    finally:
        _daemon.shutdown()  # the next test's connection offers shared memory again
    _assert_bitwise(reused, traced)
