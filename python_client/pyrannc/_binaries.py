"""Where pyrannc finds the programs it runs: `ranncd`, its embedded daemon (pyrannc._daemon), and
`rannc`, the CLI whose formatter prints deployments (pyrannc._deployment).

Each is found the same way: the environment variable naming it (RANNC_DAEMON_BIN,
RANNC_CLI_BIN), which must then be an executable file; else Bazel's output under the repository
this package lives in (`bazel-bin/daemon/ranncd`, `bazel-bin/client/rannc`), or the runfile of
the same path when pyrannc itself runs from Bazel runfiles; else the name on PATH.

    subprocess.run([find_cli_binary(), "keys"])

Pure lookups, safe from any thread; RanncError (code None) when there is no such program.
"""

import os
import shutil

from pyrannc.errors import RanncError


def _package_repo_root() -> str:
    # <root>/python_client/pyrannc/_binaries.py, both in a checkout and in Bazel runfiles.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _find(package: str, name: str, env: str, missing: str) -> str:
    """The program `name` of Bazel package `package`; RanncError starting with `missing` when
    there is none."""
    explicit = os.environ.get(env)
    if explicit:
        if not _executable(explicit):
            raise RanncError(f"{env}={explicit} is not an executable file")
        return explicit
    root = _package_repo_root()
    for candidate in (os.path.join(root, "bazel-bin", package, name),
                      os.path.join(root, package, name)):
        if _executable(candidate):
            return candidate
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise RanncError(f"{missing} (looked in {root}/bazel-bin/{package}/{name} and on PATH)")


def find_daemon_binary() -> str:
    """The ranncd that pyrannc's embedded daemon runs."""
    return _find("daemon", "ranncd", "RANNC_DAEMON_BIN",
                 "pyrannc found no daemon: set RANNC_DAEMON=host:port to use a running ranncd, "
                 "or RANNC_DAEMON_BIN to the ranncd binary, or build it with "
                 "`bazel build //daemon:ranncd`")


def find_cli_binary() -> str:
    """The rannc CLI, which formats deployments for show_deployment."""
    return _find("client", "rannc", "RANNC_CLI_BIN",
                 "pyrannc found no rannc CLI, which prints deployments: set RANNC_CLI_BIN to the "
                 "rannc binary, or build it with `bazel build //client:rannc`")
