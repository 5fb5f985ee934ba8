"""RaNNCModule's API behaviours through the real ranncd, compared with plain PyTorch.

Numeric comparisons use torch.testing.assert_close(rtol=1e-5, atol=1e-6).
"""

import copy
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import grpc
import pytest
import torch
import torch.nn.functional as F

import pyrannc
from pyrannc import _daemon, _shm
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from conftest import CLIENT_ROOT, DaemonProcess, assert_close, free_port
import models

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")


def _fresh(model_fn=models.MLP, opt_fn=None, seed=0):
    torch.manual_seed(seed)
    model = model_fn()
    ref = copy.deepcopy(model)
    opt = opt_fn(model) if opt_fn else None
    ref_opt = opt_fn(ref) if opt_fn else None
    return pyrannc.RaNNCModule(model, opt), model, opt, ref, ref_opt


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _train(rmod, opt, steps, start=0):
    for step in range(start, start + steps):
        rmod(*models.mlp_batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _reference_from(rmod, model_fn):
    ref = model_fn()
    ref.load_state_dict(rmod.state_dict())
    return ref


# ---------------------------------------------------------------------------------------------
# Modes.

def test_eval_output_equals_pytorch_eval_and_train_mode_drops_out():
    torch.manual_seed(0)
    model = models.DropoutNet(p=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rmod = pyrannc.RaNNCModule(model, opt)
    x = torch.randn(64, 8)
    for _ in range(2):
        rmod(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    ref = _reference_from(rmod, lambda: models.DropoutNet(p=0.5)).eval()
    rmod.eval()
    assert not rmod.training and not model.training
    out = rmod(x)
    assert_close(out.detach(), ref(x).detach(), "eval output")
    with torch.no_grad():
        assert_close(rmod(x), ref(x), "eval output under no_grad")

    rmod.train()
    a, b = rmod(x).detach(), rmod(x).detach()
    assert not torch.equal(a, b), "dropout is active in training mode"
    with torch.no_grad():
        ref.train()
        ref.drop.eval()
        no_dropout = ref(x)
    assert not torch.allclose(a, no_dropout)

    # enable_dropout(False) keeps training mode but switches dropout off.
    rmod.enable_dropout(False)
    assert_close(rmod(x).detach(), no_dropout, "training mode without dropout")
    # And back: the daemon already has both graphs.
    rmod.eval()
    rmod.enable_dropout(False)
    assert_close(rmod(x).detach(), ref.eval()(x).detach(), "eval again")


def test_eval_before_first_forward_then_train():
    rmod, model, opt, ref, ref_opt = _fresh(models.CNN, _sgd)
    rmod.eval()
    ref.eval()
    x, y = models.cnn_batch(0)
    with torch.no_grad():
        assert_close(rmod(x), ref(x), "eval first")
    rmod.train()
    ref.train()
    for step in range(2):
        x, y = models.cnn_batch(step)
        loss = F.cross_entropy(rmod(x), y)
        loss.backward()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, value in ref.state_dict().items():
        assert_close(rmod.state_dict()[name], value, name)


def test_no_grad_forward_returns_plain_tensors():
    rmod, *_ = _fresh()
    with torch.no_grad():
        loss = rmod(*models.mlp_batch(0))
    assert not loss.requires_grad
    loss = rmod(*models.mlp_batch(0))
    assert loss.requires_grad


# ---------------------------------------------------------------------------------------------
# state_dict / load_state_dict.

def test_load_state_dict_before_first_forward():
    torch.manual_seed(1)
    source = models.MLP()
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=_sgd)
    result = rmod.load_state_dict(source.state_dict())
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    batch = models.mlp_batch(0)
    assert_close(rmod(*batch).detach(), source(*batch).detach(), "output after load")


def test_state_dict_round_trip_after_first_forward():
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    _train(rmod, opt, 2)
    saved = {k: v.clone() for k, v in rmod.state_dict().items()}
    _train(rmod, opt, 2, start=2)
    changed = rmod.state_dict()
    assert any(not torch.equal(changed[k], saved[k]) for k in saved)

    result = rmod.load_state_dict(saved)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    for k, v in rmod.state_dict().items():
        assert_close(v, saved[k], k)
    for k, v in saved.items():
        assert_close(rmod.get_param(k), v, f"get_param({k})")
    ref = models.MLP()
    ref.load_state_dict(saved)
    batch = models.mlp_batch(7)
    assert_close(rmod(*batch).detach(), ref(*batch).detach(), "output after load")


def test_state_dict_round_trip_tied_and_buffers():
    torch.manual_seed(0)
    model = models.CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    x, y = models.cnn_batch(0)
    F.cross_entropy(rmod(x), y).backward()
    opt.step()
    saved = {k: v.clone() for k, v in rmod.state_dict().items()}
    F.cross_entropy(rmod(x), y).backward()
    opt.step()
    rmod.load_state_dict(saved)
    for k, v in rmod.state_dict().items():
        assert_close(v, saved[k], k)


def test_load_state_dict_errors_after_first_forward():
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    _train(rmod, opt, 1)
    good = {k: v.clone() for k, v in rmod.state_dict().items()}

    missing = dict(good)
    del missing["l2.bias"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*l2\.bias"):
        rmod.load_state_dict(missing)
    result = rmod.load_state_dict(missing, strict=False)
    assert list(result.missing_keys) == ["l2.bias"]

    unexpected = dict(good, extra=torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*extra"):
        rmod.load_state_dict(unexpected)

    misshaped = dict(good)
    misshaped["l1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for l1\.weight"):
        rmod.load_state_dict(misshaped)
    # None of the failed loads changed anything.
    for k, v in rmod.state_dict().items():
        assert_close(v, good[k], k)


# ---------------------------------------------------------------------------------------------
# Gradients.

def test_clip_grad_norm_equals_torch():
    rmod, model, opt, ref, ref_opt = _fresh(models.TinyGPT, lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1))
    batch = models.gpt_batch(0)
    rmod(*batch).backward()
    ref(*batch).backward()
    for norm_type in (2.0, 1.0):
        max_norm = 0.05
        total = rmod.clip_grad_norm(max_norm, norm_type) if norm_type != 2.0 \
            else rmod.clip_grad_norm(max_norm)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        assert_close(total, ref_total, f"total norm ({norm_type})")
        for name, p in ref.named_parameters():
            assert_close(rmod.get_param_grad(name), p.grad, f"clipped grad of {name}")
    opt.step()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


def test_keep_graph_allows_second_backward():
    rmod, model, opt, ref, _ = _fresh(models.TwoInputs)
    a, b, y = models.two_inputs_batch(0)
    pyrannc.keep_graph(True)
    try:
        out = rmod(a, b)
        loss = F.mse_loss(out, y)
        loss.backward(retain_graph=True)
        loss.backward()
    finally:
        pyrannc.keep_graph(False)
    ref_loss = F.mse_loss(ref(a, b), y)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    for name, p in ref.named_parameters():
        assert_close(rmod.get_param_grad(name), p.grad, f"grad of {name}")


def test_second_backward_without_keep_graph_fails():
    rmod, *_ = _fresh()
    loss = rmod(*models.mlp_batch(0))
    loss.backward(retain_graph=True)
    with pytest.raises(pyrannc.RanncError) as info:
        loss.backward()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_gradient_accumulation_over_two_forwards():
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=lambda m: torch.optim.Adam(
        m.parameters(), lr=0.01))
    pyrannc.delay_grad_allreduce(True)
    try:
        for step in range(3):
            for micro in range(2):
                batch = models.mlp_batch(10 * step + micro)
                (rmod(*batch) / 2).backward()
                (ref(*batch) / 2).backward()
            for name, p in ref.named_parameters():
                assert_close(rmod.get_param_grad(name), p.grad, f"accumulated grad of {name}")
            rmod.allreduce_grads()
            opt.step()
            ref_opt.step()
            rmod.zero_grad()
            ref_opt.zero_grad()
    finally:
        pyrannc.delay_grad_allreduce(False)
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


def test_backward_through_an_earlier_forward_is_refused():
    rmod, *_ = _fresh()
    first = rmod(*models.mlp_batch(0))
    rmod(*models.mlp_batch(1))
    with pytest.raises(RuntimeError, match="earlier forward"):
        first.backward()


def test_optimizer_closure():
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=_sgd)
    batch = models.mlp_batch(0)

    def closure(m, o):
        def run():
            o.zero_grad()
            loss = m(*batch)
            loss.backward()
            return loss
        return run

    loss = opt.step(closure(rmod, opt))
    ref_loss = ref_opt.step(closure(ref, ref_opt))
    assert_close(loss.detach(), ref_loss.detach(), "closure loss")
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


# ---------------------------------------------------------------------------------------------
# Unsupported or later-issue features fail loudly.

def test_later_issue_functions_raise():
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    with pytest.raises(ValueError, match="enable_apex_amp"):
        rmod.get_param("l1.weight", amp_master_param=True)
    with pytest.raises(NotImplementedError, match="LBFGS"):
        pyrannc.RaNNCModule(models.MLP(), torch.optim.LBFGS(models.MLP().parameters()))


def test_client_rank_variables(monkeypatch):
    # rannc's own variables first, then torchrun's.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert pyrannc.get_rank() == 3 and pyrannc.get_world_size() == 4
    monkeypatch.setenv("RANNC_CLIENT_WORLD", "2")
    monkeypatch.setenv("RANNC_CLIENT_RANK", "1")
    assert pyrannc.get_world_size() == 2 and pyrannc.get_rank() == 1
    monkeypatch.setenv("RANNC_CLIENT_RANK", "2")
    with pytest.raises(ValueError, match="outside 0..1"):
        pyrannc.RaNNCModule(models.MLP())


def test_single_client_functions():
    assert pyrannc.get_rank() == 0 and pyrannc.get_world_size() == 1
    pyrannc.barrier()
    pyrannc.sync_params_on_init(False)
    pyrannc.sync_params_on_init(True)
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=_sgd)
    _train(rmod, opt, 1)
    _train(ref, ref_opt, 1)
    # The engine and its communicators are rebuilt; parameters and momentum carry over.
    pyrannc.recreate_all_communicators()
    _train(rmod, opt, 2, start=1)
    _train(ref, ref_opt, 2, start=1)
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


def test_cuda_and_to_are_noops_with_warning():
    rmod, *_ = _fresh()
    with pytest.warns(UserWarning, match="no-op"):
        assert rmod.cuda() is rmod
    with pytest.warns(UserWarning, match="no-op"):
        assert rmod.to("cuda:0") is rmod


# ---------------------------------------------------------------------------------------------
# Deployment lifecycle.

def test_undeploy_then_forward_again():
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=_sgd)
    for step in range(2):
        batch = models.mlp_batch(step)
        rmod(*batch).backward()
        ref(*batch).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # The daemon reports what the job holds on each of its devices, and nothing once undeployed.
    def held():
        jobs = _daemon.connection().stub.ListJobs(pb.Empty()).jobs
        job = next(j for j in jobs if j.job_id == rmod._job.id)
        assert len(job.device_bytes) == len(job.devices) == len(rmod._job.devices)
        return list(job.device_bytes)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # At least the parameters and their gradients (a stage without parameters may hold none).
    assert sum(held()) >= 2 * params
    rmod.undeploy()
    assert held() == [0] * len(rmod._job.devices)
    # undeploy() left the daemon's values in the local model.
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.detach(), q.detach(), f"local {name} after undeploy")
    for step in range(2, 4):
        batch = models.mlp_batch(step)
        loss = rmod(*batch)
        loss.backward()
        ref_loss = ref(*batch)
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss after redeploy, step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


def test_clear_recreates_jobs_from_current_state():
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=lambda m: torch.optim.SGD(m.parameters(),
                                                                              lr=0.1))
    for step in range(2):
        batch = models.mlp_batch(step)
        rmod(*batch).backward()
        ref(*batch).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    pyrannc.clear()
    batch = models.mlp_batch(5)
    assert_close(rmod(*batch).detach(), ref(*batch).detach(), "output after clear")


def test_errors_surface_as_rannc_error():
    rmod, *_ = _fresh()
    rmod(*models.mlp_batch(0))
    x, y = models.mlp_batch(0)
    with pytest.raises(pyrannc.RanncError) as info:
        rmod(torch.randn(16, 5), y)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in info.value.details


def test_inputs_must_be_positional_tensors():
    rmod, *_ = _fresh()
    x, y = models.mlp_batch(0)
    with pytest.raises(ValueError, match="keyword"):
        rmod(x, y=y)
    with pytest.raises(TypeError, match="'y'"):
        rmod(x, 3)


def _wait_gone(pid, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


_EMBEDDED_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, pyrannc
    from pyrannc import _daemon
    m = pyrannc.RaNNCModule(torch.nn.Linear(3, 1))
    print(float(m(torch.ones(2, 3)).sum()))
    print("PID", _daemon.connection().embedded.proc.pid, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_embedded_daemon_ends_with_its_client(ending):
    """The embedded daemon stops when its client exits normally (atexit) or is SIGKILLed."""
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT)
    env.pop("RANNC_DAEMON", None)
    out = subprocess.run([sys.executable, "-c", _EMBEDDED_SCRIPT, ending], env=env,
                         capture_output=True, text=True, timeout=300)
    assert "PID" in out.stdout, out.stderr
    assert out.returncode == (0 if ending == "exit" else -9), out.stderr
    pid = int(out.stdout.split("PID")[1].split()[0])
    if not _wait_gone(pid):
        os.kill(pid, 9)
        pytest.fail(f"embedded ranncd (pid {pid}) still runs after its client ended ({ending})")


_LEASED_SCRIPT = textwrap.dedent("""
    import sys, time, torch, pyrannc
    m = pyrannc.RaNNCModule(torch.nn.Linear(3, 1))
    m(torch.ones(2, 3))
    print("JOB", m._job.id, flush=True)
    time.sleep(600)  # killed by the test
""")


def _live_jobs(conn):
    return {j.job_id for j in conn.stub.ListJobs(pb.Empty()).jobs}


@pytest.mark.parametrize("lease_s", ["2", "0"])
def test_a_dead_clients_job_is_deleted_once_its_lease_runs_out(pyrannc_daemon, lease_s):
    """A client killed without deleting its job (a shared daemon, RANNC_DAEMON): with a lease
    (RANNC_JOB_LEASE=2) the job stays while the client lives, renewed by pyrannc's thread well
    past the lease, and the daemon deletes it within a lease (and its once-a-second sweep) of the
    client's death, saying why; with RANNC_JOB_LEASE=0 it stays until someone deletes it."""
    daemon = DaemonProcess()
    try:
        env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon.address,
                   RANNC_JOB_LEASE=lease_s)
        client = subprocess.Popen([sys.executable, "-c", _LEASED_SCRIPT], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = client.stdout.readline()
            assert line.startswith("JOB"), client.stderr.read() if client.poll() is not None \
                else line
            job_id = line.split()[1]
            time.sleep(4)  # two leases: only the renewals keep the job
            assert job_id in _live_jobs(daemon.conn)
        finally:
            client.kill()
            client.wait()
        if lease_s == "0":
            time.sleep(4)  # longer than the leased case's lease and sweep
            assert job_id in _live_jobs(daemon.conn)
            daemon.conn.call("DeleteJob", pb.JobRef(job_id=job_id))
        else:
            deadline = time.monotonic() + 8
            while job_id in _live_jobs(daemon.conn) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert job_id not in _live_jobs(daemon.conn), daemon.output()[-2000:]
            assert f"deleted job {job_id}" in daemon.output()
            assert "lease of 2000 ms" in daemon.output()
    finally:
        daemon.stop()


def test_a_lease_under_a_second_is_refused(monkeypatch):
    monkeypatch.setenv("RANNC_JOB_LEASE", "0.2")
    with pytest.raises(pyrannc.RanncError) as err:
        pyrannc.RaNNCModule(torch.nn.Linear(3, 1))(torch.ones(2, 3))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "lease_ms=200" in str(err.value) and "RANNC_JOB_LEASE" in str(err.value)


def test_missing_daemon_binary_is_a_clear_error(tmp_path):
    script = "import torch, pyrannc\npyrannc.RaNNCModule(torch.nn.Linear(3, 1))(torch.ones(2, 3))"
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON_BIN=str(tmp_path / "nope"))
    env.pop("RANNC_DAEMON", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "RanncError" in out.stderr and "RANNC_DAEMON_BIN" in out.stderr


def test_unreachable_daemon_is_a_clear_error():
    script = "import torch, pyrannc\npyrannc.RaNNCModule(torch.nn.Linear(3, 1))(torch.ones(2, 3))"
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=f"127.0.0.1:{free_port()}",
               RANNC_DAEMON_CONNECT_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "cannot reach ranncd" in out.stderr and "RANNC_DAEMON" in out.stderr


def test_warnings_free_training_loop():
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            rmod(*models.mlp_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()


class _Wide(torch.nn.Module):
    """Parameters larger than one 4 MiB stream chunk."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(1024, 1536)  # 6 MiB of float32 weight
        self.out = torch.nn.Linear(1536, 1)

    def forward(self, x):
        return self.out(torch.relu(self.big(x))).sum()


def test_state_dict_streams_tensors_larger_than_a_chunk():
    rmod, model, opt, ref, ref_opt = _fresh(_Wide, lambda m: torch.optim.SGD(m.parameters(),
                                                                              lr=0.01))
    x = torch.randn(4, 1024)
    rmod(x).backward()
    ref(x).backward()
    opt.step()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)
    replacement = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    rmod.load_state_dict(replacement)
    for k, v in replacement.items():
        assert_close(rmod.get_param(k), v, k)
    ref.load_state_dict(replacement)
    with torch.no_grad():
        assert_close(rmod(x), ref(x), "output after loading")


_LARGE_TENSORS_SCRIPT = textwrap.dedent("""
    import copy, json, torch, pyrannc
    from pyrannc import _daemon
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    result = {"shm": _daemon.connection().shm is not None, "close": {}}

    def close(what, a, b):
        result["close"][what] = bool(torch.allclose(a.detach(), b.detach(), rtol=1e-5, atol=1e-6))

    try:
        for step in range(2):
            x = torch.randn(1024, 1024)  # 4 MiB in, 4 MiB out
            out = rmod(x)
            out.pow(2).mean().backward()
            ref_out = ref(x)
            ref_out.pow(2).mean().backward()
            close(f"output {step}", out, ref_out)
            opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        for k, v in ref.state_dict().items():
            close(k, rmod.state_dict()[k], v)
        rmod.load_state_dict({k: v * 2 for k, v in ref.state_dict().items()})
        close("loaded weight", rmod.get_param("weight"), 2 * ref.weight)
    except pyrannc.RanncError as e:
        result["error"] = e.code.name
    print("RESULT", json.dumps(result))
""")


def _run_large_tensors(shm):
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON_ARGS="--max-message-size 2MiB",
               RANNC_SHM=shm)
    env.pop("RANNC_DAEMON", None)
    out = subprocess.run([sys.executable, "-c", _LARGE_TENSORS_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.split("RESULT", 1)[1])


def test_large_tensors_go_through_shared_memory_past_the_message_limit():
    """Inputs, grads and outputs over the daemon's 2 MiB message limit travel through shared
    memory; state_dict streams cut their chunks to fit the limit. Results equal PyTorch's
    within rtol=1e-5, atol=1e-6."""
    result = _run_large_tensors("1")
    assert result["shm"] and "error" not in result, result
    assert len(result["close"]) == 5 and all(result["close"].values()), result
    inline = _run_large_tensors("0")
    assert not inline["shm"] and inline.get("error") == "RESOURCE_EXHAUSTED", inline


class _LargeTiedLm(torch.nn.Module):
    """Tensors of at least 1 MiB (tied embedding/head, a frozen projection, a buffer) beside
    small ones: the large ones leave the archive when the daemon shares the host."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 256)     # 1 MiB, tied to head
        self.frozen = torch.nn.Linear(256, 1024)     # 1 MiB weight, requires_grad=False
        self.frozen.weight.requires_grad_(False)
        self.mix = torch.nn.Linear(1024, 256)        # 1 MiB weight, small bias
        self.head = torch.nn.Linear(256, 1024, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.rand(1024, 256) + 0.5)  # 1 MiB

    def forward(self, ids):
        h = self.emb(ids)
        h = self.mix(torch.tanh(self.frozen(h))) * self.scale[ids]
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_large_model_tensors_travel_beside_the_archive_through_shared_memory(caplog, tmp_path):
    """With shared memory, the tied weight (once), the frozen weight, the buffer and mix.weight
    go apart from the TorchScript archive, and the job trains as PyTorch does (rtol=1e-5,
    atol=1e-6): tied stays tied, frozen stays frozen. No upload file is left behind, and a
    mode switch (whose archive carries no tensors at all) still evaluates the trained values."""
    conn = _daemon.connection()
    assert conn.shm is not None, "the embedded daemon offers shared memory"
    torch.manual_seed(0)
    model = _LargeTiedLm()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    param_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with caplog.at_level("DEBUG", logger="pyrannc"):
        for step in range(2):
            ids = torch.randint(0, 1024, (4, 8), generator=torch.Generator().manual_seed(step))
            loss = rmod(ids)
            loss.backward()
            ref_loss = ref(ids)
            ref_loss.backward()
            assert_close(loss.detach(), ref_loss.detach(), f"loss {step}")
            opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    serialized = [r.getMessage() for r in caplog.records if "serialized the traced" in r.message]
    assert len(serialized) == 1, serialized
    # emb.weight (= head.weight), frozen.weight, mix.weight, scale.
    assert "4 tensors apart" in serialized[0], serialized[0]
    archive_bytes = int(serialized[0].split("(")[1].split(" bytes")[0])
    assert archive_bytes < param_bytes // 4, (archive_bytes, param_bytes)
    # This process's (tests running beside it may share the directory).
    mine = f"rannc-pyrannc-{os.getpid()}-{_shm._TAG}-"
    assert not [f for f in os.listdir(conn.info.shm_dir)
                if f.startswith(mine) and f.endswith("-bulk")]

    state = rmod.state_dict()
    for k, v in ref.state_dict().items():
        assert_close(state[k], v, k)
    assert torch.equal(state["emb.weight"], state["head.weight"])
    assert not rmod.get_param("frozen.weight").requires_grad
    assert_close(rmod.get_param("frozen.weight"), ref.frozen.weight, "frozen.weight unchanged")

    rmod.eval()
    ref.eval()
    ids = torch.randint(0, 1024, (4, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert_close(rmod(ids), ref(ids), "eval loss after a mode switch")


def test_garbage_collected_modules_release_their_jobs(pyrannc_daemon):
    import gc

    rmod, *_ = _fresh()
    rmod(*models.mlp_batch(0))
    job_id = rmod._job.id
    listed = {j.job_id for j in pyrannc_daemon.stub.ListJobs(pb.Empty()).jobs}
    assert job_id in listed
    del rmod, _
    gc.collect()
    other, *_ = _fresh()
    other(*models.mlp_batch(0))
    listed = {j.job_id for j in pyrannc_daemon.stub.ListJobs(pb.Empty()).jobs}
    assert job_id not in listed and other._job.id in listed


def test_deferred_step_error_surfaces_at_next_forward():
    """A step is batched into the next forward; its failure fails that forward, naming it."""
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    rmod(*models.mlp_batch(0)).backward()
    opt.param_groups[0]["lr"] = -1.0  # ranncd checks hyper-parameters at every step
    opt.step()
    with pytest.raises(pyrannc.RanncError) as info:
        rmod(*models.mlp_batch(1))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "deferred optimizer step" in info.value.details
    assert "lr" in info.value.details


def test_unbatched_step_error_is_raised_by_step(monkeypatch):
    monkeypatch.setenv("RANNC_DEFER_OPS", "0")
    rmod, model, opt, *_ = _fresh(opt_fn=_sgd)
    rmod(*models.mlp_batch(0)).backward()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(pyrannc.RanncError) as info:
        opt.step()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_reading_gradients_flushes_deferred_backward():
    rmod, model, opt, ref, ref_opt = _fresh(opt_fn=_sgd)
    batch = models.mlp_batch(0)
    rmod(*batch).backward()
    ref(*batch).backward()
    for name, p in ref.named_parameters():
        assert_close(rmod.get_param_grad(name), p.grad, f"grad of {name}")


# ---------------------------------------------------------------------------------------------
# RaNNC's arguments of state_dict, buffers() and check_unused_values (docs/api.md's table).

def test_state_dict_arguments_as_raNNC_documents_them(monkeypatch):
    torch.manual_seed(0)
    model = models.CNN()
    ref = copy.deepcopy(model)
    calls = []

    def hook(module, state, prefix, local_metadata):
        calls.append(prefix)
        state[prefix + "hooked"] = torch.zeros(1)

    model.fc._register_state_dict_hook(hook)
    ref.fc._register_state_dict_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(2):
        x, y = models.cnn_batch(step)
        for m, o in ((rmod, opt), (ref, ref_opt)):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    # The hooks run, as PyTorch's state_dict runs them; no_hook=True leaves them out.
    state = rmod.state_dict()
    assert "fc.hooked" in state and sorted(state) == sorted(ref.state_dict())
    calls.clear()
    bare = rmod.state_dict(no_hook=True)
    assert calls == [] and "fc.hooked" not in bare
    assert sorted(bare) == sorted(k for k in ref.state_dict() if k != "fc.hooked")
    for k, v in ref.state_dict().items():
        assert_close(state[k], v, k)
    # buffers(): BatchNorm's running statistics as the daemon updated them.
    got = dict(rmod.named_buffers())
    want = dict(ref.named_buffers())
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert_close(got[k], v, f"buffer {k}")
    assert [b.shape for b in rmod.buffers()] == [b.shape for b in ref.buffers()]
    # Without mixed precision amp_master_params changes nothing (RaNNC's default is True).
    for k, v in rmod.state_dict(amp_master_params=False).items():
        assert v.dtype == state[k].dtype, k
    # rank0_only: another client rank gets an empty dict unless it asks with False.
    monkeypatch.setattr(pyrannc._runtime, "get_rank", lambda: 1)
    assert rmod.state_dict() == {}
    assert sorted(rmod.state_dict(rank0_only=False)) == sorted(state)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_state_dict_amp_master_params(level, monkeypatch):
    # With mixed precision the state is the fp32 masters (amp_master_params=True, the default);
    # False gives the parameters as the forward reads them: bf16 at O2, fp32 at O1 (autocast).
    monkeypatch.setenv("RANNC_AMP_LEVEL", level)
    torch.manual_seed(0)
    model = models.MLP()
    rmod = pyrannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               enable_apex_amp=True)
    rmod(*models.mlp_batch(0)).backward()
    masters = rmod.state_dict()
    assert all(v.dtype == torch.float32 for v in masters.values())
    cast = rmod.state_dict(amp_master_params=False)
    for k, v in masters.items():
        want = torch.bfloat16 if level == "O2" else torch.float32
        assert cast[k].dtype == want, k
        assert torch.equal(cast[k], v.to(want)), k
    # The job's amp_level, not the config's now.
    monkeypatch.setenv("RANNC_AMP_LEVEL", "O1" if level == "O2" else "O2")
    for k, v in rmod.state_dict(amp_master_params=False).items():
        assert v.dtype == (torch.bfloat16 if level == "O2" else torch.float32), k


def test_check_unused_values_both_ways():
    # A parameter the forward never reads: refused by default, naming it and the switch; with
    # check_unused_values=False the job trains as PyTorch does (the unused one unchanged).
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 4)
            self.unused = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.used(x), y)

    torch.manual_seed(0)
    model = Unused()
    rmod = pyrannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RanncError, match=r"unused\.weight.*check_unused_values=False"):
        rmod(*models.mlp_batch(0))
    pyrannc.clear()
    torch.manual_seed(0)
    model = Unused()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt, check_unused_values=False)
    for step in range(3):
        for m, o in ((rmod, opt), (ref, ref_opt)):
            m(*models.mlp_batch(step)).backward()
            o.step()
            o.zero_grad()
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)


def test_numeric_settings_travel_with_the_job():
    # PyTorch keeps TF32, cuDNN and deterministic-algorithm switches process-wide; each job
    # carries its client's, and a daemon runs jobs of one setting at a time (the settings
    # themselves are checked on CUDA devices: test_gpu_models.py).
    pyrannc.clear()
    first, *_ = _fresh()
    first(*models.mlp_batch(0))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        second, _, _, ref, _ = _fresh(seed=1)
        with pytest.raises(RanncError) as info:
            second(*models.mlp_batch(0))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "deterministic_algorithms=True" in info.value.details
        assert "deterministic_algorithms=False" in info.value.details
        pyrannc.clear()  # the first job ends: the second's settings become the daemon's
        batch = models.mlp_batch(1)
        assert_close(second(*batch).detach(), ref(*batch).detach(), "deterministic job")
    finally:
        torch.use_deterministic_algorithms(deterministic)
        pyrannc.clear()
