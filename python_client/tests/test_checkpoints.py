"""Checkpoints written by the daemons, resumed on another plan, exported for plain PyTorch, and
their faults (docs/checkpoints.md).

The suite's daemon has four devices (RANNC_DEVICES=cpu:4, set by the Bazel target); a job that
resumes elsewhere runs on a second daemon this suite starts with two. Continuations are compared
with an uninterrupted PyTorch run (conftest.assert_close: rtol 1e-5 / atol 1e-6); runs killed
and resumed on the same plan are compared bitwise with an uninterrupted run of that plan.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

import pyrannc
from conftest import CLIENT_ROOT, DaemonProcess, assert_close, built_binary, ref_copy, to_ref
from pyrannc.errors import RanncError
from test_pipeline_conformance import MODELS, DeepMLP, _set_plan_config
from test_scripted_optimizer import Lion  # registered with pyrannc there

pytestmark = pytest.mark.usefixtures("pyrannc_daemon", "four_devices")

CASE = MODELS["mlp"]
OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1,
                                         amsgrad=True),
    # State of one value per parameter besides the step (NAdam's mu_product, ASGD's eta and
    # mu), which ZeRO keeps whole on every shard.
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01),
    "asgd": lambda m: torch.optim.ASGD(m.parameters(), lr=0.01, t0=2),
    # A TorchScript update (pyrannc.register_optimizer), shipped with the job and resumed with it.
    "lion": lambda m: Lion(m.parameters(), lr=3e-3, weight_decay=0.1),
}


@pytest.fixture
def clean():
    yield
    pyrannc.clear()


@pytest.fixture
def checkpoint_env(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    monkeypatch.setenv("RANNC_CHECKPOINT_DIR", str(directory))
    monkeypatch.setenv("RANNC_JOB", "ckpt-test")
    monkeypatch.delenv("RANNC_RESUME", raising=False)
    monkeypatch.delenv("RANNC_CHECKPOINT_EVERY", raising=False)
    return directory


def _train(module, opt, first, last):
    for step in range(first, last):
        batch = CASE.batch(step)
        if not isinstance(module, pyrannc.RaNNCModule):
            batch = to_ref(batch)
        CASE.loss(module, batch).backward()
        opt.step()
        opt.zero_grad()


def _check_params(module, ref, what):
    for name, value in module.state_dict().items():
        assert_close(value, ref.state_dict()[name], f"{what}: {name}")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_on_another_plan_and_daemon_and_export(optimizer, checkpoint_env, tmp_path,
                                                      monkeypatch, clean):
    # 2 stages x 2 replicas with ZeRO on cpu:4, a checkpoint every 2 steps, the newest 2 kept.
    _set_plan_config(monkeypatch, (2, 2, 2), "1f1b")
    monkeypatch.setenv("RANNC_CHECKPOINT_EVERY", "2")
    monkeypatch.setenv("RANNC_CHECKPOINT_KEEP", "2")
    torch.manual_seed(0)
    model = CASE.make()
    ref = ref_copy(model)
    opt, ref_opt = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](ref)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero=True)
    assert rmod.resumed_step is None  # resume is not set
    _train(rmod, opt, 0, 6)
    _train(ref, ref_opt, 0, 6)
    # Every 2 steps, the newest 2 kept; the last written while training went on.
    deadline = time.monotonic() + 60
    while not all(c.committed for c in rmod.checkpoints()):
        assert time.monotonic() < deadline, rmod.checkpoints()
        time.sleep(0.05)
    assert [c.step for c in rmod.checkpoints()] == [4, 6]
    step_dir = checkpoint_env / "ckpt-test" / "step-0000000006"
    assert (step_dir / "manifest.json").is_file()
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == "6"
    assert manifest["optimizer"] == {"lion": "Lion"}.get(optimizer, optimizer)
    # ZeRO's shards are written as they are, slices of their tensors (the reader assembles them).
    sliced = [e for e in manifest["entries"] if e["kind"] == "OPTIMIZER_STATE" and
              int(e["numel"]) < math.prod(int(d) for d in e.get("shape", []))]
    assert sliced and any(int(e.get("offset", 0)) > 0 for e in sliced), manifest["entries"]
    # Each tensor file opens with plain torch.load.
    tensors = torch.load(step_dir / manifest["files"][0]["path"])
    assert any(key.startswith("optim/") for key in tensors)

    # Exported: one file plain PyTorch resumes from, exactly.
    exported = tmp_path / "export.pt"
    assert rmod.export_checkpoint(exported) == 6
    saved = torch.load(exported)
    plain = CASE.make().to(next(ref.parameters()).device)
    plain.load_state_dict(saved["model"])
    plain_opt = OPTIMIZERS[optimizer](plain)
    plain_opt.load_state_dict(saved["optimizer"])
    _check_params(rmod, plain, "exported")

    # Resumed on another daemon with two devices, as 1 stage x 2 replicas without ZeRO, by a
    # new client process.
    pyrannc.clear()
    _train(ref, ref_opt, 6, 9)
    _train(plain, plain_opt, 6, 9)
    _check_params(plain, ref, "exported, continued in torch.optim")
    out = str(tmp_path / "resumed.pt")
    other = DaemonProcess("--devices", "cpu:2")
    try:
        env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=other.address,
                   RANNC_RESUME="latest", RANNC_PARTITION_NUM="1", RANNC_PIPELINE_NUM="1",
                   RANNC_REPLICA_NUM="2")
        env.pop("RANNC_CHECKPOINT_EVERY")
        script = _RESUMED_CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                        optimizer=optimizer, out=out)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr + other.output()
    finally:
        other.stop()
    got = torch.load(out)
    assert got["before"] == 6 and got["after"] == 6  # before the first forward, and after
    assert got["stages"] == [[0, 1]]
    for name, value in got["state"].items():
        assert_close(value, ref.state_dict()[name], f"resumed on 1x2: {name}")


_RESUMED_CLIENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch, pyrannc
    from test_checkpoints import CASE, OPTIMIZERS, _train
    torch.manual_seed(1)  # other initial values: the checkpoint's must win
    model = CASE.make()
    opt = OPTIMIZERS[{optimizer!r}](model)
    rmod = pyrannc.RaNNCModule(model, opt)
    before = rmod.resumed_step
    _train(rmod, opt, 6, 9)
    torch.save({{"before": before, "after": rmod.resumed_step, "state": rmod.state_dict(),
                "stages": [list(s.devices) for s in rmod.deployment.stages]}}, {out!r})
""")


def test_checkpoint_now_and_its_faults(checkpoint_env, tmp_path, monkeypatch, clean):
    _set_plan_config(monkeypatch, (2, 1, 2), "1f1b")
    torch.manual_seed(0)
    model = CASE.make()
    ref = ref_copy(model)
    opt, ref_opt = OPTIMIZERS["adam"](model), OPTIMIZERS["adam"](ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    with pytest.raises(RuntimeError, match="no job yet"):
        rmod.checkpoint()
    _train(rmod, opt, 0, 2)
    _train(ref, ref_opt, 0, 2)
    info = rmod.checkpoint()
    assert info.committed and info.step == 2 and info.bytes > 0 and info.blocked_s >= 0
    async_info = rmod.checkpoint(wait=False)  # the same step again: replaced as one commit
    assert async_info.step == 2
    _train(rmod, opt, 2, 3)
    _train(ref, ref_opt, 2, 3)
    assert rmod.checkpoint().step == 3  # waits for the write in flight first

    # The checkpoint directory becomes unwritable mid-run: the job keeps training, the write
    # fails with a status naming the path, and the earlier checkpoints stay usable.
    aside = tmp_path / "aside"
    os.rename(checkpoint_env, aside)
    checkpoint_env.write_text("not a directory")
    with pytest.raises(RanncError) as failed:
        rmod.checkpoint()
    assert str(checkpoint_env) in str(failed.value)
    _train(rmod, opt, 3, 4)
    _train(ref, ref_opt, 3, 4)
    _check_params(rmod, ref, "trained on after the failed write")
    checkpoint_env.unlink()
    os.rename(aside, checkpoint_env)
    assert [c.step for c in rmod.checkpoints()] == [2, 3]
    pyrannc.clear()

    # Resuming: a step that does not exist, a damaged file, a checkpoint of another model.
    def resume(step, make=CASE.make):
        monkeypatch.setenv("RANNC_RESUME", step)
        module = make()
        rmod = pyrannc.RaNNCModule(module, OPTIMIZERS["adam"](module))
        try:
            return CASE.loss(rmod, CASE.batch(0))
        finally:
            pyrannc.clear()

    with pytest.raises(RanncError) as missing:
        resume("9")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert "resume=9" in str(missing.value) and "steps 2, 3" in str(missing.value)

    with pytest.raises(RanncError) as other_model:
        resume("latest", lambda: DeepMLP(hidden=32))  # same names, other shapes
    assert other_model.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "another model" in str(other_model.value)

    step_dir = checkpoint_env / "ckpt-test" / "step-0000000003"
    tensor_file = step_dir / "daemon-0.pt"
    data = bytearray(tensor_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(RanncError) as damaged:
        resume("latest")
    assert damaged.value.code == grpc.StatusCode.DATA_LOSS
    assert "daemon-0.pt" in str(damaged.value)

    with pytest.raises(RanncError, match="checkpoint_dir"):
        monkeypatch.delenv("RANNC_CHECKPOINT_DIR")
        resume("latest")


_KILLED_CLIENT = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import torch, pyrannc
    from test_pipeline_conformance import MODELS
    case = MODELS["mlp"]
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rmod = pyrannc.RaNNCModule(model, opt)
    start = rmod.resumed_step or 0
    print("start", start, flush=True)
    for step in range(start, {steps}):
        case.loss(rmod, case.batch(step)).backward()
        opt.step()
        opt.zero_grad()
        print("step", step + 1, flush=True)
        time.sleep(0.02)
    torch.save(rmod.state_dict(), {out!r})
    print("done", flush=True)
""")


def _run_until(daemon, env, script, kill_after_step, stall_kill):
    """Runs the client script against `daemon`; SIGKILLs the daemon once the client reports
    `kill_after_step` (or, with stall_kill, once a checkpoint write is in progress). Returns
    whether the client finished."""
    client = subprocess.Popen([sys.executable, "-c", script],
                              env=dict(env, RANNC_DAEMON=daemon.address),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = False
    for line in client.stdout:
        words = line.split()
        if words[:1] == ["step"] and int(words[1]) >= kill_after_step and not killed:
            if stall_kill:
                # Wait until a write is between its tensor files and its manifest.
                job_dir = os.path.join(env["RANNC_CHECKPOINT_DIR"], env["RANNC_JOB"])
                deadline = time.monotonic() + 60
                while not (os.path.isdir(job_dir) and any(
                        n.startswith(".step-") and ".tmp-" in n and os.path.isfile(os.path.join(
                            job_dir, n, "daemon-0.pt")) for n in os.listdir(job_dir))):
                    assert time.monotonic() < deadline, "no checkpoint write began"
                    time.sleep(0.01)
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait()
            killed = True
    client.wait(timeout=120)
    if not killed:
        assert client.returncode == 0, client.stderr.read()
    return client.returncode == 0 and not killed


def test_sigkill_and_restart_resume_bitwise(tmp_path, monkeypatch, clean):
    steps = 40
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_CHECKPOINT_DIR=str(ckpt),
               RANNC_JOB="killed", RANNC_CHECKPOINT_EVERY="5", RANNC_RESUME="latest",
               RANNC_CALL_RETRY_TIMEOUT="0",  # a killed daemon fails the client at once
               RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="1", RANNC_PIPELINE_NUM="2")
    tests = os.path.dirname(os.path.abspath(__file__))

    # The uninterrupted run, on the same plan (checkpointing does not change the numbers).
    whole_out = str(tmp_path / "whole.pt")
    daemon = DaemonProcess("--devices", "cpu:2")
    try:
        script = _KILLED_CLIENT.format(tests=tests, steps=steps, out=whole_out)
        assert _run_until(daemon, dict(env, RANNC_JOB="whole"), script, steps + 1, False)
    finally:
        daemon.stop()

    out = str(tmp_path / "resumed.pt")
    script = _KILLED_CLIENT.format(tests=tests, steps=steps, out=out)
    rng = random.Random(20261203)
    kills = sorted(rng.sample(range(6, steps - 2), 3))
    runs = 0
    # A kill at a random step (at any point of a step or of a checkpoint's write), one while a
    # write is stalled between its tensor files and its manifest, then a run to the end.
    plan = [(k, False) for k in kills] + [(12, True), (steps + 1, False)]
    for kill_after, stall in plan:
        extra = ("--devices", "cpu:2", "--log-level", "warn")
        daemon_env = {"RANNC_TEST_CHECKPOINT_STALL_MS": "3000"} if stall else {}
        os.environ.update(daemon_env)
        try:
            daemon = DaemonProcess(*extra)
        finally:
            for k in daemon_env:
                os.environ.pop(k)
        try:
            finished = _run_until(daemon, env, script, kill_after, stall)
        finally:
            if daemon.proc.poll() is None:
                daemon.stop()
        runs += 1
        if finished:
            break
    assert finished and runs == len(plan), f"{runs} starts for {len(plan)} planned"
    whole, resumed = torch.load(whole_out), torch.load(out)
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), f"{name} differs after SIGKILLs at {kills}"


_DURABLE_CLIENT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch, pyrannc
    from test_checkpoints import CASE, OPTIMIZERS, _train
    torch.manual_seed({seed})
    model = CASE.make()
    opt = OPTIMIZERS["adam"](model)
    rmod = pyrannc.RaNNCModule(model, opt)
    start = rmod.resumed_step or 0
    _train(rmod, opt, start, {last})
    torch.save({{"start": start, "resumed": rmod.resumed_step, "state": rmod.state_dict()}},
               {out!r})
    os._exit(0)  # gone without deleting its job, as a client that crashed
""")


def _jobs(stub):
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    return {j.name: j for j in stub.ListJobs(pb.Empty(), timeout=10).jobs}


def test_durable_jobs_survive_an_expired_lease_and_a_restart(tmp_path, monkeypatch, clean):
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc

    state_dir = str(tmp_path / "state")
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               RANNC_JOB="durable", RANNC_CHECKPOINT_EVERY="2", RANNC_JOB_LEASE="1",
               RANNC_CALL_RETRY_TIMEOUT="0")
    env.pop("RANNC_RESUME", None)
    tests = os.path.dirname(os.path.abspath(__file__))

    def run_client(daemon, seed, last, out):
        script = _DURABLE_CLIENT.format(tests=tests, seed=seed, last=last, out=out)
        done = subprocess.run([sys.executable, "-c", script],
                              env=dict(env, RANNC_DAEMON=daemon.address), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr + daemon.output()
        return torch.load(out)

    def wait_state(stub, state, steps):
        deadline = time.monotonic() + 30
        while True:
            job = _jobs(stub).get("durable")
            if job is not None and job.state == state and job.steps == steps:
                return job
            assert time.monotonic() < deadline, f"durable: {job}"
            time.sleep(0.1)

    daemon = DaemonProcess("--devices", "cpu:2", "--state-dir", state_dir)
    try:
        # 5 steps (checkpoints at 2 and 4), then the client is gone: at the lease's end the job
        # writes a last checkpoint (step 5) and is suspended, holding no devices.
        first = run_client(daemon, 0, 5, str(tmp_path / "first.pt"))
        assert first["start"] == 0 and first["resumed"] is None
        stub = rpc.TrainingServiceStub(daemon.conn.channel)
        suspended = wait_state(stub, pb.SUSPENDED, 5)
        assert not any(suspended.device_bytes)
    finally:
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        daemon.stop()

    # A restart with the same --state-dir lists it suspended; a client of the same name (and
    # checkpoint directory) attaches to it, without RANNC_RESUME: it goes on from step 5.
    daemon = DaemonProcess("--devices", "cpu:2", "--state-dir", state_dir)
    try:
        stub = rpc.TrainingServiceStub(daemon.conn.channel)
        job_id = wait_state(stub, pb.SUSPENDED, 5).job_id
        second = run_client(daemon, 1, 8, str(tmp_path / "second.pt"))
        assert second["start"] == 5 and second["resumed"] == 5
        torch.manual_seed(0)
        ref = CASE.make()
        ref_opt = OPTIMIZERS["adam"](ref)
        _train(ref, ref_opt, 0, 8)
        for name, value in ref.state_dict().items():
            assert_close(second["state"][name], value, f"attached by name: {name}")

        # Gone again: suspended at step 8 (its checkpoint of step 8 is the last). `rannc resume`
        # brings it back under its id, without a client; DeleteJob ends it and its record.
        suspended = wait_state(stub, pb.SUSPENDED, 8)
        assert suspended.job_id != job_id
        cli = built_binary("rannc", "RANNC_CLI_BIN", "client")
        listed = subprocess.run([cli, "jobs", "--daemon", daemon.address], capture_output=True,
                                text=True, timeout=60)
        assert "suspended" in listed.stdout, listed.stdout + listed.stderr
        written = subprocess.run([cli, "checkpoints", "durable", "--daemon", daemon.address],
                                 capture_output=True, text=True, timeout=60)
        assert "step-0000000008" in written.stdout, written.stdout + written.stderr
        resumed = subprocess.run([cli, "resume", "durable", "--daemon", daemon.address],
                                 capture_output=True, text=True, timeout=120)
        assert resumed.returncode == 0, resumed.stderr + daemon.output()
        assert f"resumed job {suspended.job_id} at step 8" in resumed.stdout, resumed.stdout
        assert _jobs(stub)["durable"].state == pb.DEPLOYED
        again = subprocess.run([cli, "resume", "durable", "--daemon", daemon.address],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "runs already" in again.stderr, again.stderr
        stub.DeleteJob(pb.JobRef(job_id=suspended.job_id), timeout=30)
        assert "durable" not in _jobs(stub)
        assert not os.listdir(os.path.join(state_dir, "jobs"))
    finally:
        daemon.stop()
