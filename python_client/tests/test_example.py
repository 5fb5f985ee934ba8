"""End to end: examples/train_gpt.py, the README's main job, trains through an embedded ranncd
and its loss goes down."""

import os
import re
import subprocess
import sys

from conftest import CLIENT_ROOT, REPO_ROOT, daemon_binary


def _example_script():
    # A runfile under `bazel test` (REPO_ROOT is then the runfiles tree), else the checkout's.
    path = os.path.join(REPO_ROOT, "examples", "train_gpt.py")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


def test_train_gpt_loss_goes_down():
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT, RANNC_DAEMON_BIN=daemon_binary())
    env.pop("RANNC_DAEMON", None)
    out = subprocess.run([sys.executable, _example_script(), "--steps", "60", "--batch", "8",
                          "--seq", "32"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) \(train, smoothed\), ([\d.]+) \(held out\)",
                  out.stdout)
    assert m, out.stdout
    first, last, held_out = map(float, m.groups())
    assert first > 5.0, "a fresh byte-level model starts near ln(256) = 5.5"
    assert last < first - 1.5, out.stdout
    assert held_out < first - 1.0, out.stdout
    assert "tok_s" in out.stderr, "the progress bar reports tokens/s"
    # The daemon planned the job for its devices (the embedded default is cpu:2).
    assert re.search(r"plan for 2 x cpu .*\n  stage 0: nodes \[0, \d+\) on cpu:0", out.stdout), \
        out.stdout
