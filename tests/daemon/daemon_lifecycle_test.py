"""ranncd as a process: start-up, GetInfo, the standard health check, flags and config errors,
and a clean stop on SIGTERM — against the real binary on loopback."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
from pyrannc.proto.rannc.v1 import training_pb2 as pb  # noqa: E402
from pyrannc.proto.rannc.v1 import training_pb2_grpc as rpc  # noqa: E402

RANNCD = os.environ.get("RANNC_DAEMON_BIN") or os.path.join(ROOT, "daemon", "ranncd")
if not os.path.exists(RANNCD):
    RANNCD = os.path.join(ROOT, "bazel-bin", "daemon", "ranncd")


def start(*args, env=None):
    """Starts ranncd on a free port; returns (process, address) once it serves."""
    proc = subprocess.Popen([RANNCD, "--listen", "127.0.0.1:0", *args], stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 60
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ranncd listening on (\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("ranncd did not start:\n" + "".join(lines))


def health(address):
    channel = grpc.insecure_channel(address)
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    # HealthCheckRequest{service: ""} is empty; HealthCheckResponse{status: SERVING} is 08 01.
    return check(b"", timeout=10)


def test_info_health_and_clean_sigterm():
    proc, address = start("--devices", "cpu:3", "--device-memory", "1GiB")
    try:
        assert health(address) == b"\x08\x01"
        stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.listen == address
        assert [d.name for d in info.devices] == ["cpu:0", "cpu:1", "cpu:2"]
        assert all(d.memory_bytes == 1 << 30 for d in info.devices)
        import torch
        assert info.torch_version.split(".")[:2] == torch.__version__.split(".")[:2]
        assert info.max_message_bytes == 64 << 20
        assert info.shm_dir == "/dev/shm"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, out
    assert "stopped" in out


def test_environment_and_config_file_set_options():
    with tempfile.TemporaryDirectory() as conf:
        with open(os.path.join(conf, "rannc.toml"), "w") as f:
            f.write('devices = "cpu:2"\nmax_message_size = "8MiB"\n')
        env = dict(os.environ, RANNC_CONF_DIR=conf, RANNC_DEVICE_MEMORY="512MiB")
        proc, address = start(env=env)
        try:
            stub = rpc.TrainingServiceStub(grpc.insecure_channel(address))
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
            assert [d.memory_bytes for d in info.devices] == [512 << 20] * 2
            assert info.max_message_bytes == 8 << 20
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    (["--devices", "tpu:2"], "unknown device type 'tpu'"),
    (["--device-memory", "lots"], "--device-memory"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--config", "/nonexistent/rannc.toml"], "/nonexistent/rannc.toml"),
])
def test_bad_flags_fail_with_a_message(args, message):
    proc = subprocess.run([RANNCD, "--listen", "127.0.0.1:0", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


def test_busy_port_is_reported():
    proc, address = start()
    try:
        second = subprocess.run([RANNCD, "--listen", address], capture_output=True, text=True,
                                timeout=60)
        assert second.returncode != 0
        assert "cannot listen on " + address in second.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
