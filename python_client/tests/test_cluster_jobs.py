"""Jobs over a cluster: two or three ranncd processes with two devices each form a cluster on
loopback (--peers), a pyrannc client talks to one of them, and the job is planned over all their
devices and trained with a stage per daemon. It must train exactly like one PyTorch model
(conftest.assert_close: rtol 1e-5, atol 1e-6). A daemon SIGKILLed mid-training fails the job
at once with UNAVAILABLE naming it, and the others go on.

With a real etcd on loopback (Debian's etcd-server), the daemons also run with
--cluster-store: each registers under its lease, they see each other UP (and a stopped one
DOWN, as soon as its lease is revoked) through etcd instead of heartbeats, and the job's engines meet in etcd instead of the
store their leading daemon serves.

RANNC_CLUSTER_DEVICES: each daemon's --devices (default cpu:2; two devices each). On a GPU
machine, e.g. cuda:0/2: every daemon holds two shares of GPU 0 and the stages exchange CUDA
tensors across the daemons."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import grpc
import pytest
import torch

from conftest import (CLIENT_ROOT, DaemonProcess, assert_close, built_binary, daemon_binary,
                      free_ports)
import models
from pyrannc.proto.rannc.v1 import cluster_pb2
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc

STEPS = 3
CLUSTER_DEVICES = os.environ.get("RANNC_CLUSTER_DEVICES", "cpu:2")

_CLIENT = textwrap.dedent("""
    import json, sys, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rmod = pyrannc.RaNNCModule(model, opt)
    losses = []
    for step in range({steps}):
        x, y = models.mlp_batch(step, batch=8)
        loss = rmod(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    grads_seen = {{}}
    state = {{k: v.tolist() for k, v in rmod.state_dict().items()}}
    d = rmod.deployment
    json.dump({{"losses": losses, "state": state, "devices": rmod._job.devices,
               "stages": [list(s.devices) for s in d.stages]}}, open({out!r}, "w"))
""")


ETCD = os.environ.get("RANNC_ETCD_BIN", "/usr/bin/etcd")


class EtcdProcesses:
    """`members` etcd processes on loopback ports forming one cluster; `url` names them all.
    `tls` (cert, key, ca): clients must speak TLS and present a certificate of that CA."""

    def __init__(self, tmp_path, members, tls=None):
        if not os.access(ETCD, os.X_OK):
            pytest.skip(f"SKIPPED LOUDLY: {ETCD} is missing (Debian's etcd-server; "
                        "deploy/setup.sh installs it)")
        # A member that exits before it answers most often lost its port to another process
        # between _free_ports and its bind: start the whole cluster again on other ports.
        for attempt in range(1, 5):
            exited = self._start(tmp_path / f"etcd-attempt{attempt}", members, tls)
            if exited is None:
                break
            print(f"etcd start {attempt}: member {exited} exited before it answered; starting "
                  f"again on other ports. Its log:\n{open(self.logs[exited]).read()[-1000:]}")
            self.stop()
        else:
            raise AssertionError(f"etcd did not start in 4 attempts (logs under {tmp_path})")
        self.url = "etcd://" + ",".join(self.clients)

    def _start(self, tmp_path, members, tls):
        """Spawns the members on fresh ports and waits until each answers; None, or the index
        of a member that exited first."""
        tmp_path.mkdir()
        ports = free_ports(2 * members)
        self.clients = [f"127.0.0.1:{p}" for p in ports[:members]]
        scheme = "https" if tls else "http"
        tls_flags = ["--cert-file", tls[0], "--key-file", tls[1], "--trusted-ca-file", tls[2],
                     "--client-cert-auth"] if tls else []
        ctl_flags = ["--cert", tls[0], "--key", tls[1], "--cacert", tls[2]] if tls else []
        peers = [f"http://127.0.0.1:{p}" for p in ports[members:]]
        initial = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
        self.procs, self.logs = [], []
        for i in range(members):
            log_path = tmp_path / f"etcd-{i}.log"
            self.logs.append(log_path)
            self.procs.append(subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(tmp_path / f"etcd-{i}"),
                 "--listen-client-urls", f"{scheme}://{self.clients[i]}",
                 "--advertise-client-urls", f"{scheme}://{self.clients[i]}",
                 "--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--logger", "zap", "--log-outputs", "stderr", *tls_flags],
                stdout=open(log_path, "w"), stderr=subprocess.STDOUT))
        deadline = time.time() + 30
        for i, client in enumerate(self.clients):
            while subprocess.run(["etcdctl", "--endpoints", client, *ctl_flags, "endpoint",
                                  "health"],
                                 env=dict(os.environ, ETCDCTL_API="3"),
                                 capture_output=True).returncode != 0:
                if self.procs[i].poll() is not None:
                    return i
                assert time.time() < deadline, open(self.logs[i]).read()
                time.sleep(0.1)
        return None

    def leader(self):
        """The index of the member that leads the etcd cluster now."""
        done = subprocess.run(["etcdctl", "--endpoints", ",".join(self.clients), "endpoint",
                               "status", "-w", "json"], env=dict(os.environ, ETCDCTL_API="3"),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        for i, s in enumerate(status):
            if s["Status"]["header"]["member_id"] == s["Status"]["leader"]:
                return self.clients.index(s["Endpoint"])
        raise AssertionError(f"no etcd leader in {status}")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def etcd(tmp_path):
    """A one-member etcd on loopback ports; its client URL."""
    members = EtcdProcesses(tmp_path, 1)
    yield members.url
    members.stop()


@pytest.fixture
def etcd3(tmp_path):
    """A three-member etcd on loopback ports."""
    members = EtcdProcesses(tmp_path, 3)
    yield members
    members.stop()


def _etcd_keys(url, prefix):
    """The keys under `prefix`, read with etcdctl."""
    done = subprocess.run(
        ["etcdctl", "--endpoints", url[len("etcd://"):], "get", "--prefix", "--keys-only",
         prefix], env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, text=True,
        timeout=30)
    assert done.returncode == 0, done.stderr
    return [k for k in done.stdout.split("\n") if k]


@pytest.fixture(params=[2], ids=lambda n: f"{n}daemons")
def cluster(request, pyrannc_daemon):  # pyrannc_daemon: RANNC_DAEMON_BIN and a clean config
    yield from _start_cluster(request.param)


def _start_cluster(count, store=None, discover=False, flags=()):
    """`count` daemons (with --cluster-store `store`, if given), once every one is UP in every
    other's view; stopped when the generator closes. `discover`: no --peers, the daemons find
    each other in the store."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(count)]
    logs, procs = [], []
    for address in peers:
        log = tempfile.NamedTemporaryFile(prefix="ranncd-", suffix=".log", delete=False)
        logs.append(log)
        procs.append(subprocess.Popen(
            [daemon_binary(), "--listen", address, "--devices", CLUSTER_DEVICES,
             "--heartbeat-interval", "200ms", "--peer-timeout", "5s",
             "--profile-cache", "none", "--links", "p2p=5GB/s,allreduce=2:3GB/s;4:2GB/s"]
            + ([] if discover else ["--peers", ",".join(peers)])
            + (["--cluster-store", store] if store else []) + list(flags),
            stdout=log, stderr=subprocess.STDOUT))
    deadline = time.time() + 60
    names = []  # each daemon's device names
    for address in peers:
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
        while True:
            try:
                info = stub.GetInfo(pb.GetInfoRequest(), timeout=2)
                if len(info.cluster) == count and all(
                        m.state == cluster_pb2.MEMBER_UP for m in info.cluster):
                    names.append([d.name for d in info.devices])
                    assert len(names[-1]) == 2, (
                        f"RANNC_CLUSTER_DEVICES={CLUSTER_DEVICES!r} gives {address} the devices "
                        f"{names[-1]}; these tests need two per daemon")
                    break
            except grpc.RpcError:
                pass
            assert time.time() < deadline, open(logs[0].name).read()
            time.sleep(0.1)
    yield peers, logs, procs, names
    # All at once: with --cluster-store, a daemon stopped alone hands its jobs to the others.
    for p in procs:
        if p.poll() is None:
            p.terminate()
    # Kubernetes' default grace period: a daemon may be finishing an etcd call (5 s each) when
    # the signal comes.
    for p in procs:
        p.wait(timeout=30)
    for log in logs:
        if not os.environ.get("RANNC_KEEP_LOGS"):
            os.unlink(log.name)


@pytest.mark.parametrize("cluster", [2, 3], indirect=True, ids=["2daemons", "3daemons"])
def test_a_job_spans_the_daemons_and_trains_like_pytorch(tmp_path, cluster):
    peers, logs, _, names = cluster
    out = str(tmp_path / "client.json")
    # One stage per daemon, its two replicas on that daemon's two devices.
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0],
               RANNC_PARTITION_NUM=str(len(peers)), RANNC_REPLICA_NUM="2",
               RANNC_PIPELINE_NUM="2")
    script = _CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)), steps=STEPS,
                            out=out)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr + "\n" + "".join(open(l.name).read() for l in logs)
    got = json.load(open(out))
    # Every daemon's two devices.
    assert sorted(got["devices"]) == sorted(f"{a}/{n}" for a, own in zip(peers, names)
                                            for n in own)
    assert sorted(d for s in got["stages"] for d in s) == list(range(2 * len(peers)))

    _assert_trains_like_pytorch(got)


def test_a_job_meets_in_etcd_with_cluster_store_and_trains_like_pytorch(
        tmp_path, etcd, pyrannc_daemon):
    # Two daemons with --cluster-store: each registers under its lease, they see each other UP
    # through etcd, the job's engines meet in etcd (their keys are there while it runs), and
    # training is exact.
    gen = _start_cluster(2, etcd)
    peers, logs, procs, names = next(gen)
    try:
        assert sorted(_etcd_keys(etcd, "/rannc/members/")) == sorted(
            f"/rannc/members/{p}" for p in peers)
        out = str(tmp_path / "client.json")
        env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0],
                   RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2")
        script = _CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)), steps=STEPS,
                                out=out)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300)
        logs_text = "".join(open(l.name).read() for l in logs)
        assert done.returncode == 0, done.stderr + "\n" + logs_text
        assert "cluster store: etcd at" in logs_text
        got = json.load(open(out))
        assert sorted(d for s in got["stages"] for d in s) == [0, 1, 2, 3]
        # The rendezvous of the job's groups: in etcd, not in the leading daemon's store.
        assert _etcd_keys(etcd, "/rannc/store/"), "no rendezvous keys in etcd"
        _assert_trains_like_pytorch(got)
        # Membership is etcd's: a daemon that stops revokes its lease, and the other, which
        # heartbeats nobody, sees its member key deleted and reports it DOWN at its next round,
        # well within the peer timeout (5 s).
        procs[1].terminate()
        procs[1].wait(timeout=15)
        stopped = time.monotonic()
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(peers[0]))
        while True:
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
            if {m.address: m.state for m in info.cluster}[peers[1]] == cluster_pb2.MEMBER_DOWN:
                break
            assert time.monotonic() - stopped < 4, open(logs[0].name).read()
            time.sleep(0.1)
        assert (f"/rannc/members/{peers[1]}) was deleted" in open(logs[0].name).read()), \
            open(logs[0].name).read()
    finally:
        next(gen, None)  # the teardown: each daemon is stopped (SIGTERM)
    # A daemon that stops revokes its lease: its keys go at once.
    assert _etcd_keys(etcd, "/rannc/") == []


def _assert_trains_like_pytorch(got):
    """`got`: what _CLIENT wrote; the same training in PyTorch must give the same."""
    torch.manual_seed(0)
    ref = models.MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = models.mlp_batch(step, batch=8)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert_close(torch.tensor(got["losses"][step]), loss.detach(), f"loss at step {step}")
    for k, v in ref.state_dict().items():
        assert_close(torch.tensor(got["state"][k], dtype=v.dtype), v, k)


_TRAIN_UNTIL_ERROR = textwrap.dedent("""
    import sys, time, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    step = 0
    try:
        while True:
            x, y = models.mlp_batch(step, batch=8)
            loss = rmod(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step == 3:
                print("TRAINING", flush=True)
    except pyrannc.RanncError as err:
        print("ERROR", err.code, err, flush=True)
        sys.exit(3)
""")


def test_a_lost_daemon_fails_its_jobs_promptly_and_the_leader_goes_on(tmp_path, cluster):
    # ... and serves new jobs on the daemons that are left.
    peers, logs, procs, names = cluster
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0],
               RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2",
               RANNC_DEFER_OPS="0")
    client = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_UNTIL_ERROR.format(
            tests=os.path.dirname(os.path.abspath(__file__)))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "TRAINING", client.stderr.read()
    killed = time.monotonic()
    procs[1].kill()  # SIGKILL the member daemon mid-training
    stdout, stderr = client.communicate(timeout=60)
    elapsed = time.monotonic() - killed
    assert client.returncode == 3, stdout + stderr
    assert "UNAVAILABLE" in stdout and peers[1] in stdout, stdout
    # Within the peer timeout (5 s) plus slack, never the engine's 120 s transfer timeout.
    print(f"the client failed {elapsed:.1f} s after the SIGKILL")
    assert elapsed < 20, elapsed
    # The leader keeps serving, and reports the member DOWN.
    stub = rpc.TrainingServiceStub(grpc.insecure_channel(peers[0]))
    deadline = time.time() + 15
    while True:
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
        states = {m.address: m.state for m in info.cluster}
        if states[peers[1]] == cluster_pb2.MEMBER_DOWN:
            break
        assert time.time() < deadline, states
        time.sleep(0.2)
    # A new job trains on the daemons that are left, exactly like PyTorch.
    out = str(tmp_path / "after.json")
    script = _CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)), steps=STEPS,
                            out=out)
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr + open(logs[0].name).read()
    got = json.load(open(out))
    assert sorted(got["devices"]) == sorted(names[0]), got["devices"]
    _assert_trains_like_pytorch(got)


_CONFORMANCE = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    import test_pipeline_conformance as tpc
    from conftest import assert_close
    for name, case in tpc.MODELS.items():
        torch.manual_seed(0)
        model = case.make()
        ref = copy.deepcopy(model)
        opt, ref_opt = case.optimizer(model), case.optimizer(ref)
        rmod = pyrannc.RaNNCModule(model, opt)
        for step in range(tpc.STEPS):
            batch = case.batch(step)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, batch)
            ref_loss.backward()
            assert_close(loss.detach(), ref_loss.detach(), f"{{name}} loss at step {{step}}")
            tpc._compare_grads(rmod, ref, step)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for k, v in ref.state_dict().items():
            assert_close(rmod.state_dict()[k], v, f"{{name}} {{k}}")
        assert len({{d.split("/")[0] for d in rmod._job.devices}}) == 2, rmod._job.devices
        pyrannc.clear()
        print("ok", name, flush=True)
""")


def _run_over_two_stages(script, peers, logs, **env):
    """Runs a client `script` (formatted with this directory as `tests` and the `peers`) against
    the first daemon, the plan forced to 2 stages x 2 replicas x 2 micro-batches (a stage per
    daemon), with `env` added; asserts it succeeded and returns its stdout."""
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0],
               RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2", **env)
    done = subprocess.run(
        [sys.executable, "-c", script.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                             peers=peers)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr +
                                  "".join(open(log.name).read() for log in logs))
    return done.stdout


def test_the_runtime_conformance_models_train_like_pytorch_across_daemons(cluster):
    # The four models of test_pipeline_conformance (an MLP, a GPT with a tied embedding, two
    # inputs and a weight used twice, a loss the client computes) with 2 stages x 2 replicas x
    # 2 micro-batches: a stage (with its replicas) per daemon; the tied embedding is held by
    # both daemons.
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_CONFORMANCE, peers, logs)
    assert stdout.split().count("ok") == 4, stdout


def test_two_client_ranks_train_one_job_over_the_cluster(tmp_path, cluster):
    # Two client processes with half a batch each, both talking to the leading daemon: one
    # model on the whole batch, over both daemons' devices.
    import types
    import test_client_ranks as ranks
    peers, logs, _, _ = cluster
    os.environ["RANNC_PARTITION_NUM"] = "2"
    try:
        out, results = ranks._run_ranks(tmp_path, types.SimpleNamespace(address=peers[0]), True)
    finally:
        del os.environ["RANNC_PARTITION_NUM"]
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr}"
    losses, state = ranks._reference(True)
    for rank in range(2):
        got = json.load(open(out + str(rank)))
        assert len({d.split("/")[0] for d in got["devices"]}) == 2, got["devices"]
        for step in range(ranks.STEPS):
            assert_close(torch.tensor(got["losses"][step]), losses[step],
                         f"rank {rank} loss at step {step}")
        for k, v in state.items():
            assert_close(torch.tensor(got["state"][k], dtype=v.dtype), v, f"rank {rank} {k}")


_STATE_OPS = textwrap.dedent("""
    import copy, sys, grpc, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    import test_pipeline_conformance as tpc
    from conftest import assert_close
    from pyrannc.proto.rannc.v1 import training_pb2 as pb
    from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc
    peers = {peers!r}

    def device_bytes():
        # Per daemon: what its devices hold for jobs (the leader's job, the member's part).
        out = []
        for address in peers:
            stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
            out.append(sum(sum(j.device_bytes) for j in stub.ListJobs(pb.Empty(), timeout=10).jobs))
        return out

    case = tpc.MODELS["gpt_tied"]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(5):
        batch = case.batch(step)
        loss = case.loss(rmod, batch)
        loss.backward()
        ref_loss = case.loss(ref, batch)
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss at step {{step}}")
        if step == 1:
            # Gradients pending; both daemons free their devices, and clipping redeploys.
            assert all(b > 0 for b in device_bytes()), device_bytes()
            rmod.undeploy()
            assert device_bytes() == [0, 0], device_bytes()
        norm = rmod.clip_grad_norm(0.2)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
        assert float(ref_norm) > 0.2, ref_norm  # the gradients really are clipped
        assert_close(torch.as_tensor(norm, dtype=ref_norm.dtype), ref_norm,
                     f"norm at step {{step}}")
        tpc._compare_grads(rmod, ref, step)
        if step == 2:
            pyrannc.recreate_all_communicators()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 3:
            state = {{k: v * 0.9 for k, v in ref.state_dict().items()}}
            ref.load_state_dict(state)
            rmod.load_state_dict(state)
        print("ok", step, flush=True)
    assert len({{d.split("/")[0] for d in rmod._job.devices}}) == 2, rmod._job.devices
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)
""")


def test_clip_undeploy_recreate_and_load_state_span_the_daemons(cluster):
    # The GPT with its tied embedding held by both daemons (2 stages x 2 replicas): its norm
    # counted once; undeploy frees both daemons' devices and training resumes exactly;
    # recreate_all_communicators rebuilds every part's; load_state_dict reaches every part.
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_STATE_OPS, peers, logs)
    assert stdout.split().count("ok") == 5, stdout


_ACCUMULATE = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    import test_pipeline_conformance as tpc
    from conftest import assert_close
    case = tpc.MODELS["gpt_tied"]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    pyrannc.delay_grad_allreduce(True)
    for step in range(3):
        for micro in range(3):
            batch = case.batch(10 * step + micro)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, batch)
            ref_loss.backward()
            assert_close(loss.detach(), ref_loss.detach(), f"loss {{micro}} of step {{step}}")
            if micro == 1 and step == 0:
                # Each daemon parks its share of the unreduced gradients and puts it back.
                rmod.undeploy()
            if micro == 1 and step == 1:
                pyrannc.recreate_all_communicators()
        if step == 2:
            tpc._compare_grads(rmod, ref, step)  # the leader reduces on every daemon first
        rmod.allreduce_grads()
        tpc._compare_grads(rmod, ref, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        print("ok", step, flush=True)
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)
""")


_OPTIMIZER_STATE = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    import test_pipeline_conformance as tpc
    from conftest import assert_close
    case = tpc.MODELS["mlp"]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)
    opt, ref_opt = make(model), make(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    def train(m, o, first):
        for step in range(first, first + 2):
            case.loss(m, case.batch(step)).backward()
            o.step()
            o.zero_grad()
    train(rmod, opt, 0)
    train(ref, ref_opt, 0)
    assert len({{d.split("/")[0] for d in rmod._job.devices}}) == 2, rmod._job.devices
    saved, expected = opt.state_dict(), ref_opt.state_dict()
    assert sorted(saved["state"]) == sorted(expected["state"])
    for i, entries in expected["state"].items():
        for key, value in entries.items():
            assert_close(saved["state"][i][key], value, f"{{i}}.{{key}}")
    print("ok gathered", flush=True)
    # Loaded back after more steps: every daemon takes its parameters' state.
    model_state = copy.deepcopy(rmod.state_dict())
    train(rmod, opt, 2)
    rmod.load_state_dict(model_state)
    opt.load_state_dict(copy.deepcopy(saved))
    train(rmod, opt, 2)
    train(ref, ref_opt, 2)
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)
    print("ok loaded", flush=True)
""")


def test_optimizer_state_spans_the_daemons(cluster):
    # An MLP with a stage per daemon (2 stages x 2 replicas), Adam: optimizer.state_dict()
    # gathers every daemon's moments (equal to PyTorch's), and load_state_dict after more steps
    # puts each daemon's back, training then going on as PyTorch's.
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_OPTIMIZER_STATE, peers, logs)
    assert stdout.split().count("ok") == 2, stdout


def test_gradient_accumulation_spans_the_daemons(cluster):
    # delay_grad_allreduce + allreduce_grads with the GPT's tied embedding held by both daemons
    # (2 stages x 2 replicas): each daemon keeps its replicas' gradients until allreduce_grads,
    # through an undeploy and a recreate_all_communicators in between.
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_ACCUMULATE, peers, logs)
    assert stdout.split().count("ok") == 3, stdout


_BAD_INPUTS = textwrap.dedent("""
    import copy, os, sys, time, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    import test_pipeline_conformance as tpc
    from conftest import assert_close
    SHIFT = int(os.environ["BAD_BATCH_SHIFT"])

    class Shifted(torch.nn.Module):
        # Ids and targets arrive SHIFT too high and are shifted back inside the model: through a
        # subtraction, the daemon cannot range-check them on the host, so bad ones reach the
        # stages.
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, targets):
            return self.inner(ids - SHIFT, targets - SHIFT)

    case = tpc.MODELS["gpt_tied"]
    torch.manual_seed(0)
    model = Shifted(case.make()) if SHIFT else case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(4):
        x, y = case.batch(step)
        x, y = x + SHIFT, y + SHIFT
        if step == 1:
            stages = sorted(rmod.deployment.stages, key=lambda s: s.index)
            print("STAGES", *(rmod._job.devices[s.devices[0]].split("/")[0] for s in stages))
        if step == 2:
            # A token id past the vocabulary fails the first stage (this daemon's); a target
            # past it fails the loss, on the other daemon. Either way the step fails at once
            # everywhere, and nothing is lost.
            for bad in ((x.clamp(max=0) + 99, y), (x, y.clamp(max=0) + 99)):
                start = time.monotonic()
                try:
                    rmod(*bad).backward()
                    opt.step()
                except Exception as err:  # noqa: BLE001
                    print("FAILED", round(time.monotonic() - start, 2), str(err).splitlines()[0],
                          flush=True)
                else:
                    raise AssertionError("a bad batch trained")
            opt.zero_grad()
        loss = rmod(x, y)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), f"loss at step {{step}}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for k, v in ref.state_dict().items():
        assert_close(rmod.state_dict()[k], v, k)
    print("ok", flush=True)
""")


def _bad_batch_failures(stdout):
    failures = [line.split(maxsplit=2) for line in stdout.splitlines()
                if line.startswith("FAILED")]
    assert len(failures) == 2, stdout
    return failures


def test_a_bad_batch_fails_promptly_on_every_daemon_and_loses_nothing(cluster):
    # Indices the host cannot check (the model computes them) fail inside the stages.
    if CLUSTER_DEVICES.startswith("cuda"):
        pytest.skip("on CUDA an out-of-range index inside a kernel is a device-side assert, "
                    "after which no CUDA call of the daemon's process succeeds (CUDA's design); "
                    "the host's range check below is what keeps such a batch off the GPUs")
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_BAD_INPUTS, peers, logs, RANNC_DEFER_OPS="0",
                                  BAD_BATCH_SHIFT="1")
    failures = _bad_batch_failures(stdout)
    for _, seconds, message in failures:
        print(f"failed after {seconds} s: {message}")
        # The cause, not the abandoned waits it leads to; long before any transfer timeout.
        assert "out of" in message.lower() and "cancelled" not in message, message
        assert float(seconds) < 10, seconds
    # The token is found bad by the first stage's daemon, the target by the last stage's; the
    # error names the daemon when it is not the one the client talks to.
    stages = next(line.split()[1:] for line in stdout.splitlines()
                  if line.startswith("STAGES"))
    assert "index out of range" in failures[0][2], failures[0]
    assert "out of bounds" in failures[1][2], failures[1]
    for (_, _, message), daemon in zip(failures, (stages[0], stages[-1])):
        assert daemon == peers[0] or daemon in message, (daemon, message)
    assert stdout.rstrip().endswith("ok"), stdout


def test_an_out_of_range_batch_is_refused_on_the_host_and_loses_nothing(cluster):
    # Token ids and targets that the model reads as they are: the leader refuses the batch
    # before any daemon runs it (runtime/model_runner.h CheckInputs), and training goes on.
    peers, logs, _, _ = cluster
    stdout = _run_over_two_stages(_BAD_INPUTS, peers, logs, RANNC_DEFER_OPS="0",
                                  BAD_BATCH_SHIFT="0")
    (_, token_s, token), (_, target_s, target) = _bad_batch_failures(stdout)
    assert "'idx'" in token and "out of range for the rows of embedding" in token, token
    assert "'targets'" in target and "classes of" in target, target
    assert float(token_s) < 2 and float(target_s) < 2, (token_s, target_s)
    assert stdout.rstrip().endswith("ok"), stdout


def test_client_ranks_on_different_daemons_train_one_job(tmp_path, cluster):
    # Rank 0 talks to the first daemon, rank 1 to the second: rank 1's JoinJob is sent on to
    # the leading daemon, and barrier() meets across them.
    import types
    import test_client_ranks as ranks
    peers, logs, _, _ = cluster
    os.environ["RANNC_PARTITION_NUM"] = "2"
    try:
        out, results = ranks._run_ranks(tmp_path, types.SimpleNamespace(address=peers[0]), True,
                                        addresses=peers)
    finally:
        del os.environ["RANNC_PARTITION_NUM"]
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr}"
    losses, state = ranks._reference(True)
    for rank in range(2):
        got = json.load(open(out + str(rank)))
        assert len({d.split("/")[0] for d in got["devices"]}) == 2, got["devices"]
        for step in range(ranks.STEPS):
            assert_close(torch.tensor(got["losses"][step]), losses[step],
                         f"rank {rank} loss at step {step}")
        for k, v in state.items():
            assert_close(torch.tensor(got["state"][k], dtype=v.dtype), v, f"rank {rank} {k}")


def test_a_lost_leader_fails_its_client_and_its_parts_go(cluster):
    peers, logs, procs, _ = cluster
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=peers[0],
               RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2",
               RANNC_DEFER_OPS="0")
    client = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_UNTIL_ERROR.format(
            tests=os.path.dirname(os.path.abspath(__file__)))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "TRAINING", client.stderr.read()
    member = rpc.TrainingServiceStub(grpc.insecure_channel(peers[1]))
    assert len(member.ListJobs(pb.Empty(), timeout=5).jobs) == 1  # the job's part
    killed = time.monotonic()
    procs[0].kill()  # SIGKILL the leading daemon mid-training
    stdout, stderr = client.communicate(timeout=60)
    assert client.returncode == 3 and "UNAVAILABLE" in stdout, stdout + stderr
    # The member drops the part once it finds the leader lost (peer timeout 5 s), and serves on.
    while member.ListJobs(pb.Empty(), timeout=5).jobs:
        assert time.monotonic() - killed < 20, "the part outlived its leader"
        time.sleep(0.2)
    print(f"the part went {time.monotonic() - killed:.1f} s after the leader's SIGKILL")


_CHECKPOINTED_CLIENT = textwrap.dedent("""
    import sys, time, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    torch.manual_seed({seed})  # a resumed job's initial values are the checkpoint's, not these
    model = models.TinyGPT(qkv_bias=False)  # Adam would amplify the key bias's round-off
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rmod = pyrannc.RaNNCModule(model, opt, enable_zero={zero})
    before = rmod.resumed_step
    for step in range({first}, {last}):
        x, y = models.gpt_batch(step, batch=8)
        loss = rmod(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    deadline = time.monotonic() + 60
    while not all(c.committed for c in rmod.checkpoints()):
        assert time.monotonic() < deadline, rmod.checkpoints()
        time.sleep(0.05)
    torch.save({{"before": before, "after": rmod.resumed_step, "state": rmod.state_dict(),
                "optimizer": opt.state_dict(),
                "checkpoints": [c.step for c in rmod.checkpoints()],
                "devices": list(rmod._job.devices),
                "stages": [list(s.devices) for s in rmod.deployment.stages]}}, {out!r})
""")


def _run_checkpointed_client(tmp_path, name, daemon, plan, first, last, seed, daemon_logs,
                             zero=False, job="cluster-ckpt", **env):
    """Runs _CHECKPOINTED_CLIENT (a TinyGPT without qkv bias, whose tied embedding and LM head are read by the
    first stage and the last) against `daemon` with the plan (stages, replicas, micro-batches),
    training steps first..last with checkpoints under tmp_path/ckpt (job cluster-ckpt);
    returns what it saved."""
    out = str(tmp_path / f"{name}.pt")
    partitions, replicas, pipeline = plan
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon,
               RANNC_PARTITION_NUM=str(partitions), RANNC_REPLICA_NUM=str(replicas),
               RANNC_PIPELINE_NUM=str(pipeline), RANNC_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               RANNC_JOB=job, **env)
    script = _CHECKPOINTED_CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                         seed=seed, first=first, last=last, out=out, zero=zero)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{name}:\n" + done.stderr + "\n" + "".join(
        log() for log in daemon_logs)
    return torch.load(out)


def test_a_checkpoint_of_a_job_over_the_daemons_resumes_on_another_plan_and_on_one_daemon(
        tmp_path, cluster):
    # A TinyGPT with Adam over both daemons (a stage per daemon, 2 replicas each), a checkpoint
    # every 2 steps, each daemon writing its own stage's tensors; resumed over both daemons on
    # another plan (1 stage x 4 replicas) and on one standalone daemon (1 stage x 2 replicas):
    # both equal to an uninterrupted PyTorch run.
    peers, logs, _, names = cluster
    cluster_logs = [lambda log=log: open(log.name).read() for log in logs]
    every_device = sorted(f"{a}/{n}" for a, own in zip(peers, names) for n in own)

    first = _run_checkpointed_client(tmp_path, "first", peers[0], (2, 2, 2), 0, 4, 0,
                                     cluster_logs, RANNC_CHECKPOINT_EVERY="2")
    assert sorted(first["devices"]) == every_device
    assert len(first["stages"]) == 2
    assert first["before"] is None and first["after"] is None  # resume is not set
    assert first["checkpoints"] == [2, 4]
    _assert_each_daemon_wrote_its_stage(tmp_path / "ckpt" / "cluster-ckpt" / "step-0000000004")

    # Over both daemons again, as 1 stage x 4 replicas, from other initial values.
    over_cluster = _run_checkpointed_client(tmp_path, "over_cluster", peers[0], (1, 4, 1), 4, 6,
                                            1, cluster_logs, RANNC_RESUME="latest")
    assert over_cluster["before"] == 4 and over_cluster["after"] == 4
    assert sorted(over_cluster["devices"]) == every_device
    assert over_cluster["stages"] == [[0, 1, 2, 3]]

    # On one daemon outside the cluster, as 1 stage x 2 replicas.
    other = DaemonProcess("--devices", "cpu:2")
    try:
        alone = _run_checkpointed_client(tmp_path, "alone", other.address, (1, 2, 1), 4, 6, 2,
                                         [other.output], RANNC_RESUME="latest")
    finally:
        other.stop()
    assert alone["before"] == 4 and alone["after"] == 4
    assert alone["stages"] == [[0, 1]]
    assert alone["devices"] == ["cpu:0", "cpu:1"]  # a daemon outside a cluster names its own

    _assert_like_uninterrupted_adam({"resumed over the cluster on 1x4": over_cluster,
                                     "resumed on one daemon on 1x2": alone})


def _assert_each_daemon_wrote_its_stage(step_dir):
    """A checkpoint of a job with a stage per daemon: daemon-0*.pt (the leader's) and
    daemon-1*.pt each hold some of the model's parameters, and no tensor is written twice."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    by_daemon = {}
    for entry in manifest["entries"]:
        daemon = entry["file"].split(".")[0].split("-")[1]
        by_daemon.setdefault(daemon, []).append(
            (entry["kind"], entry["name"], entry.get("state_key", ""), entry.get("offset", 0)))
    assert sorted(by_daemon) == ["0", "1"], by_daemon
    every = [e for entries in by_daemon.values() for e in entries]
    assert len(every) == len(set(every)), "a tensor written twice"
    for daemon, entries in by_daemon.items():
        assert any(kind == "PARAM" for kind, *_ in entries), (daemon, entries)
    for f in manifest["files"]:  # each daemon's file opens with plain torch.load
        assert all(isinstance(v, torch.Tensor) for v in torch.load(step_dir / f["path"]).values())


def _assert_like_uninterrupted_adam(runs, steps=6):
    """Each run's final state and optimizer state against `steps` steps of plain PyTorch
    (TinyGPT, Adam, lr 0.01, seed 0)."""
    torch.manual_seed(0)
    ref = models.TinyGPT(qkv_bias=False)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(steps):
        x, y = models.gpt_batch(step, batch=8)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    ref_state = opt.state_dict()["state"]
    for what, got in runs.items():
        assert sorted(got["state"]) == sorted(ref.state_dict())
        for k, v in ref.state_dict().items():
            assert_close(got["state"][k], v, f"{what}: {k}")
        state = got["optimizer"]["state"]
        assert sorted(state) == sorted(ref_state), what
        for i, keys in ref_state.items():
            assert float(state[i]["step"]) == float(keys["step"]), (what, i)
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(state[i][key], keys[key], f"{what}: optimizer state {i} {key}")


def test_a_zero_checkpoint_of_one_daemon_resumes_over_the_daemons(tmp_path, cluster):
    # 2 stages x 2 replicas with ZeRO on one daemon with four devices, checkpointed; resumed by
    # a job over both daemons of the cluster (a stage per daemon, without ZeRO), and by one
    # with ZeRO there, which checkpoints again (each daemon writing its stage's state,
    # assembled from its replicas' shards); that resumed on one daemon without ZeRO. Each
    # equal to an uninterrupted PyTorch run, optimizer state included.
    peers, logs, _, names = cluster
    single = DaemonProcess("--devices", "cpu:4")
    try:
        first = _run_checkpointed_client(tmp_path, "zero_first", single.address, (2, 2, 2), 0, 4,
                                         0, [single.output], zero=True, job="zero-ckpt",
                                         RANNC_CHECKPOINT_EVERY="4")
    finally:
        single.stop()
    assert first["checkpoints"] == [4] and len(first["stages"]) == 2
    resumed = _run_checkpointed_client(
        tmp_path, "zero_resumed", peers[0], (2, 2, 2), 4, 6, 1,
        [lambda log=log: open(log.name).read() for log in logs], job="zero-ckpt",
        RANNC_RESUME="latest")
    assert resumed["before"] == 4 and resumed["after"] == 4
    assert sorted(resumed["devices"]) == sorted(f"{a}/{n}" for a, own in zip(peers, names)
                                                for n in own)
    _assert_like_uninterrupted_adam({"ZeRO on one daemon, resumed over two": resumed})

    zero_over_two = _run_checkpointed_client(
        tmp_path, "zero_over_two", peers[0], (2, 2, 2), 4, 8, 1,
        [lambda log=log: open(log.name).read() for log in logs], zero=True, job="zero-ckpt",
        RANNC_RESUME="4", RANNC_CHECKPOINT_EVERY="4")
    assert zero_over_two["before"] == 4 and len(zero_over_two["stages"]) == 2
    assert zero_over_two["checkpoints"][-1] == 8
    _assert_each_daemon_wrote_its_stage(tmp_path / "ckpt" / "zero-ckpt" / "step-0000000008")
    single = DaemonProcess("--devices", "cpu:2")
    try:
        last = _run_checkpointed_client(tmp_path, "zero_last", single.address, (1, 2, 1), 8, 10,
                                        2, [single.output], job="zero-ckpt",
                                        RANNC_RESUME="latest")
    finally:
        single.stop()
    assert last["before"] == 8
    _assert_like_uninterrupted_adam({"ZeRO over two daemons": zero_over_two}, steps=8)
    _assert_like_uninterrupted_adam({"ZeRO over two daemons, resumed on one": last}, steps=10)


def test_the_loss_scalers_state_resumes_on_every_daemon(tmp_path, cluster):
    # Dynamic loss scaling (fp32 here: the scale doubles every step, exact powers of two) over
    # both daemons, checkpointed at step 4 with a scale of 16; resumed over both daemons, every
    # daemon's engine scales and unscales with the checkpoint's scale (a daemon starting afresh
    # at 1 would mix scales across the stages): equal to an uninterrupted PyTorch run.
    peers, logs, _, _ = cluster
    cluster_logs = [lambda log=log: open(log.name).read() for log in logs]
    scaling = dict(RANNC_LOSS_SCALE="dynamic", RANNC_LOSS_SCALE_INIT="1",
                   RANNC_LOSS_SCALE_WINDOW="1")
    first = _run_checkpointed_client(tmp_path, "scaled_first", peers[0], (2, 2, 2), 0, 4, 0,
                                     cluster_logs, job="scaled", RANNC_CHECKPOINT_EVERY="4",
                                     **scaling)
    assert first["checkpoints"] == [4] and len(first["stages"]) == 2
    manifest = json.loads((tmp_path / "ckpt" / "scaled" / "step-0000000004" /
                           "manifest.json").read_text())
    assert manifest["loss_scale"] == 16
    resumed = _run_checkpointed_client(tmp_path, "scaled_resumed", peers[0], (2, 2, 2), 4, 6, 1,
                                       cluster_logs, job="scaled", RANNC_RESUME="latest",
                                       **scaling)
    assert resumed["before"] == 4
    _assert_like_uninterrupted_adam({"loss scaling resumed over two daemons": resumed})


_FAILOVER_CLIENT = textwrap.dedent("""
    import sys, time, torch
    import pyrannc
    sys.path.insert(0, {tests!r})
    import models
    torch.manual_seed(0)
    model = models.TinyGPT(qkv_bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rmod = pyrannc.RaNNCModule(model, opt)
    step = rmod.resumed_step or 0
    moves = []
    while step < {steps}:
        try:
            x, y = models.gpt_batch(step, batch=8)
            loss = rmod(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            print("step", step, flush=True)
        except pyrannc.JobMoved as moved:
            print("moved", moved.step, moved.leader, flush=True)
            moves.append([moved.step, moved.leader, moved.job_id, time.time()])
            step = moved.step
    torch.save({{"state": rmod.state_dict(), "moves": moves,
                "devices": list(rmod._job.devices)}}, {out!r})
""")


class _Failover:
    """Three daemons on the cluster store `store` (each `cpu:2`) for the failover tests: the
    client env (every daemon in RANNC_DAEMON, the plan, a checkpoint every 5 steps into a
    directory all of them reach), an uninterrupted run of _FAILOVER_CLIENT, and a run that
    calls `on_line(words)` for each line its client prints (where the test kills something)."""

    STEPS = 20

    def __init__(self, tmp_path, store, plan, discover=False, **env):
        self.tmp_path = tmp_path
        self._gen = _start_cluster(3, store, discover)
        self.peers, self._logs, self.procs, _ = next(self._gen)
        partitions, replicas, pipeline = plan
        self.env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=",".join(self.peers),
                        RANNC_PARTITION_NUM=str(partitions), RANNC_REPLICA_NUM=str(replicas),
                        RANNC_PIPELINE_NUM=str(pipeline),
                        RANNC_CHECKPOINT_DIR=str(tmp_path / "ckpt"), RANNC_CHECKPOINT_EVERY="5",
                        **env)

    def logs(self):
        return "\n".join(f"--- {p}\n" + open(l.name).read()
                         for p, l in zip(self.peers, self._logs))

    def _script(self, out):
        return _FAILOVER_CLIENT.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                       steps=self.STEPS, out=out)

    def run_whole(self):
        """The uninterrupted run (job 'whole'): what its client saved."""
        out = str(self.tmp_path / "whole.pt")
        done = subprocess.run([sys.executable, "-c", self._script(out)],
                              env=dict(self.env, RANNC_JOB="whole"), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr + self.logs()
        return torch.load(out)

    def run(self, job, on_line):
        out = str(self.tmp_path / f"{job}.pt")
        client = subprocess.Popen([sys.executable, "-c", self._script(out)],
                                  env=dict(self.env, RANNC_JOB=job), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        lines = []
        for line in client.stdout:
            lines.append(line.strip())
            on_line(line.split())
        client.wait(timeout=120)
        assert client.returncode == 0, "\n".join(lines) + client.stderr.read() + self.logs()
        return torch.load(out)

    def locate(self, name, address=None):
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(address or self.peers[1]))
        return stub.LocateJob(pb.LocateJobRequest(name=name), timeout=10)

    def stop(self):
        next(self._gen, None)


def _assert_bitwise(got, whole, what):
    for name, value in whole["state"].items():
        assert torch.equal(got["state"][name], value), f"{name} differs {what}"


def test_a_lost_leader_s_job_is_taken_over_and_its_client_goes_on_bitwise(
        tmp_path, etcd, pyrannc_daemon):
    # Three daemons on one etcd; a job over two of them (2 stages x 2 replicas x 2 micro-batches)
    # checkpoints every 5 steps into a directory they all reach. Its leading daemon is SIGKILLed
    # mid-training: another daemon takes the job over from the latest checkpoint within the
    # lease's TTL (10 s) and re-plans over the members that are UP; the client, which knows
    # every daemon (RANNC_DAEMON=a,b,c), finds it there (JobMoved), goes on from that step, and
    # ends with the parameters of an uninterrupted run, bitwise. The daemons have no --peers:
    # they find each other in etcd. `rannc locate` over the same list (its first daemon dead)
    # names the new leader.
    f = _Failover(tmp_path, etcd, (2, 2, 2), discover=True, RANNC_CALL_RETRY_TIMEOUT="60")
    peers = f.peers
    killed = {}
    try:
        whole = f.run_whole()

        def kill_the_leader(words):
            if words[:2] == ["step", "13"] and not killed:
                entry = f.locate("moved")
                assert entry.leader == peers[0] and entry.generation == 0, f.logs()
                # The leader and its parts: the job runs on two daemons.
                assert any(d.startswith(peers[0]) for d in entry_devices(peers[0], entry.job_id))
                f.procs[0].kill()  # SIGKILL the leading daemon mid-training
                killed.update(at=time.time(), job_id=entry.job_id)

        got = f.run("moved", kill_the_leader)
        assert len(got["moves"]) == 1, got["moves"]
        step, leader, job_id, moved_at = got["moves"][0]
        assert step == 10 and leader in peers[1:] and job_id != killed["job_id"], got["moves"]
        assert not any(d.startswith(peers[0]) for d in got["devices"]), got["devices"]
        took = moved_at - killed["at"]
        print(f"the client went on at {leader} {took:.1f} s after its leader's SIGKILL")
        assert took < 25, f.logs()
        now = f.locate("moved")
        assert now.leader == leader and now.generation == 1 and now.resumed_step == 10, now
        located = subprocess.run([built_binary("rannc", "RANNC_CLI_BIN", "client"), "locate",
                                  "moved", "--daemon", ",".join(peers)], capture_output=True,
                                 text=True, timeout=30)
        assert located.returncode == 0, located.stderr
        assert f"({now.job_id}) runs on ranncd at {leader}" in located.stdout, located.stdout
        assert "taken over: 1 time, last resumed from step 10" in located.stdout, located.stdout
        _assert_bitwise(got, whole, "after the failover")
        # The step log: steps 1.. by the first leader, then 11..20 by the new one, never at
        # the same time.
        log = [line.split() for line in open(tmp_path / "ckpt" / "moved" / "steps.log")]
        first = [(int(t), int(n)) for t, daemon, _, n in log if daemon == peers[0]]
        second = [(int(t), int(n)) for t, daemon, _, n in log if daemon == leader]
        assert len(first) + len(second) == len(log), log
        # The client prints "step 13" with that step's backward, step and zero_grad still
        # deferred (pyrannc sends them with the next forward), so the kill may come before the
        # leader applies step 13: it applied at least 12.
        assert [n for _, n in first] == list(range(1, len(first) + 1)) and len(first) >= 12, log
        assert [n for _, n in second] == list(range(11, f.STEPS + 1)), log
        assert max(t for t, _ in first) < min(t for t, _ in second), log
    finally:
        f.stop()


def test_a_job_that_loses_a_part_comes_back_from_its_checkpoint_bitwise(
        tmp_path, etcd, pyrannc_daemon):
    # Three daemons on etcd; a job led by the first with its other stage on another (2 stages x
    # 2 replicas x 2 micro-batches, checkpoint every 5 steps). That one is SIGKILLed after step
    # 13: the leader brings the job back from step 10 over the daemons that are UP (itself and
    # the third), under a new id; the client follows it (JobMoved) and ends with the parameters
    # of an uninterrupted run, bitwise.
    f = _Failover(tmp_path, etcd, (2, 2, 2), RANNC_CALL_RETRY_TIMEOUT="60")
    peers = f.peers
    killed = {}
    try:
        whole = f.run_whole()
        # The uninterrupted job's parts: gone once the job is deleted, which the lease does
        # late; delete it so that the part's daemon holds only the next job's part.
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(peers[0]))
        for job in stub.ListJobs(pb.Empty(), timeout=10).jobs:
            stub.DeleteJob(pb.JobRef(job_id=job.job_id), timeout=30)

        def kill_a_part(words):
            if words[:2] == ["step", "13"] and not killed:
                entry = f.locate("parted", peers[0])
                assert entry.leader == peers[0], entry
                used = {d.split("/")[0] for d in entry.devices}
                assert len(used) == 2 and peers[0] in used, entry
                part = peers.index((used - {peers[0]}).pop())
                f.procs[part].kill()  # SIGKILL the daemon of the second stage
                killed.update(at=time.time(), job_id=entry.job_id, part=part)

        got = f.run("parted", kill_a_part)
        assert len(got["moves"]) == 1, got["moves"]
        step, leader, job_id, moved_at = got["moves"][0]
        assert step == 10 and leader == peers[0] and job_id != killed["job_id"], got["moves"]
        third = ({0, 1, 2} - {0, killed["part"]}).pop()
        assert {d.split("/")[0] for d in got["devices"]} == {peers[0], peers[third]}, \
            got["devices"]
        print(f"the job came back {moved_at - killed['at']:.1f} s after its part's SIGKILL")
        now = f.locate("parted", peers[0])
        assert now.job_id == job_id and now.generation == 1 and now.resumed_step == 10, now
        _assert_bitwise(got, whole, "after the recovery")
    finally:
        f.stop()


def test_three_daemons_on_a_three_member_etcd_train_through_the_loss_of_an_etcd_member(
        tmp_path, etcd3, pyrannc_daemon):
    # Three daemons on a three-member etcd: all UP through it (rannc info says so), a job over
    # all of them (3 stages x 2 replicas x 2 micro-batches), and the etcd member that leads the
    # etcd cluster SIGKILLed mid-training: the daemons' calls move to the other members, no
    # lease is lost, no job moves, and training ends as an uninterrupted run does, bitwise.
    # The daemons have no --peers (they find each other in etcd) and elect a coordinator there.
    f = _Failover(tmp_path, etcd3.url, (3, 2, 2), discover=True)
    killed = []
    try:
        info = subprocess.run([built_binary("rannc", "RANNC_CLI_BIN", "client"), "info",
                               "--daemon", f.peers[1]], capture_output=True, text=True,
                              timeout=30)
        assert info.returncode == 0, info.stderr
        for p in f.peers:
            assert re.search(rf"{re.escape(p)}.*UP", info.stdout), info.stdout
        assert re.search(r"cluster: 3 daemons, 3 up; coordinator 127\.0\.0\.1:\d+ \(elected in "
                         r"etcd\)", info.stdout), info.stdout
        assert f"cluster store: {etcd3.url}" in info.stdout, info.stdout
        whole = f.run_whole()

        def kill_the_etcd_leader(words):
            if words[:2] == ["step", "7"] and not killed:
                killed.append(etcd3.leader())
                etcd3.procs[killed[0]].kill()
                etcd3.procs[killed[0]].wait()

        got = f.run("through", kill_the_etcd_leader)
        assert got["moves"] == [], got["moves"]
        assert sorted({d.split("/")[0] for d in got["devices"]}) == sorted(f.peers)
        _assert_bitwise(got, whole, "after the loss of an etcd member")
        assert all(p.poll() is None for p in f.procs), f.logs()
        assert "lost its etcd lease" not in f.logs()
        print(f"etcd member {killed[0]} (the etcd leader) was SIGKILLed after step 7; training "
              f"went on")
    finally:
        f.stop()


def test_the_coordinator_is_elected_in_etcd_and_replaced_when_it_dies(tmp_path, etcd,
                                                                      pyrannc_daemon):
    # Three daemons without --peers on one etcd (leases of 3 s) elect one coordinator, which
    # every one of them names; client ranks on all three daemons meet at it (ClientBarrier).
    # SIGKILLed, it is replaced within its lease's TTL by a daemon both others name, and ranks
    # on those two meet there. (Two coordinators would leave each rank waiting alone.)
    gen = _start_cluster(3, etcd, discover=True, flags=("--cluster-lease", "3s"))
    peers, logs, procs, _ = next(gen)

    def coordinators(addresses):
        return {a: rpc.TrainingServiceStub(grpc.insecure_channel(a)).GetInfo(
            pb.GetInfoRequest(), timeout=5).coordinator for a in addresses}

    def meet(addresses, name):
        with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
            calls = [pool.submit(rpc.TrainingServiceStub(grpc.insecure_channel(a)).ClientBarrier,
                                 pb.ClientBarrierRequest(name=name, client_rank=rank,
                                                         client_world=len(addresses),
                                                         timeout_ms=15000), timeout=30)
                     for rank, a in enumerate(addresses)]
            for call in calls:
                call.result()

    try:
        named = coordinators(peers)
        first = named[peers[0]]
        assert first in peers and set(named.values()) == {first}, named
        meet(peers, "before")
        procs[peers.index(first)].kill()
        killed_at = time.time()
        rest = [p for p in peers if p != first]
        while True:
            named = coordinators(rest)
            if len(set(named.values())) == 1 and named[rest[0]] in rest:
                break
            assert time.time() - killed_at < 15, (named, "\n".join(open(l.name).read()
                                                                  for l in logs))
            time.sleep(0.1)
        took = time.time() - killed_at
        print(f"{named[rest[0]]} coordinates {took:.1f} s after {first} was SIGKILLed")
        assert took > 1, "elected again before the old coordinator's lease could have ended"
        meet(rest, "after")
        log = open(logs[peers.index(named[rest[0]])].name).read()
        assert f"election /rannc/coordinator: {named[rest[0]]} leads (this daemon)" in log, log
    finally:
        next(gen, None)


def entry_devices(address, job_id):
    """The devices of job `job_id` as the daemon at `address` lists them."""
    stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
    for job in stub.ListJobs(pb.Empty(), timeout=10).jobs:
        if job.job_id == job_id:
            return list(job.devices)
    return []
