"""A network partition of a cluster on etcd: one daemon cut off from etcd and from the other
daemons, but not from its client, stops driving its jobs within its lease time; the majority side
takes them over from their latest checkpoint; and at no point do two daemons apply steps for the
same job (the job's step log says who applied which step, when).

Topology (all on one host, a real network stack per daemon):

    root namespace: bridge rebr<tag>, 10.203.X.254/24 (the client, this test)
                                      10.203.X.253/24 (etcd, client URL http://10.203.X.253:2379;
                                                       its peer URL on loopback)
      |-- veth --> namespace e0: daemon A at 10.203.X.1:7411
      |-- veth --> namespace e1: daemon B at 10.203.X.2:7411
      '-- veth --> namespace e2: daemon C at 10.203.X.3:7411

Each daemon runs with --cluster-store etcd://10.203.X.253:2379 (a 10 s lease) and --peers naming
all three. A job (RANNC_JOB, checkpointing every 5 steps into a directory all three reach) is led
by A and planned on A's two devices alone (1 stage x 2 replicas); its client runs in the root
namespace with RANNC_DAEMON=A,B,C.

The partition is a silent one (packets dropped, no errors): neither nft, iptables nor tc's drop
action (act_gact) is available here, so it is made with tc's qdiscs: on A's end of its veth an htb
root whose u32 filters send every IPv4 packet *to* etcd's address, B or C into a class whose leaf
is the `blackhole` qdisc (which drops what it gets and tells the sender it was sent), and the same
on the veth's root end (bridge -> A) for every packet *from* those addresses. The client's address
(10.203.X.254) is not filtered: the client goes on reaching A through the cut, the split-brain
case the fence exists for: A must not apply a step once its lease may have expired.

Checked, with the times printed:
1. A exits with code 75 ("lost its etcd lease") within its lease time (10 s) plus slack of the cut.
2. The majority takes the job over: LocateJob on B names a new leader (B or C), generation 1,
   resumed from the latest checkpoint; the client sees one JobMoved at that step (a multiple of
   5) and finishes every step; its final parameters equal an uninterrupted run's on the same
   plan (a first job on the same cluster, before the partition) bitwise.
3. The step log: A's steps are 1, 2, ... consecutively, the new leader's run from the moved step
   + 1 to the last step, and every line of A is earlier than every line of the new leader.
4. A applied steps after the cut (the client did reach it), and none after it exited (nor after
   its "lost its etcd lease" line, but for a step that passed the fence just before).

pyrannc sends an optimizer step with the client's next call: the daemon logs step n about when
the client prints step n + 1. The cut is timed from its first rule (the bounds) or its last (what
A applied after it). The uninterrupted job ('whole') stays registered under A after its client
exits, so the majority takes it over too (from its step 40) when A's lease ends; nothing drives it.

Needs root (CAP_NET_ADMIN), a writable /run/netns and etcd (Debian's etcd-server): the py_test is
tagged to run outside the Bazel sandbox. Without root it fails saying so; RANNC_SKIP_NETNS=1 or a
missing etcd skips it, loudly.
"""

import contextlib
import datetime
import os
import queue
import random
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLIENT_ROOT = os.path.join(ROOT, "python_client")
TESTS_DIR = os.path.join(CLIENT_ROOT, "tests")
sys.path.insert(0, CLIENT_ROOT)

import grpc  # noqa: E402
from pyrannc.proto.rannc.v1 import cluster_pb2  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2 as pb  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc  # noqa: E402


def _binary(relpath):
    for candidate in (os.path.join(ROOT, relpath), os.path.join(ROOT, "bazel-bin", relpath)):
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    return None  # the fixture fails, saying so


RANNCD = os.environ.get("RANNC_DAEMON_BIN") or _binary("daemon/ranncd")
ETCD = os.environ.get("RANNC_ETCD_BIN", "/usr/bin/etcd")
ETCDCTL = os.environ.get("RANNC_ETCDCTL_BIN", "/usr/bin/etcdctl")
PORT = 7411  # each namespace has its own ports: no clash with anything outside
ETCD_PORT = 2379  # on the bridge's own address: no clash with an etcd on loopback
HEARTBEAT_MS = 200
PEER_TIMEOUT_S = 3.0
LEASE_TTL_S = 10.0  # ranncd's etcd lease (daemon/daemon.cc)
# How long after the cut A may take to exit: its lease's TTL, and slack for a loaded 2-core
# machine (the fence itself trips 0.9 x TTL after the last answered keep-alive was sent).
EXIT_BOUND_S = LEASE_TTL_S + 5.0
# ... and the majority to take the job over: the lease expires in etcd at most a TTL after the
# cut, then a daemon watching the registry wins the leadership and resumes the checkpoint.
TAKEOVER_BOUND_S = LEASE_TTL_S + 12.0
STEPS = 40
CHECKPOINT_EVERY = 5
CUT_AFTER_STEP = 6  # just after the first checkpoint: A goes on for a while, alone with etcd cut
# The partitioned run sleeps between steps, so that training still runs when A's fence trips
# (about 6-9 s after the cut): at 0.5 s a step A applies 10-20 more steps alone.
STEP_PAUSE_S = 0.5


def _ip(*args, check=True):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done


def _tc(ns, *args, check=True):
    """tc in namespace `ns` (None: the root namespace)."""
    cmd = ["tc"] + (["-n", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
    return done


_BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"


class BridgedNetns:
    """A bridge in the root namespace (the client's and etcd's addresses on it) and three
    namespaces, each with a veth whose other end is a port of the bridge; names carry the pid.

    ns[k] holds dev[k] with ip[k] = 10.203.X.(k+1)/24; port[k] is its root end. destroy() removes
    everything create() made (a namespace takes its veth with it) and never raises."""

    def __init__(self, count=3):
        tag = f"{os.getpid()}{random.randrange(16 ** 3):03x}"
        self.count = count
        self.ns = [f"rannc-e{k}-{tag}" for k in range(count)]
        self.dev = [f"re{k}n{tag}"[:15] for k in range(count)]  # interface names: <= 15 chars
        self.port = [f"re{k}r{tag}"[:15] for k in range(count)]
        self.bridge = f"rebr{tag}"[:15]
        subnet = random.randrange(1, 255)
        self.ip = [f"10.203.{subnet}.{k + 1}" for k in range(count)]
        self.client_ip = f"10.203.{subnet}.254"  # first on the bridge: the root's source address
        self.etcd_ip = f"10.203.{subnet}.253"
        self.created_ns = []
        self.bridge_made = False
        self.isolated = set()
        self.bridge_nf = None  # bridge-nf-call-iptables as found, when this test changed it

    def create(self):
        for ns in self.ns:
            done = _ip("netns", "add", ns, check=False)
            if done.returncode != 0:
                pytest.fail(f"`ip netns add {ns}` failed: {done.stderr.strip()}. This test needs "
                            f"root (CAP_NET_ADMIN) and a writable /run/netns, outside Bazel's "
                            f"sandbox; set RANNC_SKIP_NETNS=1 to skip it")
            self.created_ns.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_made = True
        # The bridge forwards between the namespaces at L2. With br_netfilter loaded, bridged
        # frames also pass iptables' FORWARD chain, which a host running e.g. Docker sets to DROP:
        # that would cut B and C off from each other. Bridged traffic skips iptables while this
        # test runs (the sysctl is per network namespace; restored by destroy()).
        if os.path.exists(_BRIDGE_NF):
            with open(_BRIDGE_NF) as f:
                found = f.read().strip()
            if found != "0":
                with open(_BRIDGE_NF, "w") as f:
                    f.write("0")
                self.bridge_nf = found
        _ip("addr", "add", f"{self.client_ip}/24", "dev", self.bridge)
        _ip("addr", "add", f"{self.etcd_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for k in range(self.count):
            _ip("link", "add", self.port[k], "type", "veth", "peer", "name", self.dev[k])
            _ip("link", "set", self.dev[k], "netns", self.ns[k])
            _ip("-n", self.ns[k], "addr", "add", f"{self.ip[k]}/24", "dev", self.dev[k])
            _ip("-n", self.ns[k], "link", "set", self.dev[k], "up")
            _ip("link", "set", self.port[k], "master", self.bridge, "up")
        return self

    def exec_args(self, k, *cmd):
        return ["ip", "netns", "exec", self.ns[k], *cmd]

    @staticmethod
    def _drop(ns, dev, direction, addresses):
        """An htb root on `dev` whose u32 filters send every IPv4 packet with `direction`
        ("dst" or "src") in `addresses` to a blackhole qdisc; the rest passes unshaped (htb's
        default 0: unclassified packets go straight out)."""
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb")
        _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate",
            "1mbit")
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "blackhole")
        for address in addresses:
            _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", direction, f"{address}/32", "flowid", "1:2")

    def isolate(self, k):
        """Cuts namespace k off from etcd and from the other namespaces, silently, both ways; the
        client's address stays reachable."""
        others = [self.etcd_ip] + [ip for j, ip in enumerate(self.ip) if j != k]
        self.isolated.add(k)
        self._drop(self.ns[k], self.dev[k], "dst", others)  # k -> them
        self._drop(None, self.port[k], "src", others)  # them -> k (the bridge's way out to k)

    def dropped(self, k):
        """Packets the blackholes of namespace k's cut dropped: (k -> them, them -> k)."""
        def count(ns, dev):
            out = _tc(ns, "-s", "qdisc", "show", "dev", dev, check=False).stdout
            m = re.search(r"qdisc blackhole 20:.*?dropped (\d+)", out, re.S)
            return int(m.group(1)) if m else 0
        return count(self.ns[k], self.dev[k]), count(None, self.port[k])

    def heal(self, k):
        _tc(self.ns[k], "qdisc", "del", "dev", self.dev[k], "root", check=False)
        _tc(None, "qdisc", "del", "dev", self.port[k], "root", check=False)
        self.isolated.discard(k)

    def destroy(self):
        for k in list(self.isolated):
            self.heal(k)
        for ns in self.created_ns:
            _ip("netns", "del", ns, check=False)
        self.created_ns = []
        for port in self.port:  # a veth whose namespace end never moved, or is not gone yet
            if _ip("link", "show", "dev", port, check=False).returncode == 0:
                _ip("link", "del", port, check=False)
        if self.bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self.bridge_made = False
        if self.bridge_nf is not None:
            try:
                with open(_BRIDGE_NF, "w") as f:
                    f.write(self.bridge_nf)
            except OSError:
                pass
            self.bridge_nf = None

    def leftovers(self):
        """What of this test is still there (namespaces, links): [] once destroy() is done."""
        left = [ns for ns in self.ns if ns in _ip("netns", "list").stdout.split()]
        deadline = time.monotonic() + 5  # a deleted namespace's veth goes asynchronously
        while True:
            links = [d for d in self.port + [self.bridge]
                     if _ip("link", "show", "dev", d, check=False).returncode == 0]
            if not links or time.monotonic() > deadline:
                return left + links
            time.sleep(0.1)


def _free_loopback_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Etcd:
    """A one-member etcd in the root namespace, its client URL on the bridge's second address."""

    def __init__(self, net, tmp_path):
        self.endpoint = f"{net.etcd_ip}:{ETCD_PORT}"
        self.url = f"etcd://{self.endpoint}"
        self.log_path = str(tmp_path / "etcd.log")
        peer = f"http://127.0.0.1:{_free_loopback_port()}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "m0", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"m0={peer}", "--initial-cluster-state", "new",
             "--logger", "zap", "--log-outputs", "stderr"],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while self.ctl("endpoint", "health").returncode != 0:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def ctl(self, *args):
        return subprocess.run([ETCDCTL, "--endpoints", self.endpoint, *args],
                              env=dict(os.environ, ETCDCTL_API="3"), capture_output=True,
                              text=True, timeout=30)

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Ranncd:
    """One daemon, in namespace k, on the cluster store; its log goes to a file (appended to:
    a daemon started again in namespace k writes after its predecessor)."""

    def __init__(self, net, k, store, env, logdir):
        self.name = "ABC"[k]
        self.address = f"{net.ip[k]}:{PORT}"
        self.log_path = os.path.join(logdir, f"ranncd-{self.name}.log")
        self.log = open(self.log_path, "a")
        # UCX would move the tensors between two daemons of one host through shared memory or
        # CMA (process_vm_readv), which ignore network namespaces: TCP over the veth only.
        env = dict(env, UCX_TLS="self,tcp", UCX_NET_DEVICES=net.dev[k], RANNC_STATE_DIR="none")
        self.proc = subprocess.Popen(net.exec_args(
            k, RANNCD, "--listen", self.address, "--devices", "cpu:2", "--device-memory", "1GiB",
            "--peers", ",".join(f"{ip}:{PORT}" for ip in net.ip), "--cluster-store", store,
            "--heartbeat-interval", f"{HEARTBEAT_MS}ms", "--peer-timeout", f"{PEER_TIMEOUT_S}s",
            "--profile-cache", "none", "--links", "p2p=5GB/s,allreduce=2:3GB/s;4:2GB/s",
            "--insecure"),  # a private network of namespaces, neither TLS nor tokens
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # ip netns exec execs the daemon: this pid is ranncd's, its exit code ranncd's.
        self.channel = grpc.insecure_channel(self.address)
        self.stub = rpc.TrainingServiceStub(self.channel)

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def all_up(self, count):
        try:
            info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=2)
        except grpc.RpcError:
            # A channel that failed to connect waits out gRPC's reconnect backoff (seconds) even
            # once the daemon listens; a new one connects at once.
            self.channel.close()
            self.channel = grpc.insecure_channel(self.address)
            self.stub = rpc.TrainingServiceStub(self.channel)
            return False
        return len(info.cluster) == count and all(
            m.state == cluster_pb2.MEMBER_UP for m in info.cluster)

    def locate(self, name):
        return self.stub.LocateJob(pb.LocateJobRequest(name=name), timeout=5)

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self):
        self.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.channel.close()


class Cluster:
    def __init__(self, net, etcd, daemons, env, tmp_path):
        self.net, self.etcd, self.daemons, self.env = net, etcd, daemons, env
        self.addresses = [d.address for d in daemons]
        self.tmp_path = tmp_path

    def logs(self):
        return "\n".join(f"--- {d.name} {d.address}:\n{d.output()}" for d in self.daemons)

    def client_env(self, job, **overrides):
        """The client's environment for job `job`; `overrides` replace its RANNC_* keys."""
        env = dict(self.env, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=",".join(self.addresses),
                   RANNC_JOB=job, RANNC_CHECKPOINT_DIR=str(self.tmp_path / "ckpt"),
                   RANNC_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY), RANNC_CALL_RETRY_TIMEOUT="90",
                   # A plan uses the leading daemon's devices first: A's two, A alone.
                   RANNC_PARTITION_NUM="1", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="1")
        env.update(overrides)
        return env


def skip_or_fail_without_netns(what):
    """Skips (loudly) with RANNC_SKIP_NETNS=1 or without etcd; fails without root or ranncd."""
    if os.environ.get("RANNC_SKIP_NETNS") == "1":
        pytest.skip(f"SKIPPED LOUDLY: RANNC_SKIP_NETNS=1: {what} over network namespaces did "
                    f"not run")
    if not os.access(ETCD, os.X_OK) or not os.access(ETCDCTL, os.X_OK):
        pytest.skip(f"SKIPPED LOUDLY: {ETCD} or {ETCDCTL} is missing (Debian's etcd-server and "
                    f"etcd-client; deploy/setup.sh installs them): {what} did not run")
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root (CAP_NET_ADMIN, a writable /run/netns) to make network "
                    "namespaces, a bridge and tc rules, outside Bazel's sandbox; set "
                    "RANNC_SKIP_NETNS=1 to skip it")
    assert RANNCD and os.access(RANNCD, os.X_OK), \
        f"no ranncd binary ({RANNCD}): build //daemon:ranncd or set RANNC_DAEMON_BIN"


@contextlib.contextmanager
def etcd_cluster(tmp_path):
    """The namespaces, etcd and the three daemons, once all three list each other UP; all
    stopped and removed after (the chaos test's cluster too)."""
    conf_dir = tmp_path / "conf"  # no user config leaks into the daemons and clients
    conf_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANNC_")}
    env["RANNC_CONF_DIR"] = str(conf_dir)
    net = BridgedNetns()
    etcd, daemons = None, []
    try:
        net.create()
        etcd = Etcd(net, tmp_path)
        daemons = [Ranncd(net, k, etcd.url, env, str(tmp_path)) for k in range(3)]
        c = Cluster(net, etcd, daemons, env, tmp_path)
        start = time.monotonic()
        while not all(d.all_up(3) for d in daemons):
            for d in daemons:
                assert d.proc.poll() is None, f"{d.name} exited ({d.proc.returncode})\n" + c.logs()
            assert time.monotonic() - start < 60, \
                "the three daemons did not all list each other UP within 60 s\n" + c.logs()
            time.sleep(0.1)
        print(f"\ncluster A, B, C = {c.addresses} on {etcd.url}: all UP "
              f"{time.monotonic() - start:.2f} s after start")
        yield c
    finally:
        # All at once: with --cluster-store, a daemon stopped alone hands its jobs to the others.
        # (A restarted daemon is in c.daemons, in its predecessor's place.)
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.stop()
        if etcd is not None:
            etcd.stop()
        net.destroy()
        left = net.leftovers()
        assert not left, f"left behind: {left}"


@pytest.fixture
def cluster(tmp_path):
    skip_or_fail_without_netns("the etcd partition test")
    with etcd_cluster(tmp_path) as c:
        yield c


_CLIENT = textwrap.dedent("""
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
            print("step", step, time.time(), flush=True)
            time.sleep({pause})
        except pyrannc.JobMoved as moved:
            print("moved", moved.step, moved.leader, moved.job_id, time.time(), flush=True)
            moves.append([moved.step, moved.leader, moved.job_id, time.time()])
            step = moved.step
    torch.save({{"state": rmod.state_dict(), "moves": moves,
                "devices": list(rmod._job.devices)}}, {out!r})
""")


def _reader(stream, lines):
    for line in stream:
        lines.put((time.time(), line.rstrip("\n")))
    lines.put((time.time(), None))


_SPDLOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\]")


def _log_line_unix(log, needle):
    """The unix time of the first line of `log` containing `needle`, from spdlog's local-time
    stamp ([YYYY-mm-dd HH:MM:SS.mmm]); None when there is none or it does not parse."""
    for line in log.splitlines():
        if needle in line:
            m = _SPDLOG_TIME.match(line)
            if m:
                return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            return None
    return None


def test_a_daemon_cut_off_from_etcd_stops_and_the_majority_takes_its_job_over(tmp_path, cluster):
    a, b, c = cluster.daemons
    net = cluster.net

    # The uninterrupted run, on the same plan (A's two devices), before anything is cut.
    whole_out = str(tmp_path / "whole.pt")
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT.format(tests=TESTS_DIR, steps=STEPS, pause=0,
                                              out=whole_out)],
        env=cluster.client_env("whole"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + cluster.logs()
    whole = torch.load(whole_out)
    assert whole["moves"] == [], whole["moves"]
    assert all(d.startswith(a.address + "/") for d in whole["devices"]), whole["devices"]

    out = str(tmp_path / "split.pt")
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT.format(tests=TESTS_DIR, steps=STEPS, pause=STEP_PAUSE_S,
                                              out=out)],
        env=cluster.client_env("split"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    lines = queue.Queue()
    threading.Thread(target=_reader, args=(client.stdout, lines), daemon=True).start()
    seen = []  # (unix time, line) of the client's stdout
    marks = []  # (unix time, what) of the test's doings, for client.out
    stderr_lines = []
    threading.Thread(target=lambda: stderr_lines.extend(client.stderr), daemon=True).start()

    def story():
        return ("--- client stdout:\n" + "\n".join(f"{t:.3f} {l}" for t, l in seen) +
                "\n--- client stderr:\n" + "".join(stderr_lines) + "\n" + cluster.logs())

    try:
        # Until the step after the first checkpoint.
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "no step %d within 120 s\n" % CUT_AFTER_STEP + \
                story()
            try:
                t, line = lines.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, "the client ended before the cut\n" + story()
            seen.append((t, line))
            if line.split()[:2] == ["step", str(CUT_AFTER_STEP)]:
                break
        entry = b.locate("split")
        assert entry.leader == a.address and entry.generation == 0, entry
        assert entry.devices and all(d.startswith(a.address + "/") for d in entry.devices), entry
        first_job_id = entry.job_id

        cut = time.time()  # from the first rule: the bounds below count from here
        net.isolate(0)
        cut_done = time.time()
        marks.append((cut, "TEST: cutting A off"))
        marks.append((cut_done, "TEST: A cut off"))
        print(f"A ({a.address}) cut off from etcd ({cluster.etcd.endpoint}), B and C after "
              f"step {CUT_AFTER_STEP} (the rules took {cut_done - cut:.2f} s); the client "
              f"({net.client_ip}) still reaches it")

        a_exit = takeover = None
        located = None
        next_locate = 0.0
        client_done = False
        deadline = time.monotonic() + 90
        while not (client_done and a_exit is not None and takeover is not None):
            assert time.monotonic() < deadline, (
                f"90 s after the cut: client done {client_done}, A exited {a_exit}, "
                f"taken over {takeover}\n" + story())
            if a_exit is None and a.proc.poll() is not None:
                a_exit = time.time()
            if takeover is None and time.monotonic() >= next_locate:
                next_locate = time.monotonic() + 0.1
                try:
                    now = b.locate("split")
                    if now.leader != a.address:
                        takeover, located = time.time(), now
                except grpc.RpcError:
                    pass
            try:
                t, line = lines.get(timeout=0.02)
                if line is None:
                    client_done = True
                else:
                    seen.append((t, line))
            except queue.Empty:
                pass
        client.wait(timeout=30)
        assert client.returncode == 0, story()
        dropped = net.dropped(0)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        # For a post-mortem (pytest --basetemp=DIR keeps them).
        with open(tmp_path / "client.out", "w") as f:
            f.write("".join(f"{t:.3f} {l}\n" for t, l in sorted(seen + marks)))
        with open(tmp_path / "client.err", "w") as f:
            f.write("".join(stderr_lines))

    # 1. A stopped driving the job within its lease time, and said why.
    a_log = a.output()
    lost_at = _log_line_unix(a_log, "lost its etcd lease")
    print(f"cut -> A's exit ({a.proc.returncode}): {a_exit - cut:.2f} s"
          + (f" (its 'lost its etcd lease' line {lost_at - cut:.2f} s after the cut)"
             if lost_at else "") + f"; the blackholes dropped {dropped[0]} packets from A, "
          f"{dropped[1]} to A")
    assert a.proc.returncode == 75, f"A exited {a.proc.returncode}\n" + story()
    assert "lost its etcd lease" in a_log, a_log
    assert a_exit - cut < EXIT_BOUND_S, story()
    assert dropped[0] > 0 and dropped[1] > 0, dropped  # the cut did cut something, both ways

    # 2. The majority took it over: a new leader, generation 1, from the latest checkpoint.
    moves = [line.split() for _, line in seen if line.startswith("moved")]
    assert len(moves) == 1, story()
    _, moved_step, moved_leader, moved_job_id, moved_at = moves[0]
    moved_step, moved_at = int(moved_step), float(moved_at)
    print(f"cut -> takeover (LocateJob on B names {located.leader}): {takeover - cut:.2f} s; "
          f"cut -> the client's JobMoved (step {moved_step}): {moved_at - cut:.2f} s")
    assert located.leader in (b.address, c.address), located
    assert takeover - cut < TAKEOVER_BOUND_S, story()
    final = b.locate("split")
    assert (final.leader == located.leader and final.generation == 1 and
            final.job_id != first_job_id and final.resumed_step == moved_step), final
    assert all(d.startswith(final.leader + "/") for d in final.devices), final
    assert moved_step > 0 and moved_step % CHECKPOINT_EVERY == 0, moves
    assert moved_leader == final.leader and moved_job_id == final.job_id, (moves, final)
    steps_done = [int(line.split()[1]) for _, line in seen if line.startswith("step")]
    assert steps_done[-1] == STEPS, story()
    got = torch.load(out)
    assert got["moves"][0][:3] == [moved_step, final.leader, final.job_id], got["moves"]
    assert all(d.startswith(final.leader + "/") for d in got["devices"]), got["devices"]
    for name, value in whole["state"].items():
        assert torch.equal(got["state"][name], value), f"{name} differs after the failover"

    # 3. The step log: two runs, one after the other, never at the same time.
    with open(tmp_path / "ckpt" / "split" / "steps.log") as f:
        log = [line.split() for line in f if line.strip()]
    by = {}
    for t, daemon, job_id, n in log:
        by.setdefault(daemon, []).append((int(t) / 1000.0, job_id, int(n)))
    assert set(by) == {a.address, final.leader}, log
    first, second = by[a.address], by[final.leader]
    assert {j for _, j, _ in first} == {first_job_id}, first
    assert {j for _, j, _ in second} == {final.job_id}, second
    assert [n for _, _, n in first] == list(range(1, len(first) + 1)), first
    assert len(first) >= moved_step, (moved_step, first)
    assert [n for _, _, n in second] == list(range(moved_step + 1, STEPS + 1)), second
    a_last, new_first = max(t for t, _, _ in first), min(t for t, _, _ in second)
    print(f"step log: A applied steps 1..{len(first)} (the last {a_last - cut:.2f} s after the "
          f"cut), {final.leader} steps {moved_step + 1}..{STEPS} (the first "
          f"{new_first - cut:.2f} s after the cut): {new_first - a_last:.2f} s apart")
    assert a_last < new_first, log

    # 4. The client reached A through the cut (A applied steps alone, its lease still good), and
    # A applied none once it had exited, nor once it had said it lost its lease.
    after_cut = [n for t, _, n in first if t > cut_done]
    print(f"A applied {len(after_cut)} steps after the cut ({after_cut[:1]}..{after_cut[-1:]})")
    assert after_cut, "the client did not reach A after the cut\n" + story()
    assert a_last <= a_exit, (a_last, a_exit)
    if lost_at is not None:
        # A step that passed the fence a moment before the lease's sure time ran out may write
        # its line a few milliseconds after the lost line (etcd keeps the lease a tenth of its
        # TTL longer than that time, for this): not later than that.
        assert a_last <= lost_at + 0.1 * LEASE_TTL_S, (a_last, lost_at)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s", "-p", "no:cacheprovider"]))
