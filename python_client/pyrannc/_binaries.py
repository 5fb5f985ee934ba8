"""Where pyrannc finds the programs it runs: `ranncd`, its embedded daemon (pyrannc._daemon), and
`rannc`, the CLI whose formatter prints deployments (pyrannc._deployment).

Each is found the same way: its client key of the registry (`daemon_bin`, `cli_bin`; see
docs/config.md), read through pyrannc._config as every client setting is, so the environment
variable (RANNC_DAEMON_BIN, RANNC_CLI_BIN) wins over rannc.toml; a value set must be an
executable file (`~` expanded). Else Bazel's output under the repository this package lives in
(`bazel-bin/daemon/ranncd`, `bazel-bin/client/rannc`), or the runfile of the same path when
pyrannc itself runs from Bazel runfiles; else the name on PATH.

    subprocess.run([find_cli_binary(), "keys"])

Lookups that only read the environment, rannc.toml and the file system, safe from any thread;
RanncError (code None) when there is no such program, ValueError when rannc.toml is bad.
"""

import os
import shutil

from pyrannc import _config
from pyrannc.errors import RanncError


def _package_repo_root() -> str:
    # <root>/python_client/pyrannc/_binaries.py, both in a checkout and in Bazel runfiles.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _find(package: str, name: str, key: str, missing: str) -> str:
    """The program `name` of Bazel package `package`, or the one client key `key` names;
    RanncError starting with `missing` when there is none."""
    explicit, where = _config.client_setting_from(key)
    if explicit:
        path = os.path.expanduser(explicit)
        if not _executable(path):
            raise RanncError(f"{where} is not an executable file")
        return path
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
    return _find("daemon", "ranncd", "daemon_bin",
                 "pyrannc found no daemon: set RANNC_DAEMON=host:port to use a running ranncd, "
                 "or RANNC_DAEMON_BIN (daemon_bin in rannc.toml) to the ranncd binary, or build "
                 "it with `bazel build //daemon:ranncd`")


def find_cli_binary() -> str:
    """The rannc CLI, which formats deployments for show_deployment."""
    return _find("client", "rannc", "cli_bin",
                 "pyrannc found no rannc CLI, which prints deployments: set RANNC_CLI_BIN "
                 "(cli_bin in rannc.toml) to the rannc binary, or build it with "
                 "`bazel build //client:rannc`")
