"""Bazel's test of the Kubernetes manifests (deploy/k8s/README.md): tools/check_k8s.py over every
overlay and job, and its own tests (tools/check_k8s_test.py: each kind of mistake is caught).

kustomize refuses files that resolve outside a kustomization's root, which every runfile (a
symlink into the source tree) does: the manifests and the checker are copied into the test's
temporary directory first, as files.
"""

import os
import shutil
import subprocess
import sys


def main():
    runfiles = os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "rannc"))
    work = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "k8s")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(os.path.join(runfiles, "deploy/k8s"), os.path.join(work, "deploy/k8s"),
                    symlinks=False)
    os.makedirs(os.path.join(work, "tools"))
    for name in ("check_k8s.py", "check_k8s_test.py"):
        shutil.copy(os.path.join(runfiles, "tools", name), os.path.join(work, "tools", name))
    if shutil.which("kubectl") is None:
        print("kubectl is missing: the manifests cannot be rendered (its built-in kustomize "
              "does it offline); install kubectl 1.32", file=sys.stderr)
        return 1
    checked = subprocess.run([sys.executable, os.path.join(work, "tools/check_k8s.py"),
                              "--root", work])
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             os.path.join(work, "tools/check_k8s_test.py")], cwd=work)
    return checked.returncode or tested.returncode


if __name__ == "__main__":
    sys.exit(main())
