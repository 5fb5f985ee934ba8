"""Metrics, logs and health (issues 24 and 23, docs/observability.md): ranncd with
--metrics-listen serves Prometheus metrics, and the real Prometheus server (Debian's `prometheus`)
scrapes it while a job trains: PromQL over its HTTP API gives the job a step rate above 0 and its
device memory, and the daemon's gRPC calls by method and code; checkpoints and data-plane bytes
are counted. `rannc jobs` shows the numbers the endpoint serves; --log-format json writes one
JSON object per line naming the job; --health-listen serves liveness and readiness in plain
text for Kubernetes' probes."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request

import pytest

from conftest import CLIENT_ROOT, DaemonProcess, built_binary, free_port, stop_process

_PROMETHEUS = shutil.which("prometheus")

# Trains until the file `pause` appears, then stops stepping (the job stays, holding its
# memory) and prints its step count; exits once the file `exit` appears.
_TRAIN = textwrap.dedent("""
    import os, sys, time, torch
    import pyrannc
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 6, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 50))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rmod = pyrannc.RaNNCModule(model, opt)  # named by RANNC_JOB
    steps = 0
    deadline = time.monotonic() + 120
    while not os.path.exists({pause!r}) and time.monotonic() < deadline:
        x = torch.randint(0, 50, (8, 6))
        loss = rmod(x).logsumexp(1).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        steps += 1
        if steps == 3:
            print("training", flush=True)
        time.sleep(0.02)
    rmod.state_dict()  # the last step, which pyrannc defers to the next call, is sent
    print("paused", steps, flush=True)
    while not os.path.exists({exit!r}) and time.monotonic() < deadline + 60:
        time.sleep(0.1)
""")


def _get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _query(prometheus, promql):
    """The vector result of an instant PromQL query: [(labels, value)]."""
    body = json.loads(_get(f"http://{prometheus}/api/v1/query?"
                           + urllib.parse.urlencode({"query": promql})))
    assert body["status"] == "success", body
    return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]


def _scraped(text, name, **labels):
    """The value of the series `name{labels}` in Prometheus text, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


class _Prometheus:
    """The real Prometheus server, scraping `target` every second."""

    def __init__(self, tmp_path, target):
        self.address = f"127.0.0.1:{free_port()}"
        config = tmp_path / "prometheus.yml"
        config.write_text(textwrap.dedent(f"""
            global:
              scrape_interval: 1s
              scrape_timeout: 1s
            scrape_configs:
              - job_name: ranncd
                static_configs:
                  - targets: ["{target}"]
        """))
        self.log = tempfile.NamedTemporaryFile(prefix="prometheus-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [_PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={self.address}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if "Ready" in _get(f"http://{self.address}/-/ready", timeout=2):
                    break
            except OSError:
                pass
            assert self.proc.poll() is None, "prometheus exited:\n" + self.output()
            assert time.monotonic() < deadline, "prometheus not ready in 60 s:\n" + self.output()
            time.sleep(0.2)

    def output(self):
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for(self, promql, accept, what, timeout=60):
        """Polls `promql` until accept(result) holds; returns the result."""
        deadline = time.monotonic() + timeout
        result = []
        while time.monotonic() < deadline:
            result = _query(self.address, promql)
            if accept(result):
                return result
            time.sleep(0.5)
        targets = _get(f"http://{self.address}/api/v1/targets")
        raise AssertionError(f"{what}: {promql} gave {result} for {timeout} s; targets: "
                             f"{targets}")

    def stop(self):
        stop_process(self.proc)
        os.unlink(self.log.name)


@pytest.mark.skipif(_PROMETHEUS is None,
                    reason="SKIPPED LOUDLY: Debian's `prometheus` package is not installed "
                           "(deploy/setup.sh installs it); the scrape test did not run")
def test_prometheus_scrapes_a_training_job_and_rannc_jobs_shows_the_same(tmp_path,
                                                                         pyrannc_daemon):
    metrics = f"127.0.0.1:{free_port()}"
    daemon = DaemonProcess("--devices", "cpu:2", "--metrics-listen", metrics,
                           "--log-format", "json")
    prometheus = _Prometheus(tmp_path, metrics)
    pause, done = str(tmp_path / "pause"), str(tmp_path / "exit")
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAIN.format(pause=pause, exit=done)],
        env=dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON=daemon.address,
                 RANNC_JOB="metrics-job", RANNC_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
                 RANNC_CHECKPOINT_EVERY="20"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "training", trainer.stderr.read()
        # Prometheus sees the job step, holding device memory, and the daemon's calls.
        job = 'rannc_job="metrics-job"'
        rate = prometheus.wait_for(f"rate(rannc_job_steps_total{{{job}}}[5s])",
                                   lambda r: r and r[0][1] > 0, "a step rate above 0")
        assert rate[0][0]["job"] == "ranncd"  # Prometheus's own label is kept apart
        memory = prometheus.wait_for(f"rannc_job_device_memory_bytes{{{job}}}",
                                     lambda r: r and r[0][1] > 0, "the job's device memory")
        assert memory[0][1] >= 4 * (50 * 16 + 96 * 32 + 32 + 32 * 50 + 50)  # its parameters
        prometheus.wait_for(
            'rannc_grpc_server_handled_total{method="rannc.v1.TrainingService/Forward",code="OK"}',
            lambda r: r and r[0][1] > 0, "the Forward calls")
        prometheus.wait_for(f"rannc_job_step_seconds_count{{{job}}}",
                            lambda r: r and r[0][1] > 0, "the step-time histogram")
        prometheus.wait_for('rannc_jobs{state="DEPLOYED"}', lambda r: r and r[0][1] == 1,
                            "one deployed job")

        # Paused: the endpoint and `rannc jobs` give the same steps and memory.
        open(pause, "w").close()
        line = trainer.stdout.readline().split()
        assert line[0] == "paused", line
        steps = int(line[1])
        text = _get(f"http://{metrics}/metrics")
        assert _scraped(text, "rannc_job_steps_total", rannc_job="metrics-job") == steps
        served_memory = _scraped(text, "rannc_job_device_memory_bytes", rannc_job="metrics-job")
        tokens = _scraped(text, "rannc_job_tokens_total", rannc_job="metrics-job")
        assert tokens == steps * 8 * 6  # the token ids' elements of every training forward
        planned = _scraped(text, "rannc_job_planned_step_seconds", rannc_job="metrics-job")
        assert planned > 0
        # Checkpoints every 20 steps: written, their bytes, the time they held training.
        written = _scraped(text, "rannc_job_checkpoints_total", rannc_job="metrics-job")
        assert written >= steps // 20 - 1 and written >= 1, text
        assert _scraped(text, "rannc_job_checkpoint_bytes_total", rannc_job="metrics-job") > \
            written * 4 * 5554  # each holds the parameters (and Adam's state)
        assert _scraped(text, "rannc_job_checkpoint_blocked_seconds_total",
                        rannc_job="metrics-job") > 0
        assert _scraped(text, "rannc_job_data_plane_bytes_total", rannc_job="metrics-job") > 0
        listed = subprocess.run(
            [built_binary("rannc", "RANNC_CLI_BIN", "client"), "jobs", "--daemon",
             daemon.address], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        header, row = listed.stdout.splitlines()[:2]
        assert "TOK/S" in header and "STEP (PLAN)" in header, listed.stdout
        assert " metrics-job " in row and f" {steps} " in row, listed.stdout
        assert f"({planned:.3f}s)" in row, listed.stdout
        from pyrannc.proto.rannc.v1 import training_pb2 as pb
        from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc
        import grpc
        with grpc.insecure_channel(daemon.address) as channel:
            summary = rpc.TrainingServiceStub(channel).ListJobs(pb.Empty(), timeout=30).jobs[0]
        assert summary.steps == steps
        assert sum(summary.device_bytes) == served_memory
        assert summary.tokens == tokens
        assert summary.planned_step_seconds == pytest.approx(planned, rel=1e-12)  # text digits
        assert summary.step_seconds > 0 and summary.busy_seconds > 0
        assert summary.checkpoint_bytes > 0 and summary.data_plane_bytes > 0
        assert summary.busy_seconds <= summary.step_seconds
        by_call = [summary.forward_busy_seconds, summary.backward_busy_seconds,
                   summary.step_busy_seconds, summary.other_busy_seconds]
        assert summary.forward_busy_seconds > 0 and summary.step_busy_seconds > 0, by_call
        assert sum(by_call) == pytest.approx(summary.busy_seconds, rel=1e-9), by_call
    finally:
        open(done, "w").close()
        try:
            trainer.wait(timeout=60)
        finally:
            prometheus.stop()
            log = daemon.output()
            daemon.stop()

    # --log-format json: every line of ranncd's an object; the job's lines carry its name.
    # LibTorch writes its own warnings (glog's format) to stderr beside them.
    lines = [line for line in log.splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith("{")]
    assert all(re.match(r"[IWEF]\d{8} |WARNING: Logging before InitGoogleLogging", line)
               for line in others), log
    objects = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(objects) > 5, log
    assert {"time", "level", "logger", "message"} <= set(objects[0])
    named = [o for o in objects if o.get("job") == "metrics-job"]
    assert named, log
    assert re.fullmatch(r"job-[0-9a-f]{8}-\d+", named[0]["job_id"])
    assert any("serving Prometheus metrics at http://" + metrics in o["message"]
               for o in objects)


def test_a_metrics_address_that_cannot_be_served_stops_the_daemon_saying_so(pyrannc_daemon):
    for bad, says in (("127.0.0.1", "--metrics-listen 127.0.0.1 is not HOST:PORT"),
                      ("203.0.113.9:9400", "--metrics-listen cannot listen on 203.0.113.9:9400: "
                                           "Cannot assign requested address")):
        done = subprocess.run([os.environ["RANNC_DAEMON_BIN"], "--listen", "127.0.0.1:0",
                               "--devices", "cpu:1", "--metrics-listen", bad],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert says in done.stderr, done.stderr
    done = subprocess.run([os.environ["RANNC_DAEMON_BIN"], "--log-format", "xml"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown log format 'xml'; expected text or json" in done.stderr


def _health(address, service):
    """grpc.health.v1.Health/Check of `service` at `address` (plain text): "SERVING",
    "NOT_SERVING", or the call's status code name."""
    import grpc
    # HealthCheckRequest{service = 1}; HealthCheckResponse{status = 1}: 1 SERVING, 2 NOT_SERVING.
    request = (b"\x0a" + bytes([len(service)]) + service.encode()) if service else b""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            answer = check(request, timeout=10)
        except grpc.RpcError as err:
            return err.code().name
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(answer, repr(answer))


def test_health_for_kubernetes_probes_on_a_plain_port(pyrannc_daemon):
    """--health-listen: the gRPC health service alone, in plain text (kubelet's gRPC probes do
    not do TLS): "" is live, "rannc.ready" says the daemon has joined its cluster; a port that
    cannot be bound stops the daemon naming the flag."""
    import grpc
    health = f"127.0.0.1:{free_port()}"
    daemon = DaemonProcess("--health-listen", health)
    try:
        deadline = time.monotonic() + 30
        while _health(health, "rannc.ready") != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _health(health, "rannc.ready") == "SERVING"
        assert _health(health, "") == "SERVING"
        assert _health(daemon.address, "rannc.ready") == "SERVING"  # the main port too
        assert _health(health, "no.such.Service") == "NOT_FOUND"
        # Nothing but health on that port.
        with grpc.insecure_channel(health) as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary("/rannc.v1.TrainingService/GetInfo")(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--health-listen" in err.value.details()
        assert f"serving gRPC health (plain text) on {health}" in daemon.output()
    finally:
        daemon.stop()

    # A member of a cluster whose name does not yet resolve to --cluster-size daemons is live
    # but not ready.
    health = f"127.0.0.1:{free_port()}"
    waiting = DaemonProcess("--health-listen", health, "--peers", "localhost:7411",
                            "--cluster-size", "3", "--advertise", "127.0.0.1:7411")
    try:
        time.sleep(1.5)
        assert _health(health, "") == "SERVING"
        assert _health(health, "rannc.ready") == "NOT_SERVING"
    finally:
        waiting.stop()
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([os.environ["RANNC_DAEMON_BIN"], "--listen", "127.0.0.1:0",
                               "--devices", "cpu:1", "--health-listen",
                               "127.0.0.1:%d" % taken.getsockname()[1]],
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode != 0
    assert "--health-listen 127.0.0.1:" in busy.stderr, busy.stderr
    assert "cannot listen there" in busy.stderr, busy.stderr
