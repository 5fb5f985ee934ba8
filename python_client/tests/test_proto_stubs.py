"""The committed Python stubs (python_client/pyrannc/proto) match proto/: regenerating them with
tools/gen_py_proto.sh into a temporary directory gives the same files, byte for byte."""

import filecmp
import os
import shutil
import subprocess

from conftest import CLIENT_ROOT, REPO_ROOT


def _source(relpath):
    """A file of the repository: a runfile under `bazel test` (REPO_ROOT is then the runfiles
    tree), else the checkout's."""
    candidate = os.path.join(REPO_ROOT, relpath)
    if not os.path.exists(candidate):
        raise FileNotFoundError(f"{relpath} is neither a runfile nor in the checkout")
    return candidate


def test_committed_stubs_are_fresh(tmp_path):
    # The script finds proto/ relative to itself, so give it a tree of its own.
    root = tmp_path / "root"
    (root / "tools").mkdir(parents=True)
    (root / "proto" / "rannc" / "v1").mkdir(parents=True)
    shutil.copy(_source("tools/gen_py_proto.sh"), root / "tools" / "gen_py_proto.sh")
    for name in ("training.proto", "deployment.proto", "cluster.proto"):
        shutil.copy(_source("proto/rannc/v1/" + name), root / "proto" / "rannc" / "v1" / name)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(root / "tools" / "gen_py_proto.sh"), str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

    committed = os.path.join(CLIENT_ROOT, "pyrannc", "proto")
    generated = sorted(os.path.relpath(os.path.join(d, f), out)
                       for d, _, files in os.walk(out) for f in files)
    assert generated, "gen_py_proto.sh produced nothing"
    stale = []
    for rel in generated:
        mine = os.path.join(committed, rel)
        if not os.path.exists(mine) or not filecmp.cmp(mine, out / rel, shallow=False):
            stale.append(rel)
    assert not stale, (f"python_client/pyrannc/proto is stale for {stale}; run "
                       "tools/gen_py_proto.sh and commit the result")
