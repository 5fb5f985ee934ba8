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

import pytest
import torch

from conftest import (CLIENT_ROOT, DaemonProcess, assert_close, built_binary, daemon_binary,
                      free_port, repo_file)

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
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
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
