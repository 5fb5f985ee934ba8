"""Shared fixtures: the daemon the suites run against, and helpers to compare with PyTorch.

The suites run against the real ranncd binary: RANNC_DAEMON_BIN if set, else the Bazel runfile
(when run by `bazel test`), else the checkout's bazel-bin/daemon/ranncd. pyrannc starts it as its
embedded daemon, exactly as a user's script would. A missing binary fails the suites; it does not
skip them.
"""

import os
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


def daemon_binary() -> str:
    """The ranncd under test; fails (not skips) when there is none."""
    explicit = os.environ.get("RANNC_DAEMON_BIN")
    if explicit:
        return explicit
    candidates = []
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        candidates.append(os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "rannc"),
                                       "daemon", "ranncd"))
    candidates.append(os.path.join(REPO_ROOT, "bazel-bin", "daemon", "ranncd"))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail(f"no ranncd binary: build //daemon:ranncd or set RANNC_DAEMON_BIN "
                f"(looked at {candidates})")


def free_port() -> int:
    return _daemon._free_loopback_port()


class DaemonProcess:
    """A ranncd started by a test with its own flags, separate from pyrannc's."""

    def __init__(self, *flags):
        self.address = f"127.0.0.1:{free_port()}"
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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def pyrannc_daemon(tmp_path_factory):
    """Points pyrannc at the daemon under test for the whole session; stops it at the end."""
    conf_dir = tmp_path_factory.mktemp("rannc_conf")
    os.environ["RANNC_CONF_DIR"] = str(conf_dir)  # no user config leaks into the tests
    os.environ.pop("RANNC_DAEMON", None)
    os.environ["RANNC_DAEMON_BIN"] = daemon_binary()
    os.environ.setdefault("RANNC_DEVICES", "cpu:2")
    conn = _daemon.connection()
    yield conn
    _daemon.shutdown()


def assert_close(actual, expected, what="", rtol=1e-5, atol=1e-6):
    """The suites' tolerance: torch.testing.assert_close(rtol=1e-5, atol=1e-6), unless a test
    states its own (mixed precision)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}" if what else m)
