"""Configuration the client reads: a job's keys, sent with each job (JobOptions.config), and
the client's own settings.

Sources, later ones winning: `$RANNC_CONF_DIR/rannc.toml` (default `~/.rannc/rannc.toml`), then
`RANNC_<KEY>` environment variables, as RaNNC reads its config. The keys come from the registry
(daemon/config/keys.cc, as the generated pyrannc._keys): a job's keys are sent, the client's are
read here, the daemon's and RaNNC's are left to others. An unregistered key in the file is an
error naming the nearest registered key; the environment is read only for registered keys
(other programs' RANNC_* variables are no concern).

Every client setting pyrannc reads goes through client_setting_from, or the typed readers on
it (client_bool, client_int, client_seconds, client_flags), never os.environ: a key set in
rannc.toml is then never silently ignored. A value that does not parse is a ValueError naming
where it came from ("pyrannc: RANNC_DEFER_OPS=maybe is not ..." or "... defer_ops = "maybe" in
/home/u/.rannc/rannc.toml is not ..."); unset or empty, the reader's default.

    if _config.client_bool("defer_ops", True): ...
    timeout = _config.client_seconds("daemon_start_timeout", 120.0)

Reads the environment and the file at each call (a changed file is parsed again), so callers
on any thread see the current values.
"""

import difflib
import math
import os
import shlex
import threading
import tomllib
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

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


# The last file parsed, by path and contents: settings read on every step (defer_ops) cost a
# read of the file, not a parse.
_parsed_lock = threading.Lock()
_parsed: Dict[str, Tuple[bytes, Dict[str, str]]] = {}


def read_file_config(path: str) -> Dict[str, str]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    with _parsed_lock:
        cached = _parsed.get(path)
    if cached is not None and cached[0] == data:
        return dict(cached[1])
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"pyrannc: cannot parse config file {path}: {e}") from None
    out: Dict[str, str] = {}
    _flatten(table, "", out)
    with _parsed_lock:
        _parsed.clear()
        _parsed[path] = (data, out)
    return dict(out)


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
    return client_setting_from(key, default)[0]


def client_setting_from(key: str, default: str = "") -> Tuple[str, str]:
    """client_setting's value and where it came from, for messages: 'RANNC_<KEY>=value',
    'key = "value" in /path/rannc.toml', or "" for `default`."""
    if KEYS.get(key, ("",))[0] not in ("client", "daemon"):
        raise KeyError(f"pyrannc: '{key}' is not a client or daemon key of the registry")
    env_name = "RANNC_" + key.upper()
    env = os.environ.get(env_name)
    if env is not None:
        return env, f"{env_name}={env}"
    path = config_path()
    values = read_file_config(path)
    for name in values:
        _check_registered(name, path)
    if key in values:
        return values[key], f'{key} = "{values[key]}" in {path}'
    return default, ""


_T = TypeVar("_T")


def _typed(key: str, default: _T, convert: Callable[[str], _T], expected: str) -> _T:
    value, where = client_setting_from(key)
    if not value.strip():
        return default
    try:
        return convert(value.strip())
    except ValueError:
        raise ValueError(f"pyrannc: {where} is not {expected}") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _to_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def client_bool(key: str, default: Optional[bool]) -> Optional[bool]:
    """A bool setting: true/false (as TOML writes them), 1/0, yes/no or on/off."""
    return _typed(key, default, _to_bool, "true or false (1 or 0)")


def client_int(key: str, default: int) -> int:
    """An integer setting (TOML's integers, or their digits in a string)."""
    return _typed(key, default, int, "an integer")


def client_seconds(key: str, default: float, maximum: float = math.inf) -> float:
    """A duration in seconds: a number from 0 to `maximum`."""
    expected = ("a number of seconds >= 0" if maximum == math.inf
                else f"a number of seconds from 0 to {maximum:,.0f}")

    def seconds(text: str) -> float:
        number = float(text)
        if not 0 <= number <= maximum:  # NaN too
            raise ValueError(text)
        return number

    return _typed(key, default, seconds, expected)


def client_flags(key: str) -> List[str]:
    """Command-line flags, split as a POSIX shell splits them."""
    return _typed(key, [], shlex.split, "a line of flags a shell can split (check the quotes)")
