"""Cluster membership with real ranncd processes on loopback: every daemon lists every member
UP with the same ranks and the others' devices; a SIGKILLed daemon is reported DOWN within the
peer timeout (+2 s); restarted on its port it is UP again with a new incarnation; a daemon
missing from its own --peers refuses to start; `rannc info` prints the members."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
from pyrannc.proto.rannc.v1 import cluster_pb2  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2 as pb  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc  # noqa: E402


def _binary(relpath):
    for candidate in (os.path.join(ROOT, relpath), os.path.join(ROOT, "bazel-bin", relpath)):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(relpath)


RANNCD = os.environ.get("RANNC_DAEMON_BIN") or _binary("daemon/ranncd")
RANNC = _binary("client/rannc")
PEER_TIMEOUT_S = 3.0
HEARTBEAT_S = 0.3


def free_ports(n):
    """n distinct free loopback ports (held open together so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Ranncd:
    """One daemon of the cluster; its log goes to a file (a pipe nobody reads could fill up)."""

    def __init__(self, port, peers, logdir, *extra):
        self.address = f"127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"ranncd-{port}-{time.monotonic_ns()}.log")
        self.log = open(self.log_path, "w")
        # Fixed links and no profile cache: nothing to measure or read at start.
        self.proc = subprocess.Popen(
            [RANNCD, "--listen", self.address, "--devices", "cpu:2", "--device-memory", "1GiB",
             "--links", "p2p=5GB/s,allreduce=2:3GB/s", "--profile-cache", "none",
             "--peers", ",".join(peers), "--heartbeat-interval", f"{int(HEARTBEAT_S * 1000)}ms",
             "--peer-timeout", f"{PEER_TIMEOUT_S}s", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_serving(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if "ranncd listening on" in self.output():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"ranncd {self.address} did not start:\n{self.output()}")

    def info(self):
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(self.address))
        return stub.GetInfo(pb.GetInfoRequest(), timeout=5)

    def members(self):
        return {m.address: m for m in self.info().cluster}

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def wait_for(what, predicate, timeout):
    """Polls predicate() until true; returns the seconds it took, fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def all_up(daemons, addresses):
    for d in daemons:
        members = d.members()
        if sorted(members) != sorted(addresses):
            return False
        if any(members[a].state != cluster_pb2.MEMBER_UP for a in addresses):
            return False
    return True


@pytest.fixture
def logdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.mark.parametrize("n", [2, 3])
def test_members_agree_on_ranks_and_devices(n, logdir):
    ports = free_ports(n)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    # Each daemon gets the list in another order: ranks come from sorting, not from the flag.
    daemons = [Ranncd(p, addresses[i:] + addresses[:i], logdir) for i, p in enumerate(ports)]
    try:
        for d in daemons:
            d.wait_serving()
        took = wait_for("every daemon lists every member UP", lambda: all_up(daemons, addresses),
                        timeout=10)
        print(f"{n} daemons all UP {took:.2f} s after the last one served")
        expected_ranks = {a: r for r, a in enumerate(sorted(addresses))}
        for d in daemons:
            info = d.info()
            assert [m.address for m in info.cluster] == sorted(addresses)
            for m in info.cluster:
                assert m.rank == expected_ranks[m.address]
                assert [dev.name for dev in m.devices] == ["cpu:0", "cpu:1"]
                assert all(dev.memory_bytes == 1 << 30 for dev in m.devices)
                assert m.incarnation != 0
                assert m.version == info.version
                assert m.self == (m.address == d.address)
                assert 0 <= m.last_seen_ms_ago < PEER_TIMEOUT_S * 1000
        # Everyone sees the same incarnation for each member.
        incarnations = [{m.address: m.incarnation for m in d.info().cluster} for d in daemons]
        assert all(i == incarnations[0] for i in incarnations)

        out = subprocess.run([RANNC, "info", "--daemon", daemons[0].address],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"cluster: {n} daemons, {n} up" in out.stdout
        for a in addresses:
            assert a in out.stdout
        assert "RANK" in out.stdout and "cpu:0,cpu:1" in out.stdout
    finally:
        for d in daemons:
            d.stop()
    for d in daemons:
        assert d.proc.returncode == 0, d.output()


def test_killed_daemon_is_down_then_rejoins(logdir):
    ports = free_ports(3)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    daemons = [Ranncd(p, addresses, logdir) for p in ports]
    try:
        for d in daemons:
            d.wait_serving()
        wait_for("all UP", lambda: all_up(daemons, addresses), timeout=10)
        victim = daemons[1]
        survivors = [daemons[0], daemons[2]]
        old_incarnation = survivors[0].members()[victim.address].incarnation

        victim.kill()
        killed_at = time.monotonic()

        def reported_down():
            return all(d.members()[victim.address].state == cluster_pb2.MEMBER_DOWN
                       for d in survivors)

        took = wait_for("the killed daemon reported DOWN", reported_down,
                        timeout=PEER_TIMEOUT_S + 2)
        print(f"DOWN {took:.2f} s after SIGKILL (peer timeout {PEER_TIMEOUT_S} s)")
        assert took >= PEER_TIMEOUT_S - 0.5, "reported DOWN before the timeout ran out"
        # The survivors keep serving and still see each other UP.
        for d in survivors:
            start = time.monotonic()
            members = d.members()
            assert time.monotonic() - start < 1.0
            assert members[survivors[0].address].state == cluster_pb2.MEMBER_UP
            assert members[survivors[1].address].state == cluster_pb2.MEMBER_UP
        assert "is DOWN: not heard from" in survivors[0].output()

        restarted = Ranncd(ports[1], addresses, logdir).wait_serving()
        daemons[1] = restarted

        def rejoined():
            return all(d.members()[victim.address].state == cluster_pb2.MEMBER_UP and
                       d.members()[victim.address].incarnation not in (0, old_incarnation)
                       for d in survivors)

        took = wait_for("the restarted daemon UP again", rejoined, timeout=5)
        print(f"rejoined {took:.2f} s after it served; down for "
              f"{time.monotonic() - killed_at:.1f} s in all")
        wait_for("the restarted daemon sees everyone", lambda: all_up([restarted], addresses),
                 timeout=5)
        new = {d.members()[victim.address].incarnation for d in daemons}
        assert len(new) == 1 and old_incarnation not in new
    finally:
        for d in daemons:
            d.stop()


def test_daemon_not_in_its_peer_list_refuses_to_start(logdir):
    own, a, b = free_ports(3)
    d = Ranncd(own, [f"127.0.0.1:{a}", f"127.0.0.1:{b}"], logdir)
    try:
        assert d.proc.wait(timeout=60) != 0
    finally:
        d.stop()
    out = d.output()
    assert f"this daemon's address 127.0.0.1:{own} is not in its peer list" in out, out
    assert "--advertise" in out
    assert "ranncd listening on" not in out


def test_wildcard_listen_needs_advertise(logdir):
    own, other = free_ports(2)
    proc = subprocess.run(
        [RANNCD, "--listen", f"0.0.0.0:{own}", "--devices", "cpu:1", "--links", "p2p=5GB/s",
         "--profile-cache", "none", "--peers", f"127.0.0.1:{own},127.0.0.1:{other}",
         "--insecure"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "give --advertise HOST:PORT" in proc.stderr + proc.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
