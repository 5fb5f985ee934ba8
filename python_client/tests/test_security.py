"""TLS (issue 24, docs/security.md): ranncd with --tls-cert/--tls-key/--tls-ca, certificates
made for real by deploy/tls/make-certs.sh (openssl), and real clients: pyrannc trains over TLS
exactly as PyTorch does; a wrong CA, or plain text against TLS, fails with a message that says
what to set; two daemons verify each other (mutual TLS) and a job spans them, while a daemon
whose certificate another CA signed does not join; a rotated certificate is used without a
restart; a TLS file that is missing at start stops the daemon with a message naming it; and a
daemon reaches an etcd that demands TLS and client certificates."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

from conftest import (CLIENT_ROOT, DaemonProcess, assert_close, built_binary, daemon_binary,
                      free_port, free_ports, repo_file)
from pyrannc import _daemon
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="openssl is missing (deploy/setup.sh installs it)")


class _Ca:
    """A CA in its own directory, and certificates it signs for 127.0.0.1."""

    def __init__(self, path):
        self.dir = str(path)

    def issue(self, name):
        subprocess.run([repo_file("deploy/tls/make-certs.sh"), self.dir, name],
                       check=True, capture_output=True)
        return self

    @property
    def ca(self):
        return os.path.join(self.dir, "ca.crt")

    def cert(self, name):
        return os.path.join(self.dir, f"{name}.crt")

    def key(self, name):
        return os.path.join(self.dir, f"{name}.key")

    def flags(self, name):
        return ["--tls-cert", self.cert(name), "--tls-key", self.key(name), "--tls-ca", self.ca]


@pytest.fixture
def ca(tmp_path):
    return _Ca(tmp_path / "ca").issue("daemon-a").issue("daemon-b")


@pytest.fixture
def other_ca(tmp_path):
    return _Ca(tmp_path / "other").issue("stranger")


def _cli(*args, **env):
    return subprocess.run([built_binary("rannc", "RANNC_CLI_BIN", "client"), *args],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))


_TRAIN = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import pyrannc
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt)
    for step in range(3):
        x = torch.randn(8, 8)
        loss = rmod(x).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
        ref_loss = ref(x).square().mean()
        ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
        print("loss", loss.item(), ref_loss.item())
    torch.save({{"got": rmod.state_dict(), "ref": ref.state_dict()}}, {out!r})
""")


def _train(tmp_path, **env):
    out = str(tmp_path / "trained.pt")
    done = subprocess.run([sys.executable, "-c", _TRAIN.format(
        tests=os.path.dirname(os.path.abspath(__file__)), out=out)],
        env=dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON_CONNECT_TIMEOUT="5", **env),
        capture_output=True, text=True, timeout=300)
    return done, out


def test_a_client_that_trusts_the_ca_trains_like_pytorch_over_tls(tmp_path, ca, pyrannc_daemon,
                                                                  monkeypatch):
    monkeypatch.setenv("RANNC_TLS_CA", ca.ca)
    daemon = DaemonProcess(*ca.flags("daemon-a"))
    try:
        assert "TLS, daemons' certificates checked against --tls-ca" in daemon.output()
        done, out = _train(tmp_path, RANNC_DAEMON=daemon.address, RANNC_TLS_CA=ca.ca)
        assert done.returncode == 0, done.stderr + daemon.output()
        saved = torch.load(out)
        for name, value in saved["ref"].items():
            assert_close(saved["got"][name], value, rtol=1e-5, atol=1e-6)
        info = _cli("info", "--daemon", daemon.address, "--tls-ca", ca.ca)
        assert info.returncode == 0, info.stderr
        assert daemon.address in info.stdout
    finally:
        daemon.stop()


def test_a_wrong_ca_or_plain_text_against_tls_fails_saying_what_to_set(
        tmp_path, ca, other_ca, pyrannc_daemon, monkeypatch):
    monkeypatch.setenv("RANNC_TLS_CA", ca.ca)
    daemon = DaemonProcess(*ca.flags("daemon-a"))
    try:
        done, _ = _train(tmp_path, RANNC_DAEMON=daemon.address, RANNC_TLS_CA=other_ca.ca)
        assert done.returncode != 0
        assert "did not answer GetInfo in time" in done.stderr, done.stderr
        assert "RANNC_TLS_CA must name the CA that signed ranncd's certificate" in done.stderr
        plain = dict(os.environ)
        plain.pop("RANNC_TLS_CA")
        done = subprocess.run([sys.executable, "-c", _TRAIN.format(
            tests=os.path.dirname(os.path.abspath(__file__)), out=str(tmp_path / "x.pt"))],
            env=dict(plain, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon.address,
                     RANNC_DAEMON_CONNECT_TIMEOUT="5"), capture_output=True, text=True,
            timeout=300)
        assert done.returncode != 0
        assert "speaks TLS only: set RANNC_TLS_CA" in done.stderr, done.stderr
        # The CLI: plain text says the same; a CA file that is not there is named.
        info = _cli("info", "--daemon", daemon.address, RANNC_TLS_CA="")
        assert info.returncode == 1 and "speaks TLS only" in info.stderr, info.stderr
        info = _cli("info", "--daemon", daemon.address, "--tls-ca", str(tmp_path / "none.crt"))
        assert info.returncode == 1
        assert f"--tls-ca {tmp_path / 'none.crt'}: cannot be read" in info.stderr, info.stderr
        # The daemon served through it all.
        assert _cli("info", "--daemon", daemon.address, "--tls-ca", ca.ca).returncode == 0
    finally:
        daemon.stop()


def _start(flags, peers):
    address = flags[flags.index("--listen") + 1]
    log = open(os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), f"ranncd-{address}.log"), "w")
    proc = subprocess.Popen([daemon_binary(), "--devices", "cpu:2", "--peers", ",".join(peers),
                             "--heartbeat-interval", "200ms", "--peer-timeout", "3s",
                             "--profile-cache", "none", "--state-dir", "none",
                             "--links", "p2p=5GB/s,allreduce=2:3GB/s;4:2GB/s", *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, log.name


def _states(address, ca):
    """The cluster as the daemon at `address` sees it: address -> state ({} while it starts)."""
    info = _cli("info", "--daemon", address, "--tls-ca", ca)
    if info.returncode != 0:
        return {}
    return {m.group(1): m.group(2)
            for m in re.finditer(r"(127\.0\.0\.1:\d+)\s+(UP|DOWN|UNKNOWN)", info.stdout)}


class _Pair:
    """Two daemons, each `cpu:2`, peers of each other, with the TLS flags given; stopped by
    stop()."""

    def __init__(self, flags_a, flags_b):
        self.peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
        self.started = [_start(["--listen", p, *f], self.peers)
                        for p, f in zip(self.peers, (flags_a, flags_b))]

    def log(self, i):
        return open(self.started[i][1]).read()

    def stop(self):
        for proc, _ in self.started:
            proc.terminate()
        for proc, log in self.started:
            proc.wait(timeout=15)
            os.unlink(log)


def test_daemons_verify_each_other_and_a_job_spans_them(tmp_path, ca, pyrannc_daemon):
    # Two daemons of one CA see each other UP (their heartbeats, job parts and rendezvous go
    # through mutual TLS) and train a job over both like PyTorch.
    pair = _Pair(ca.flags("daemon-a"), ca.flags("daemon-b"))
    try:
        deadline = time.time() + 60
        while True:
            a, b = _states(pair.peers[0], ca.ca), _states(pair.peers[1], ca.ca)
            if a.get(pair.peers[1]) == "UP" and b.get(pair.peers[0]) == "UP":
                break
            assert time.time() < deadline, (a, b, pair.log(0))
            time.sleep(0.2)
        done, out = _train(tmp_path, RANNC_DAEMON=pair.peers[0], RANNC_TLS_CA=ca.ca,
                           RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2")
        assert done.returncode == 0, done.stderr + pair.log(0)
        saved = torch.load(out)
        for name, value in saved["ref"].items():
            assert_close(saved["got"][name], value, rtol=1e-5, atol=1e-6)
        # Planned over both daemons' devices (two each), the second stage on the other's.
        assert "plan for 4 x cpu" in pair.log(0), pair.log(0)
    finally:
        pair.stop()


def test_a_daemon_whose_certificate_another_ca_signed_never_joins(tmp_path, ca, other_ca,
                                                                 pyrannc_daemon):
    # It trusts the cluster's CA, so it could verify the others; they refuse its certificate.
    shutil.copy(ca.ca, other_ca.dir + "/trusted.crt")
    pair = _Pair(ca.flags("daemon-a"),
                 ["--tls-cert", other_ca.cert("stranger"), "--tls-key", other_ca.key("stranger"),
                  "--tls-ca", other_ca.dir + "/trusted.crt"])
    try:
        deadline = time.time() + 60
        while not _states(pair.peers[0], ca.ca):
            assert time.time() < deadline, pair.log(0)
            time.sleep(0.2)
        time.sleep(3)  # fifteen heartbeat rounds
        assert _states(pair.peers[0], ca.ca)[pair.peers[1]] == "UNKNOWN", pair.log(0)
        assert "certificate verify failed" in pair.log(0) + pair.log(1), pair.log(0)
    finally:
        pair.stop()


def test_a_rotated_certificate_is_used_without_a_restart(tmp_path, ca, other_ca,
                                                         pyrannc_daemon):
    """The files are read again every --tls-refresh: a new pair is used by new connections, and
    a certificate file that is gone, or holds garbage, leaves the last good pair in use (the
    daemon says which file and why)."""
    live = tmp_path / "live"
    live.mkdir()
    cert, key = str(live / "tls.crt"), str(live / "tls.key")
    shutil.copy(ca.cert("daemon-a"), cert)
    shutil.copy(ca.key("daemon-a"), key)
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "ranncd.log"
    proc = subprocess.Popen([daemon_binary(), "--listen", address, "--devices", "cpu:1",
                             "--state-dir", "none", "--profile-cache", "none",
                             "--tls-cert", cert, "--tls-key", key, "--tls-refresh", "1s"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while _cli("info", "--daemon", address, "--tls-ca", ca.ca).returncode != 0:
            assert time.time() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        # The secret is rotated to a certificate of another CA: new clients of that CA get in.
        shutil.copy(other_ca.key("stranger"), key + ".new")
        shutil.copy(other_ca.cert("stranger"), cert + ".new")
        os.replace(key + ".new", key)
        os.replace(cert + ".new", cert)
        deadline = time.time() + 20
        while _cli("info", "--daemon", address, "--tls-ca", other_ca.ca).returncode != 0:
            assert time.time() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.5)
        assert _cli("info", "--daemon", address, "--tls-ca", ca.ca).returncode != 0
        assert proc.poll() is None
        # Rotations that go wrong (the certificate gone, then garbage in its place): the daemon
        # keeps the last good pair, logs why, and serves on.
        os.remove(cert)
        time.sleep(2.5)  # two refreshes
        assert _cli("info", "--daemon", address, "--tls-ca", other_ca.ca).returncode == 0, \
            log.read_text()
        assert f"--tls-cert {cert}: cannot be read" in log.read_text()
        with open(cert + ".new", "w") as f:
            f.write("not a certificate\n")
        os.replace(cert + ".new", cert)
        time.sleep(2.5)
        assert _cli("info", "--daemon", address, "--tls-ca", other_ca.ca).returncode == 0, \
            log.read_text()
        assert f"--tls-cert {cert}: not PEM" in log.read_text()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_tls_file_missing_at_start_stops_the_daemon_naming_it(tmp_path, ca, pyrannc_daemon):
    missing = str(tmp_path / "missing.crt")
    for flags, says in [
            (["--tls-cert", missing, "--tls-key", ca.key("daemon-a")],
             f"--tls-cert {missing}: cannot be read"),
            (["--tls-cert", ca.cert("daemon-a")], "give --tls-cert and --tls-key together"),
            (["--tls-cert", ca.cert("daemon-a"), "--tls-key", ca.key("daemon-a"),
              "--tls-ca", "/etc/hostname"], "--tls-ca /etc/hostname: not PEM")]:
        done = subprocess.run([daemon_binary(), "--listen", f"127.0.0.1:{free_port()}",
                               "--devices", "cpu:1", "--links", "p2p=5GB/s", *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert says in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_daemon_reaches_etcd_over_tls(tmp_path, ca, other_ca, pyrannc_daemon):
    # etcd with TLS and client certificates (--client-cert-auth): a daemon given the cluster's
    # CA and a certificate of it (--cluster-store-ca/-cert/-key) registers there and elects
    # itself coordinator; one without them, or with another CA's certificate, is refused at
    # start, saying so.
    from test_cluster_jobs import EtcdProcesses
    ca.issue("etcd")
    etcd = EtcdProcesses(tmp_path, 1, tls=(ca.cert("etcd"), ca.key("etcd"), ca.ca))
    try:
        store = ["--cluster-store", etcd.url]
        refused = [store, store + ["--cluster-store-cert", other_ca.cert("stranger"),
                                   "--cluster-store-key", other_ca.key("stranger"),
                                   "--cluster-store-ca", ca.ca]]
        for flags in refused:
            done = subprocess.run([daemon_binary(), "--listen", f"127.0.0.1:{free_port()}",
                                   "--devices", "cpu:1", "--links", "p2p=5GB/s", *flags],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode != 0
            assert "--cluster-store: no etcd member of" in done.stdout + done.stderr, \
                done.stdout + done.stderr
        address = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen([daemon_binary(), "--listen", address, "--devices", "cpu:1",
                                 "--links", "p2p=5GB/s", "--state-dir", "none", *store,
                                 "--cluster-store-cert", ca.cert("daemon-a"),
                                 "--cluster-store-key", ca.key("daemon-a"),
                                 "--cluster-store-ca", ca.ca],
                                stdout=open(tmp_path / "ranncd.log", "w"),
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 60
            while True:
                info = _cli("info", "--daemon", address)
                if info.returncode == 0 and f"coordinator {address} (elected in etcd)" in \
                        info.stdout:
                    break
                assert time.time() < deadline and proc.poll() is None, \
                    info.stdout + (tmp_path / "ranncd.log").read_text()
                time.sleep(0.2)
            keys = subprocess.run(["etcdctl", "--endpoints", etcd.clients[0], "--cert",
                                   ca.cert("daemon-b"), "--key", ca.key("daemon-b"),
                                   "--cacert", ca.ca, "get", "--prefix", "--keys-only",
                                   "/rannc/members/"], env=dict(os.environ, ETCDCTL_API="3"),
                                  capture_output=True, text=True, timeout=30)
            assert f"/rannc/members/{address}" in keys.stdout, keys.stdout + keys.stderr
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    finally:
        etcd.stop()


# ---- Tokens. -----------------------------------------------------------------------------------

_ADMIN = "admin-" + "0123456789abcdef" * 2
# Who may call what, as docs/security.md says (the test's own table, not the daemon's).
_ANY_VALID_TOKEN = {"GetInfo", "ListJobs", "ListDetachedJobs"}


def _rpcs():
    """Every RPC of rannc.v1's services, read from the .proto files: (service, method, client
    streaming, server streaming). A new RPC is in the matrix below without anyone adding it."""
    out = []
    for proto in ("training", "job_part", "store", "cluster"):
        text = open(repo_file(f"proto/rannc/v1/{proto}.proto")).read()
        for service, body in re.findall(r"service (\w+) \{(.*?)\n\}", text, re.S):
            for m in re.finditer(r"rpc (\w+)\((stream )?[\w.]+\) returns \((stream )?", body):
                out.append((service, m.group(1), bool(m.group(2)), bool(m.group(3))))
    return out


def _request(service, method, job_id, name):
    """The request of `method` naming job `job_id` (or `name`), serialized; b"" where the
    message is not in pyrannc's stubs (the peer services': any bytes do for the check)."""
    if service != "TrainingService":
        return b""
    descriptor = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    request = getattr(pb, descriptor.input_type.name)()
    fields = request.DESCRIPTOR.fields_by_name
    if "job_id" in fields:
        request.job_id = job_id
    if "job_ids" in fields:
        request.job_ids.append(job_id)
    if "name" in fields and fields["name"].type == fields["name"].TYPE_STRING:
        request.name = name
    if "job_name" in fields:
        request.job_name = name
    if "header" in fields and "job_id" in fields["header"].message_type.fields_by_name:
        request.header.job_id = job_id
    if "spec" in fields:
        request.spec.name = name
    return request.SerializeToString()


def _call(channel, service, method, client_stream, server_stream, payload, token):
    """The status code of one call of `method` with `token` ("" for none)."""
    path = f"/rannc.v1.{service}/{method}"
    metadata = [("authorization", f"Bearer {token}")] if token else []
    identity = lambda b: b  # noqa: E731
    try:
        if client_stream:
            channel.stream_unary(path, identity, identity)(iter([payload]), metadata=metadata,
                                                           timeout=30)
        elif server_stream:
            for _ in channel.unary_stream(path, identity, identity)(payload, metadata=metadata,
                                                                   timeout=30):
                pass
        else:
            channel.unary_unary(path, identity, identity)(payload, metadata=metadata, timeout=30)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


@pytest.fixture
def token_daemon(tmp_path, pyrannc_daemon, monkeypatch):
    """A daemon with --auth-token-file on loopback, two jobs on it ('tok-a', 'tok-b') created
    with the admin token by this process, and their tokens: (daemon, {name: (id, token)})."""
    path = tmp_path / "admin.token"
    path.write_text(_ADMIN + "\n")
    monkeypatch.setenv("RANNC_TOKEN", _ADMIN)
    daemon = DaemonProcess("--auth-token-file", str(path))
    monkeypatch.setenv("RANNC_DAEMON", daemon.address)
    _daemon.shutdown()  # this process's pyrannc connects to this daemon now, with the token
    import pyrannc
    jobs, modules = {}, []
    for name in ("tok-a", "tok-b"):
        monkeypatch.setenv("RANNC_JOB", name)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rmod = pyrannc.RaNNCModule(model, opt)
        rmod(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert rmod.job_token and rmod.job_token.startswith("rj1."), rmod.job_token
        jobs[name] = (rmod._job.id, rmod.job_token)
        modules.append(rmod)
    monkeypatch.delenv("RANNC_JOB")
    yield daemon, jobs
    for rmod in modules:
        rmod._job = None  # deleted by the test, or with the daemon
    _daemon.shutdown()
    daemon.stop()


def test_tokens_guard_every_rpc(token_daemon):
    # The matrix of issue 24 over every RPC of every service: no token, a wrong one and a
    # malformed one are UNAUTHENTICATED; job A's token on job B (or on what only the admin or a
    # daemon may do) is PERMISSION_DENIED; GetInfo and the two lists take any valid token.
    daemon, jobs = token_daemon
    a_id, a_token = jobs["tok-a"]
    b_id, _ = jobs["tok-b"]
    channel = grpc.insecure_channel(daemon.address)
    rpcs = _rpcs()
    assert len(rpcs) > 50 and ("TrainingService", "Step", False, False) in rpcs, rpcs
    wrong = [("", "none"), ("rj1." + a_id + ".0000", "a forged job token"),
             ("x" * 40, "an unknown token")]
    for service, method, client_stream, server_stream in rpcs:
        payload = _request(service, method, b_id, "tok-b")
        for token, what in wrong:
            code = _call(channel, service, method, client_stream, server_stream, payload, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (service, method, what, code)
        code = _call(channel, service, method, client_stream, server_stream, payload, a_token)
        expected = (grpc.StatusCode.OK if service == "TrainingService" and
                    method in _ANY_VALID_TOKEN else grpc.StatusCode.PERMISSION_DENIED)
        assert code == expected, (service, method, "job A's token on job B", code)
    # Malformed: no "Bearer ".
    code = grpc.insecure_channel(daemon.address)
    try:
        rpc.TrainingServiceStub(code).GetInfo(pb.GetInfoRequest(), timeout=10,
                                              metadata=[("authorization", _ADMIN)])
        raise AssertionError("a token without 'Bearer ' was taken")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert _ADMIN not in daemon.output() and a_token not in daemon.output()


def test_a_job_token_drives_its_job_alone_and_the_admin_token_everything(token_daemon):
    daemon, jobs = token_daemon
    a_id, a_token = jobs["tok-a"]
    b_id, b_token = jobs["tok-b"]
    stub = rpc.TrainingServiceStub(grpc.insecure_channel(daemon.address))

    def as_(token):
        return [("authorization", f"Bearer {token}")]

    # Its own job: read it, list it (alone), find it by name.
    got = stub.GetParam(pb.GetParamRequest(job_id=a_id, name="weight"), metadata=as_(a_token),
                        timeout=30)
    assert got.has_value
    listed = stub.ListJobs(pb.Empty(), metadata=as_(a_token), timeout=30)
    assert [j.job_id for j in listed.jobs] == [a_id]
    listed = stub.ListJobs(pb.Empty(), metadata=as_(_ADMIN), timeout=30)
    assert {a_id, b_id} <= {j.job_id for j in listed.jobs}
    # The CLI with a token file: its own job only.
    token_file = daemon.log.name + ".a-token"
    with open(token_file, "w") as f:
        f.write(a_token + "\n")
    try:
        shown = _cli("jobs", "--daemon", daemon.address, "--token-file", token_file,
                     RANNC_TOKEN="")
        assert shown.returncode == 0, shown.stderr
        assert a_id in shown.stdout and b_id not in shown.stdout, shown.stdout
        refused = _cli("jobs", "--daemon", daemon.address, RANNC_TOKEN="")
        assert refused.returncode == 1 and "wants a token" in refused.stderr, refused.stderr
    finally:
        os.unlink(token_file)
    # It may delete its job, not the other; after, its token is no one's.
    with pytest.raises(grpc.RpcError) as denied:
        stub.DeleteJob(pb.JobRef(job_id=b_id), metadata=as_(a_token), timeout=30)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stub.DeleteJob(pb.JobRef(job_id=a_id), metadata=as_(a_token), timeout=30)
    with pytest.raises(grpc.RpcError) as gone:
        stub.GetInfo(pb.GetInfoRequest(), metadata=as_(a_token), timeout=30)
    assert gone.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub.GetInfo(pb.GetInfoRequest(), metadata=as_(b_token), timeout=30)


def test_an_oversized_token_is_refused_and_the_daemon_serves_on(token_daemon):
    daemon, _ = token_daemon
    stub = rpc.TrainingServiceStub(grpc.insecure_channel(daemon.address))
    with pytest.raises(grpc.RpcError) as big:
        stub.GetInfo(pb.GetInfoRequest(), timeout=30,
                     metadata=[("authorization", "Bearer " + "y" * (64 << 10))])
    # gRPC's own limit on metadata (8 KiB) refuses it before ranncd sees it, and closes that
    # connection (the client sees the socket closed, or the limit); a new one is served.
    assert big.value.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), big.value
    assert daemon.proc.poll() is None
    # A connection of its own (gRPC would share the closed one between equal channels).
    fresh = rpc.TrainingServiceStub(grpc.insecure_channel(
        daemon.address, options=[("grpc.use_local_subchannel_pool", 1)]))
    fresh.GetInfo(pb.GetInfoRequest(), timeout=30, wait_for_ready=True,
                  metadata=[("authorization", f"Bearer {_ADMIN}")])


def test_other_hosts_need_tls_and_tokens_or_insecure(tmp_path, ca, pyrannc_daemon):
    token = tmp_path / "admin.token"
    token.write_text(_ADMIN + "\n")
    exposed = ["--listen", f"0.0.0.0:{free_port()}", "--devices", "cpu:1", "--links",
               "p2p=5GB/s", "--state-dir", "none", "--profile-cache", "none"]
    for extra, says in [
            ([], "give it TLS (--tls-cert, --tls-key) and tokens (--auth-token-file)"),
            (["--auth-token-file", str(token)], "give it TLS (--tls-cert, --tls-key) (docs"),
            (ca.flags("daemon-a"), "give it tokens (--auth-token-file)")]:
        done = subprocess.run([daemon_binary(), *exposed, *extra], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode != 0
        assert says in done.stdout + done.stderr, done.stdout + done.stderr
        assert "or --insecure" in done.stdout + done.stderr
    for extra, says in [(["--insecure"], "--insecure: serving 0.0.0.0:"),
                        (ca.flags("daemon-a") + ["--auth-token-file", str(token)],
                         "TLS, daemons' certificates checked against --tls-ca, tokens required")]:
        proc = subprocess.Popen([daemon_binary(), *exposed, *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            seen = ""
            deadline = time.time() + 60
            while "ranncd listening on" not in seen:
                assert proc.poll() is None and time.time() < deadline, seen
                seen += proc.stdout.readline()
            assert says in seen, seen
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def test_a_bad_token_file_stops_the_daemon_naming_it(tmp_path, pyrannc_daemon):
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    for path, says in [(tmp_path / "missing.token", "cannot be read"),
                       (short, "has 3 characters; give at least 16")]:
        done = subprocess.run([daemon_binary(), "--listen", f"127.0.0.1:{free_port()}",
                               "--devices", "cpu:1", "--links", "p2p=5GB/s",
                               "--auth-token-file", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"--auth-token-file {path}: " in done.stdout + done.stderr
        assert says in done.stdout + done.stderr, done.stdout + done.stderr
