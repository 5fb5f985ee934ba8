"""Configuration the client reads: a job's keys, sent with each job (JobOptions.config), and
the client's own settings.

Sources, later ones winning: `$RANNC_CONF_DIR/rannc.toml` (default `~/.rannc/rannc.toml`), then
`RANNC_<KEY>` environment variables, as RaNNC reads its config. The keys come from the registry
(daemon/config/keys.cc, as the generated pyrannc._keys): a job's keys are sent, the client's are
read here, the daemon's and RaNNC's are left to others. An unregistered key in the file is an
error naming the nearest registered key; the environment is read only for registered keys
(other programs' RANNC_* variables are no concern).
"""

import difflib
import os
import tomllib
from typing import Dict

from pyrannc._keys import KEYS


def did_you_mean(name: str) -> str:
    """" (did you mean 'x'?)" for the registered key nearest to `name`, or ""."""
    close = difflib.get_close_matches(name, KEYS, n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_registered(name: str, where: str) -> None:
    if name not in KEYS:
        raise ValueError(f"pyrannc: unknown key '{name}' in {where}{did_you_mean(name)}; the "
                         "keys are listed in docs/config.md and by `rannc keys`")


def config_path() -> str:
    conf_dir = os.environ.get("RANNC_CONF_DIR") or os.path.join(os.path.expanduser("~"), ".rannc")
    return os.path.join(conf_dir, "rannc.toml")


def _to_string(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flatten(table: dict, prefix: str, out: Dict[str, str]) -> None:
    for key, value in table.items():
        name = f"{prefix}{key}".lower()
        if isinstance(value, dict):
            _flatten(value, name + ".", out)
        elif isinstance(value, list):
            out[name] = ",".join(_to_string(v) for v in value)
        else:
            out[name] = _to_string(value)


def read_file_config(path: str) -> Dict[str, str]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"pyrannc: cannot parse config file {path}: {e}") from None
    out: Dict[str, str] = {}
    _flatten(table, "", out)
    return out


def job_config() -> Dict[str, str]:
    """The job's keys to send in JobOptions.config, lower-case, values as strings."""
    path = config_path()
    values = read_file_config(path)
    for name in values:
        _check_registered(name, path)
    for name, (scope, _, _, _) in KEYS.items():
        env = os.environ.get("RANNC_" + name.upper())
        if env is not None and scope == "job":
            values[name] = env
    return {k: v for k, v in values.items() if KEYS[k][0] == "job"}


def client_setting(key: str, default: str = "") -> str:
    """A client-side setting: the RANNC_<KEY> environment variable, else the TOML file."""
    if KEYS.get(key, ("",))[0] not in ("client", "daemon"):
        raise KeyError(f"pyrannc: '{key}' is not a client or daemon key of the registry")
    env = os.environ.get("RANNC_" + key.upper())
    if env is not None:
        return env
    path = config_path()
    values = read_file_config(path)
    for name in values:
        _check_registered(name, path)
    return values.get(key, default)
