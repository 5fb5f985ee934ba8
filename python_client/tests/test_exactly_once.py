"""Exactly-once calls: a daemon that drops answers (the test fault hook
RANNC_TEST_DROP_RESPONSES: the call runs and is recorded, its answer is replaced by UNAVAILABLE)
makes pyrannc retry; each retried call is answered from the daemon's record and applied once,
so training equals PyTorch's (conftest.assert_close: rtol 1e-5 / atol 1e-6)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import CLIENT_ROOT, DaemonProcess, assert_close

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

STEPS = 6

_CLIENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch, pyrannc
    from test_pipeline_conformance import MODELS
    case = MODELS["mlp"]
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range({steps}):
        case.loss(rmod, case.batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            rmod.load_state_dict(rmod.state_dict())  # a streamed mutating call, retried too
    torch.save(rmod.state_dict(), {out!r})
""")


def _reference():
    from test_pipeline_conformance import MODELS
    case = MODELS["mlp"]
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        case.loss(model, case.batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("defer", ["1", "0"], ids=["deferred_ops", "direct_calls"])
def test_dropped_answers_are_retried_and_applied_once(defer, tmp_path, monkeypatch):
    drops = ("Forward:2,Forward:5,Flush:1,LoadStateDict:1" if defer == "1" else
             "Forward:2,Backward:3,Flush:2,Flush:5,LoadStateDict:1")
    monkeypatch.setenv("RANNC_TEST_DROP_RESPONSES", drops)
    daemon = DaemonProcess("--devices", "cpu:2")
    monkeypatch.delenv("RANNC_TEST_DROP_RESPONSES")
    out = str(tmp_path / "state.pt")
    try:
        env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon.address,
                   RANNC_DEFER_OPS=defer, RANNC_PARTITION_NUM="2", RANNC_PIPELINE_NUM="2",
                   RANNC_REPLICA_NUM="1")
        script = _CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)), steps=STEPS,
                                out=out)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300)
        log = daemon.output()
        assert done.returncode == 0, done.stderr + log
    finally:
        daemon.stop()
    # Every dropped answer was retried by the client and replayed, not run again.
    assert log.count("dropping the answer") == len(drops.split(","))
    assert log.count("answered from the record") == len(drops.split(","))
    assert done.stderr.count("retrying, the daemon applies it once") == len(drops.split(","))
    state = torch.load(out)
    for name, value in _reference().items():
        assert_close(state[name], value, name)
