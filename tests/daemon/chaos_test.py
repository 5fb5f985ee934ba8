"""Chaos (issue 25): three ranncd on one etcd, each in a network namespace on a bridge
(cluster_etcd_netns_test.py's topology and helpers), train one checkpointed job while the test,
round after round, injects a fault chosen at random:

  kill_leader  SIGKILL the job's leading daemon; restart it once the job has moved
  kill_part    SIGKILL the daemon running the job's other stage; restart it likewise
  kill_spare   SIGKILL the daemon the job does not use; restart it
  slow_link    one daemon's link, both ways, throttled to 2 Mbit/s by a token bucket that holds
               up to 100 ms of packets and drops the rest (tc tbf on both ends of its veth), for
               LINK_FAULT_S seconds
  flapping_link  one daemon cut off from etcd and the other daemons (cluster_etcd_netns_test's
               blackhole rules) for 0.4 s of every 1.4 s, for LINK_FAULT_S seconds: every packet
               in those windows dropped, silently
  disk_full    fill the checkpoint filesystem (a tmpfs of its own) until a checkpoint fails; hold
               it a few steps; then, half the time, SIGKILL the leader while it is full (the job
               must come back from the last checkpoint committed before); free it

The job: TinyGPT, Adam, 2 stages x 2 replicas x 2 micro-batches over two of the daemons (each
cpu:2), a checkpoint every CHECKPOINT_EVERY steps into the tmpfs; its client (RANNC_DAEMON=A,B,C)
follows the job when it moves (pyrannc.JobMoved) and goes on from the step it moved to.

Checked, each round, with the times printed:
  - a kill of a daemon the job uses reaches the client as one JobMoved within the etcd lease's
    TTL plus slack for a loaded 2-core machine (TAKEOVER_BOUND_S, 22 s: on etcd a daemon is
    DOWN once its lease ends, 10 s, for its part's leader as for the daemons that take a lost
    leader's jobs over), at the newest checkpoint committed before the kill or later (no
    committed step lost), never at a step that was not committed;
  - a kill of the spare moves nothing; a link fault moves nothing either, unless it outlasts
    a peer timeout, when the move is checked as a kill's (printed);
  - a full disk fails the checkpoints written meanwhile (ListCheckpoints reports the error), and
    training goes on; the committed checkpoints stay as they were;
and at the end the client's parameters equal an uninterrupted run's on the same plan, bitwise,
and every daemon that was restarted rejoined (all three UP).

RANNC_CHAOS_ROUNDS (default 6: CI) rounds; RANNC_CHAOS_SEED picks the faults (default: random,
printed). The report line "chaos: N rounds survived (...)" counts them by kind.

tc netem is what the issue names for delays and drops, but this machine's kernel has no netem
(CONFIG_NET_SCH_NETEM unset; its qdiscs are htb, tbf, pfifo and blackhole): the delays come from
tbf's queue and the drops from tbf's overflow and the blackhole windows.

Needs root (network namespaces, tc, mount) and etcd, outside Bazel's sandbox: as
cluster_etcd_netns_test.py, RANNC_SKIP_NETNS=1 skips it loudly.
"""

import os
import queue
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_etcd_netns_test import (  # noqa: E402
    _CLIENT, Ranncd, TAKEOVER_BOUND_S, TESTS_DIR, _reader, _tc, etcd_cluster, grpc, pb,
    skip_or_fail_without_netns)

ROUNDS = int(os.environ.get("RANNC_CHAOS_ROUNDS", "6"))
SEED = int(os.environ.get("RANNC_CHAOS_SEED") or random.randrange(1 << 30))
CHECKPOINT_EVERY = 4
STEPS_PER_ROUND = 12  # client steps between two faults (a checkpoint or two among them)
# Enough for every round: a link fault lasts LINK_FAULT_S while training goes on (~50 steps).
STEPS = ROUNDS * 60 + 2 * STEPS_PER_ROUND
STEP_PAUSE_S = 0.1
LINK_FAULT_S = 6.0
# On etcd a member is DOWN once its lease ends (LEASE_TTL_S): a part's loss fails the leader's
# next call to it at once, but the leader brings the job back over the members that are UP only
# then; a leader's loss lets another daemon take the job over then. Either way the client's
# retried call learns that the job moved within the lease's TTL plus slack (TAKEOVER_BOUND_S).
KINDS = ("kill_leader", "kill_part", "kill_spare", "slow_link", "flapping_link", "disk_full")


class Chaos:
    def __init__(self, cluster, tmp_path):
        self.cluster = cluster
        self.tmp_path = tmp_path
        self.lines = queue.Queue()
        self.seen = []  # (unix time, line) of the client's stdout
        self.marks = []  # (unix time, what the test did)
        self.stderr = []
        self.client = None
        self.step = 0  # the client's last printed step
        self.done = False
        self.moves = []  # (time seen, step, leader, job id)
        self.ever_committed = set()  # every step seen committed

    # The client.

    def start_client(self, out):
        self.client = subprocess.Popen(
            [sys.executable, "-c", _CLIENT.format(tests=TESTS_DIR, steps=STEPS,
                                                  pause=STEP_PAUSE_S, out=out)],
            env=self.cluster.client_env("chaos", **CLIENT_KEYS), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        threading.Thread(target=_reader, args=(self.client.stdout, self.lines),
                         daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.client.stderr),
                         daemon=True).start()

    def pump(self, timeout=0.05):
        """Reads what the client printed meanwhile."""
        try:
            t, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            if line is None:
                self.done = True
            else:
                self.seen.append((t, line))
                words = line.split() or [""]
                if words[0] == "step":
                    self.step = int(words[1])
                elif words[0] == "moved":
                    self.moves.append((t, int(words[1]), words[2], words[3]))
            try:
                t, line = self.lines.get_nowait()
            except queue.Empty:
                return

    def wait_for(self, what, cond, limit):
        deadline = time.monotonic() + limit
        while not cond():
            assert time.monotonic() < deadline, f"{what}: not within {limit} s\n" + self.story()
            assert not self.done or cond(), f"{what}: the client ended first\n" + self.story()
            self.pump()

    def story(self):
        return ("--- the test and the client:\n" +
                "\n".join(f"{t:.3f} {l}" for t, l in sorted(self.seen + self.marks)) +
                "\n--- client stderr:\n" + "".join(self.stderr) + "\n" + self.cluster.logs())

    def mark(self, what):
        self.marks.append((time.time(), "TEST: " + what))
        print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)

    # The cluster.

    def locate(self):
        for d in self.cluster.daemons:
            if d.proc.poll() is None:
                try:
                    return d.locate("chaos")
                except grpc.RpcError:
                    continue
        raise AssertionError("no daemon answers LocateJob\n" + self.story())

    def committed(self):
        """The steps of the job's committed checkpoints (a step directory with its manifest)."""
        job_dir = self.tmp_path / "ckpt" / "chaos"
        if not job_dir.exists():
            return []
        steps = sorted(int(p.name.split("-")[1]) for p in job_dir.glob("step-*")
                       if (p / "manifest.json").exists())
        self.ever_committed.update(steps)  # checkpoint_keep prunes the older ones later
        return steps

    def daemon_of(self, address):
        return next(k for k, d in enumerate(self.cluster.daemons) if d.address == address)

    def kill(self, k):
        d = self.cluster.daemons[k]
        d.proc.kill()
        d.proc.wait()
        self.mark(f"SIGKILLed {d.name} ({d.address})")

    def restart(self, k):
        old = self.cluster.daemons[k]
        old.stop()
        new = Ranncd(self.cluster.net, k, self.cluster.etcd.url, self.cluster.env,
                     str(self.tmp_path))
        self.cluster.daemons[k] = new
        self.wait_for(f"{new.name} restarted and all three UP",
                      lambda: all(d.all_up(3) for d in self.cluster.daemons), 60)
        self.mark(f"{new.name} restarted; all three UP")

    def expect_move(self, before, since, bound, what):
        """The client's one JobMoved after `before` moves, within `bound` s of `since`; returns
        its step."""
        self.wait_for(f"{what}: the client's JobMoved", lambda: len(self.moves) > before,
                      bound + 30)
        t, step, leader, _ = self.moves[before]
        took = t - since
        self.mark(f"{what}: the client moved to step {step} at {leader} {took:.2f} s after")
        assert took < bound, f"{what}: the move came {took:.2f} s after (bound {bound} s)\n" + \
            self.story()
        return step

    def check_step(self, step, committed_before, what):
        self.committed()
        assert step in self.ever_committed, (
            f"{what}: moved to step {step}, not a committed checkpoint "
            f"{sorted(self.ever_committed)}")
        assert step >= max(committed_before, default=0), (
            f"{what}: moved to step {step}; step {max(committed_before)} had been committed "
            f"before the fault (a committed step lost)\n" + self.story())

    # The faults.

    def kill_job_daemon(self, role):
        entry = self.locate()
        used = sorted({d.split("/")[0] for d in entry.devices})
        assert len(used) == 2 and entry.leader in used, entry
        target = entry.leader if role == "leader" else next(a for a in used if a != entry.leader)
        k = self.daemon_of(target)
        before, committed = len(self.moves), self.committed()
        since = time.time()
        self.kill(k)
        step = self.expect_move(before, since, TAKEOVER_BOUND_S, f"kill_{role}")
        self.check_step(step, committed, f"kill_{role}")
        self.restart(k)

    def kill_spare(self):
        entry = self.locate()
        used = {d.split("/")[0] for d in entry.devices}
        k = next(k for k, d in enumerate(self.cluster.daemons) if d.address not in used)
        before = len(self.moves)
        self.kill(k)
        self.restart(k)
        target = self.step + 3
        self.wait_for("3 steps after the spare's restart", lambda: self.step >= target, 60)
        assert len(self.moves) == before, "the spare's loss moved the job\n" + self.story()

    def link_fault(self, rng, kind):
        net = self.cluster.net
        k = rng.randrange(3)
        name = self.cluster.daemons[k].name
        before, start = len(self.moves), self.step
        since = time.time()
        if kind == "slow_link":
            rule = ["tbf", "rate", "2mbit", "burst", "16kb", "latency", "100ms"]
            _tc(net.ns[k], "qdisc", "add", "dev", net.dev[k], "root", *rule)
            _tc(None, "qdisc", "add", "dev", net.port[k], "root", *rule)
            self.mark(f"slow_link: {' '.join(rule)} on {name}'s link, both ways")
        else:
            self.mark(f"flapping_link: {name} cut off for 0.4 s of every 1.4 s")
        try:
            deadline = time.monotonic() + LINK_FAULT_S
            while time.monotonic() < deadline:
                if kind == "flapping_link":
                    net.isolate(k)
                    cut = time.monotonic() + 0.4
                    while time.monotonic() < cut:
                        self.pump()
                    net.heal(k)
                    up = time.monotonic() + 1.0
                    while time.monotonic() < up:
                        self.pump()
                else:
                    self.pump()
        finally:
            if kind == "slow_link":
                _tc(net.ns[k], "qdisc", "del", "dev", net.dev[k], "root", check=False)
                _tc(None, "qdisc", "del", "dev", net.port[k], "root", check=False)
            else:
                net.heal(k)
        target = self.step + 3
        self.wait_for(f"{kind}: 3 steps after it", lambda: self.step >= target, 90)
        moved = len(self.moves) - before
        self.mark(f"{kind} over: {self.step - start} steps meanwhile, {moved} moves")
        if moved:  # the fault outlasted a peer timeout: a move as a kill's
            t, step, _, _ = self.moves[before]
            assert t - since < LINK_FAULT_S + TAKEOVER_BOUND_S, self.story()
            self.check_step(step, [], kind)

    def disk_full(self, rng):
        ckpt = self.tmp_path / "ckpt"
        ballast = ckpt / "ballast"
        committed = self.committed()
        st = os.statvfs(ckpt)
        with open(ballast, "wb") as f:  # every free block
            chunk = b"\0" * (1 << 20)
            try:
                for _ in range(st.f_bavail * st.f_frsize // len(chunk) + 1):
                    f.write(chunk)
                f.flush()
            except OSError:
                pass
        self.mark(f"checkpoint disk full ({os.statvfs(ckpt).f_bavail} blocks free)")
        kill = rng.random() < 0.5
        try:
            # Two checkpoints' worth of steps: each fails, training goes on.
            target = self.step + 2 * CHECKPOINT_EVERY + 1
            self.wait_for("steps while the disk is full", lambda: self.step >= target, 90)
            entry = self.locate()
            stub = self.cluster.daemons[self.daemon_of(entry.leader)].stub
            listed = stub.ListCheckpoints(pb.CheckpointsRef(job_id=entry.job_id), timeout=10)
            self.mark(f"disk full: {self.committed()} committed, the daemon reports "
                      f"{listed.error!r}")
            assert "No space left" in listed.error, listed
            assert self.committed() == committed, (committed, self.committed())
            if kill:
                self.kill_job_daemon("leader")  # back to the checkpoint before the full disk
        finally:
            ballast.unlink()
            self.mark("checkpoint disk freed")
        target = self.step + CHECKPOINT_EVERY + 1
        self.wait_for("a checkpoint after the disk is freed",
                      lambda: self.step >= target and len(self.committed()) > 0 and
                      max(self.committed()) > max(committed, default=0), 90)
        return "disk_full+kill_leader" if kill else "disk_full"


CLIENT_KEYS = dict(RANNC_PARTITION_NUM="2", RANNC_REPLICA_NUM="2", RANNC_PIPELINE_NUM="2",
                   RANNC_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY))


@pytest.fixture
def chaos_cluster(tmp_path):
    skip_or_fail_without_netns("the chaos test")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # The checkpoints' own filesystem, which disk_full fills: 64 MiB (a checkpoint is ~100 KB).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "rannc-chaos", str(ckpt)],
                   check=True)
    try:
        with etcd_cluster(tmp_path) as c:
            yield c
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


def test_a_job_survives_rounds_of_kills_network_faults_and_a_full_disk(tmp_path, chaos_cluster):
    cluster = chaos_cluster
    rng = random.Random(SEED)
    print(f"\nchaos: {ROUNDS} rounds, RANNC_CHAOS_SEED={SEED}; cluster {cluster.addresses}")

    # The uninterrupted run on the same plan, then its job deleted (it would be taken over too).
    whole_out = str(tmp_path / "whole.pt")
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT.format(tests=TESTS_DIR, steps=STEPS, pause=0,
                                              out=whole_out)],
        env=cluster.client_env("whole", **CLIENT_KEYS), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr + cluster.logs()
    whole = torch.load(whole_out)
    a = cluster.daemons[0]
    for job in a.stub.ListJobs(pb.Empty(), timeout=10).jobs:
        a.stub.DeleteJob(pb.JobRef(job_id=job.job_id), timeout=30)

    chaos = Chaos(cluster, tmp_path)
    out = str(tmp_path / "chaos.pt")
    chaos.start_client(out)
    survived = []
    try:
        for r in range(ROUNDS):
            # Some steps first, and a checkpoint committed since the last fault.
            target = chaos.step + STEPS_PER_ROUND // 2
            chaos.wait_for(f"round {r}: steps before the fault",
                           lambda: chaos.step >= target and chaos.committed(), 120)
            kind = rng.choice(KINDS)
            chaos.mark(f"round {r}: {kind} at step {chaos.step}")
            if kind == "kill_leader":
                chaos.kill_job_daemon("leader")
            elif kind == "kill_part":
                chaos.kill_job_daemon("part")
            elif kind == "kill_spare":
                chaos.kill_spare()
            elif kind in ("slow_link", "flapping_link"):
                chaos.link_fault(rng, kind)
            else:
                kind = chaos.disk_full(rng)
            survived.append(kind)
        chaos.wait_for("the client's last step", lambda: chaos.done, 300)
        chaos.client.wait(timeout=30)
        assert chaos.client.returncode == 0, chaos.story()
    finally:
        if chaos.client is not None and chaos.client.poll() is None:
            chaos.client.kill()
            chaos.client.wait()
        with open(tmp_path / "chaos.out", "w") as f:  # pytest --basetemp=DIR keeps it
            f.write(chaos.story())

    got = torch.load(out)
    for name, value in whole["state"].items():
        assert torch.equal(got["state"][name], value), \
            f"{name} differs from the uninterrupted run's after {survived}\n" + chaos.story()
    assert all(d.all_up(3) for d in cluster.daemons), cluster.logs()
    counts = {k: survived.count(k) for k in sorted(set(survived))}
    print(f"chaos: {len(survived)} rounds survived ({counts}), {len(chaos.moves)} moves, "
          f"seed {SEED}; the final parameters equal the uninterrupted run's bitwise")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s", "-p", "no:cacheprovider"]))
