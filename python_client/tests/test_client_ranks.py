"""Several client processes ("client ranks") training one job, against a real ranncd; and a
client killed mid-step, whose job stays usable and deletable.

Each rank is a separate Python process (as under torchrun or mpirun) with RANNC_JOB,
RANNC_CLIENT_RANK and RANNC_CLIENT_WORLD set; rank 0 creates the job and the others join it.
With gather_inputs=True the ranks' batches are concatenated, so two ranks with half a batch each
must train exactly like one PyTorch model on the whole batch; with gather_inputs=False rank 0's
batch is used. Tolerance: conftest.assert_close (rtol 1e-5, atol 1e-6).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import CLIENT_ROOT, DaemonProcess, assert_close
import models
from pyrannc import _codec
from pyrannc.proto.rannc.v1 import training_pb2 as pb

STEPS = 3

_RANK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    gather = {gather!r}
    rank = pyrannc.get_rank()
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt, gather_inputs=gather)
    losses = []
    for step in range({steps}):
        x, y = models.mlp_batch(step, batch=8)
        if gather:
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        elif rank != 0:
            x, y = x * 0 + 7, y  # ignored: rank 0's inputs are used
        loss = rmod(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    pyrannc.barrier()
    # RaNNC's rank0_only=True (the default): only rank 0 gets the state.
    assert (len(rmod.state_dict()) > 0) == (rank == 0)
    state = {{k: v.tolist() for k, v in rmod.state_dict(rank0_only=False).items()}}
    json.dump({{"losses": losses, "state": state, "devices": rmod._job.devices}},
              open({out!r} + str(rank), "w"))
""")


def _run_ranks(tmp_path, daemon, gather, world=2, timeout_s=300, ranks=None, addresses=None,
               template=_RANK_SCRIPT, job=None, **fields):
    """Starts the ranks (all of them, or `ranks`) of `template` (formatted with tests, gather,
    steps, out and `fields`), each talking to `daemon`, or rank r to `addresses[r]`; returns their
    output path prefix and (exit code, stderr) per rank."""
    out = str(tmp_path / "rank")
    script = template.format(tests=os.path.dirname(os.path.abspath(__file__)), gather=gather,
                             steps=STEPS, out=out, **fields)
    procs = []
    for rank in (range(world) if ranks is None else ranks):
        address = daemon.address if addresses is None else addresses[rank]
        env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=address,
                   RANNC_JOB=job or f"ranks-{gather}-{world}", RANNC_CLIENT_RANK=str(rank),
                   RANNC_CLIENT_WORLD=str(world), RANNC_CLIENT_TIMEOUT=str(timeout_s))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        results.append((p.returncode, stderr))
    return out, results


def _reference(gather):
    torch.manual_seed(0)
    ref = models.MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = models.mlp_batch(step, batch=8)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, ref.state_dict()


@pytest.fixture(scope="module")
def daemon(pyrannc_daemon):  # pyrannc_daemon sets RANNC_DAEMON_BIN
    d = DaemonProcess("--devices", "cpu:2")
    yield d
    d.stop()


@pytest.mark.parametrize("gather", [True, False])
def test_two_ranks_train_like_one_model(tmp_path, daemon, gather):
    out, results = _run_ranks(tmp_path, daemon, gather)
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr}"
    # gather: two halves of each batch = one model on the whole batch; otherwise rank 0's batch,
    # which is the whole batch here too.
    _check_ranks(out, gather)


def _check_ranks(out, gather, what=""):
    """Each rank's losses and final state (the JSON its script wrote) against _reference."""
    losses, state = _reference(gather)
    for rank in range(2):
        got = json.load(open(out + str(rank)))
        for step in range(STEPS):
            assert_close(torch.tensor(got["losses"][step]), losses[step],
                         f"rank {rank} loss at step {step}{what}")
        for k, v in state.items():
            assert_close(torch.tensor(got["state"][k], dtype=v.dtype), v, f"rank {rank} {k}{what}")


def test_a_missing_rank_is_a_clear_error(tmp_path, daemon):
    # Only rank 0 of 2 comes: its first forward waits for rank 1, then fails.
    out, results = _run_ranks(tmp_path, daemon, True, timeout_s=3, ranks=[0])
    code, stderr = results[0]
    assert code != 0
    assert "DEADLINE_EXCEEDED" in stderr and "client rank(s) 1 of 2" in stderr, stderr


_REUSE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    rank = pyrannc.get_rank()
    if {load!r}:
        def no_trace(*args, **kwargs):
            raise AssertionError("traced although the deployment file holds the trace")
        torch.jit.trace = no_trace
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt, load_deployment={path!r} if {load!r} else None)
    losses = []
    for step in range({steps}):
        x, y = models.mlp_batch(step, batch=8)
        loss = rmod(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    pyrannc.barrier()
    if not {load!r} and rank == 0:
        rmod.save_deployment({path!r})
    state = {{k: v.tolist() for k, v in rmod.state_dict(rank0_only=False).items()}}
    json.dump({{"losses": losses, "state": state}}, open({out!r} + str(rank), "w"))
""")


def test_two_ranks_reuse_a_saved_trace(tmp_path, daemon):
    """Two ranks started from a deployment the two-rank job saved: neither traces the model
    (rank 0 sends the graph from the file with every tensor, rank 1 needs only the outputs'
    structure), and the job trains like one model on the whole batch."""
    path = str(tmp_path / "ranks.deployment")
    for load in (False, True):
        out, results = _run_ranks(tmp_path, daemon, True, template=_REUSE_SCRIPT,
                                  job=f"reuse-{load}", path=path, load=load)
        for rank, (code, stderr) in enumerate(results):
            assert code == 0, f"rank {rank} (load={load}) failed:\n{stderr}"
        _check_ranks(out, True, f", load={load}")


_ACCUMULATE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    rank = pyrannc.get_rank()
    pyrannc.sync_params_on_init({sync!r})
    torch.manual_seed(rank)  # each rank starts from its own values; the job from rank 0's
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt)
    pyrannc.delay_grad_allreduce(True)
    losses, joined = [], None
    for step in range({steps}):
        for micro in range(2):
            x, y = models.mlp_batch(10 * step + micro, batch=8)
            loss = rmod(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            if joined is None:  # the local model, as the first forward (the join) left it
                joined = {{k: v.tolist() for k, v in model.state_dict().items()}}
            (loss / 2).backward()
            losses.append(float(loss))
        rmod.allreduce_grads()
        opt.step()
        opt.zero_grad()
    pyrannc.barrier()
    state = {{k: v.tolist() for k, v in rmod.state_dict(rank0_only=False).items()}}
    json.dump({{"losses": losses, "joined": joined, "state": state}},
              open({out!r} + str(rank), "w"))
""")


@pytest.mark.parametrize("sync", [True, False])
def test_two_ranks_accumulate_and_sync_params_on_init(tmp_path, daemon, sync):
    """Two ranks with half of each batch accumulate two batches per step (delay_grad_allreduce,
    then a collective allreduce_grads): one PyTorch model on the whole batches. A joining rank's
    local model becomes rank 0's with sync_params_on_init(True) and stays its own without."""
    out, results = _run_ranks(tmp_path, daemon, True, template=_ACCUMULATE_SCRIPT,
                              job=f"accumulate-{sync}", sync=sync)
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr}"
    torch.manual_seed(0)
    ref = models.MLP()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(1)
    own = models.MLP().state_dict()  # rank 1's own initial values
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        for micro in range(2):
            x, y = models.mlp_batch(10 * step + micro, batch=8)
            loss = ref(x, y)
            (loss / 2).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    for rank in range(2):
        got = json.load(open(out + str(rank)))
        for i, loss in enumerate(losses):
            assert_close(torch.tensor(got["losses"][i]), loss, f"rank {rank} loss {i}")
        for k, v in ref.state_dict().items():
            assert_close(torch.tensor(got["state"][k], dtype=v.dtype), v, f"rank {rank} {k}")
        expected = initial if rank == 0 or sync else own
        for k, v in expected.items():
            assert_close(torch.tensor(got["joined"][k], dtype=v.dtype), v,
                         f"rank {rank}'s local {k} after joining")


_TRAIN_FOREVER = textwrap.dedent("""
    import sys, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    step = 0
    while True:
        x, y = models.mlp_batch(step, batch=8)
        rmod(x, y).backward()
        opt.step()
        step += 1
        if step == 3:
            print(rmod._job.id, flush=True)
""")


def test_a_client_killed_mid_step_leaves_a_job_that_can_be_resumed_or_deleted(daemon):
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon.address,
               RANNC_JOB="killed")
    env.pop("RANNC_CLIENT_RANK", None)
    env.pop("RANNC_CLIENT_WORLD", None)
    client = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_FOREVER.format(
            tests=os.path.dirname(os.path.abspath(__file__)))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = client.stdout.readline().strip()
    assert job_id, client.stderr.read()
    client.kill()  # SIGKILL while it trains: likely in the middle of an RPC
    client.wait(timeout=30)
    stub = daemon.conn.stub
    # Resumable: its state reads back and another forward and backward run.
    param = stub.GetParam(pb.GetParamRequest(job_id=job_id, name="l1.weight"), timeout=30)
    assert param.has_value
    x, y = models.mlp_batch(0, batch=8)
    out = stub.Forward(pb.ForwardRequest(job_id=job_id, inputs=[_codec.encode(x),
                                                                _codec.encode(y)],
                                         requires_grad=True), timeout=60)
    assert len(out.outputs) == 1
    stub.Backward(pb.BackwardRequest(job_id=job_id, grads=[pb.OutputGrad(
        output_index=0, grad=_codec.encode(torch.ones(())))]), timeout=60)
    # Deletable.
    stub.DeleteJob(pb.JobRef(job_id=job_id), timeout=30)
    assert job_id not in {j.job_id for j in stub.ListJobs(pb.Empty(), timeout=10).jobs}
