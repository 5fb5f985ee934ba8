"""RANNC_SAVE_JOB (pyrannc._save_job) and benchmarks/job_bench, against the real ranncd: a job
pyrannc saved and job_bench then trains in one process, with no client and no gRPC, is the job
the daemon trained. Its plan is the one loaded from the deployment file, and its losses are the
client's, bitwise, step after step (the same plan on the same devices, the same batch each step,
the same AdamW). The model has a tensor of more than a MiB, so the saved job carries a
shared-memory file. A folder without a saved job is a clear error.
"""

import json
import os
import subprocess

import pytest
import torch

import pyrannc
import models
from conftest import built_binary, daemon_device_names

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")

STEPS = 3


def _gpt():
    torch.manual_seed(11)
    # A 2 MiB embedding: it travels apart from the archive, through shared memory.
    return models.TinyGPT(vocab=8192, d=64, heads=2, layers=1)


def _batch():
    return models.gpt_batch(0, batch=4, seq=8, vocab=8192)


def _bench(job_dir, steps=STEPS, *extra):
    cmd = [built_binary("job_bench", "RANNC_JOB_BENCH_BIN", "benchmarks"), str(job_dir),
           "--devices", os.environ["RANNC_DEVICES"], "--warmup", "0", "--steps", str(steps),
           *extra]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          check=False, timeout=300)


def test_saved_job_trains_in_process_as_through_the_daemon(tmp_path, monkeypatch):
    replicas = min(2, len(daemon_device_names()))  # data-parallel where there are 2 devices
    monkeypatch.setenv("RANNC_PARTITION_NUM", "1")
    monkeypatch.setenv("RANNC_REPLICA_NUM", str(replicas))
    plan = tmp_path / "gpt.deployment"
    model = _gpt()
    rmod = pyrannc.RaNNCModule(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rmod(*_batch())
    rmod.save_deployment(str(plan))
    pyrannc.clear()

    job_dir = tmp_path / "job"
    monkeypatch.setenv("RANNC_SAVE_JOB", str(job_dir))
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rmod = pyrannc.RaNNCModule(model, opt, load_deployment=str(plan))
    losses = []
    for _ in range(STEPS):
        loss = rmod(*_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    summary = rmod.plan_summary
    pyrannc.clear()
    monkeypatch.delenv("RANNC_SAVE_JOB")

    names = sorted(os.listdir(job_dir))
    assert {"job.pb", "model.pt", "forward.pb"} <= set(names), names
    assert any(n.startswith("rannc-") and n.endswith("-bulk") for n in names), names

    done = _bench(job_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    bench = json.loads(done.stdout.strip().splitlines()[-1])
    assert "loaded from a file" in bench["plan_summary"], bench["plan_summary"]
    assert bench["plan_summary"].split(";")[0] == summary.split(";")[0]
    assert len(bench["devices"]) == replicas
    assert len(bench["step_s"]) == STEPS
    # float32 losses, printed by job_bench with every digit: equal, not close.
    assert bench["loss_first"] == losses[0], (bench["loss_first"], losses)
    assert bench["loss_last"] == losses[-1], (bench["loss_last"], losses)
    assert losses[-1] < losses[0]

    # --profile: two more steps under Kineto, their trace written (the GPU's kernels on CUDA
    # devices, else the host's operators) where LibTorch has Kineto; a clear error where not.
    trace = tmp_path / "steps.trace.json"
    done = _bench(job_dir, 1, "--profile", str(trace), "--profile-steps", "2")
    if done.returncode == 0:
        bench = json.loads(done.stdout.strip().splitlines()[-1])
        assert bench["profile"] == str(trace) and bench["profile_steps"] == 2
        with open(trace, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        cuda = bench["devices"][0].startswith("cuda")
        wanted = "kernel" if cuda else "cpu_op"
        assert sum(e.get("cat") == wanted for e in events) >= 2, [e.get("cat") for e in events]
    else:
        # Only a LibTorch without Kineto may refuse: Debian's 1.13, as the tests' PyTorch is.
        assert not torch.autograd.kineto_available(), done.stderr[-3000:]
        assert done.returncode == 1 and "Kineto" in done.stderr, done.stderr[-3000:]
        assert not trace.exists()


def test_job_bench_without_a_saved_job_says_what_is_missing(tmp_path):
    done = _bench(tmp_path)
    assert done.returncode == 1
    assert "job.pb" in done.stderr, done.stderr
