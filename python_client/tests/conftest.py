"""Shared fixtures: the daemon the suites run against, and helpers to compare with PyTorch.

The suites run against the real ranncd binary: RANNC_DAEMON_BIN if set, else the Bazel runfile
(when run by `bazel test`), else the checkout's bazel-bin/daemon/ranncd. pyrannc starts it as its
embedded daemon, exactly as a user's script would. A missing binary fails the suites; it does not
skip them.

Environment:
  RANNC_DEVICES            the devices of pyrannc's daemon (`--devices`; default here cpu:2).
                           The Bazel targets of the pipeline, memory and gradient-accumulation
                           suites set cpu:4; those suites need exactly four devices (cpu:4, or
                           e.g. cuda:0,1,2,3 on a GPU machine) and fail, naming what the daemon
                           has, when it has another number (the four_devices fixture).
  RANNC_TEST_REF_DEVICE    where the PyTorch reference of the conformance suites runs
                           (test_conformance, test_pipeline_conformance, test_memory_conformance,
                           test_grad_accumulation): "cpu" (the default) or a torch device such as
                           "cuda" or "cuda:0". The reference model (ref_copy), its optimizer (made
                           from the moved model) and its batches (to_ref) live there; assert_close
                           moves the reference's values to the CPU, where pyrannc returns its
                           tensors. Against a daemon on CUDA devices set it to "cuda", so that the
                           reference runs the same kernels as the daemon: round-off differs
                           between CPU and GPU kernels, and some tests (AdamW on a parameter
                           whose true gradient is zero) turn round-off into lr-sized steps.
"""

import copy
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_ROOT = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(CLIENT_ROOT)
if CLIENT_ROOT not in sys.path:
    sys.path.insert(0, CLIENT_ROOT)

from pyrannc import _daemon  # noqa: E402

# The PyTorch reference's device (RANNC_TEST_REF_DEVICE, see the module docstring).
REF_DEVICE = torch.device(os.environ.get("RANNC_TEST_REF_DEVICE") or "cpu")


def daemon_binary() -> str:
    """The ranncd under test; fails (not skips) when there is none."""
    return built_binary("ranncd", "RANNC_DAEMON_BIN")


def built_binary(name: str, env: str, package: str = "daemon") -> str:
    """The binary `name` of the Bazel package `package`: $`env` if set, else the Bazel runfile
    (under `bazel test`), else the checkout's bazel-bin; fails (not skips) when there is none."""
    explicit = os.environ.get(env)
    if explicit:
        return explicit
    candidates = []
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        candidates.append(os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "rannc"),
                                       package, name))
    candidates.append(os.path.join(REPO_ROOT, "bazel-bin", package, name))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail(f"no {name} binary: build //{package}:{name} or set {env} (looked at "
                f"{candidates})")


def repo_file(path: str) -> str:
    """A file of the repository: the Bazel runfile under `bazel test`, else the checkout's."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        runfile = os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "rannc"), path)
        if os.path.exists(runfile):
            return runfile
    return os.path.join(REPO_ROOT, path)


def free_port() -> int:
    return _daemon._free_loopback_port()


def free_ports(n: int) -> list:
    """`n` distinct free loopback ports: each held bound until all are chosen (free_port() twice
    may give the same port, as CI saw once: "peer '127.0.0.1:58029' is given twice")."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def stop_process(proc, timeout=15):
    """SIGTERM, then SIGKILL when `proc` has not ended within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class DaemonProcess:
    """A ranncd started by a test with its own flags, separate from pyrannc's."""

    def __init__(self, *flags, address=None):
        """`address`: where to listen (default: a free loopback port), e.g. a stopped daemon's,
        to start it again."""
        self.address = address or f"127.0.0.1:{free_port()}"
        args = [os.environ["RANNC_DAEMON_BIN"], "--listen", self.address, "--devices", "cpu:1",
                *flags]
        self.log = tempfile.NamedTemporaryFile(prefix="ranncd-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.conn = _daemon.Connection(self.address)

        def alive():
            if self.proc.poll() is not None:
                raise RuntimeError(f"test daemon exited with {self.proc.returncode}:\n"
                                   + self.output())

        self.conn.wait_ready(time.monotonic() + 120, alive)

    def output(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self):
        self.conn.close()
        stop_process(self.proc)
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def pyrannc_daemon(tmp_path_factory):
    """Points pyrannc at the daemon under test for the whole session; stops it at the end."""
    conf_dir = tmp_path_factory.mktemp("rannc_conf")
    os.environ["RANNC_CONF_DIR"] = str(conf_dir)  # no user config leaks into the tests
    # Nor do the daemons the tests start keep durable-job records in ~/.local/state/rannc (a
    # test that needs them passes --state-dir).
    os.environ["RANNC_STATE_DIR"] = "none"
    os.environ.pop("RANNC_DAEMON", None)
    os.environ["RANNC_DAEMON_BIN"] = daemon_binary()
    os.environ.setdefault("RANNC_DEVICES", "cpu:2")
    if REF_DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"RANNC_TEST_REF_DEVICE={REF_DEVICE}, but this PyTorch sees no CUDA device",
                    pytrace=False)
    conn = _daemon.connection()
    yield conn
    _daemon.shutdown()


def daemon_device_names():
    """The names of pyrannc's daemon's devices ("cpu:0", "cuda:1"), in the daemon's order."""
    return [d.name for d in _daemon.connection().info.devices]


def require_devices(count: int, suite: str) -> None:
    """Fails (not skips) the calling test unless pyrannc's daemon has exactly `count` devices:
    the suites that force plans check that a job spans every device of the daemon."""
    names = daemon_device_names()
    if len(names) != count:
        pytest.fail(f"{suite} needs a daemon with exactly {count} devices "
                    f"(RANNC_DEVICES=cpu:{count} or cuda:{','.join(map(str, range(count)))}); "
                    f"this one has {len(names)}: {names} "
                    f"(RANNC_DEVICES={os.environ.get('RANNC_DEVICES')!r})", pytrace=False)


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def to_ref(value):
    """A batch (a tensor, or tuples, lists and dicts of them) on REF_DEVICE. The suites make
    their batches on the CPU (seeded torch.Generator) and move them, so both sides get the same
    values on any device."""
    return _map_tensors(value, lambda t: t.to(REF_DEVICE))


def to_cpu(value):
    """The reference's value(s) on the CPU, where pyrannc's are."""
    return _map_tensors(value, lambda t: t.cpu())


def ref_copy(model):
    """The PyTorch reference of `model`: a deep copy (same initial values, tied parameters still
    tied) on REF_DEVICE. Make its optimizer from the copy, after this."""
    return copy.deepcopy(model).to(REF_DEVICE)


@pytest.fixture
def four_devices(request, pyrannc_daemon):
    """For the suites whose forced plans fill four devices and check that a job spans every
    device (pipeline, memory, gradient accumulation): fails the test at setup unless the daemon
    has exactly four."""
    require_devices(4, request.module.__name__)


def assert_close(actual, expected, what="", rtol=1e-5, atol=1e-6):
    """The suites' tolerance: torch.testing.assert_close(rtol=1e-5, atol=1e-6), unless a test
    states its own (mixed precision). `actual` is pyrannc's (a CPU tensor), `expected` the
    reference's, moved to the CPU here; `actual` is not moved, so a pyrannc tensor on another
    device fails the comparison."""
    expected = to_cpu(expected)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}" if what else m)
