"""Job-level configuration the client reads and sends with each job (JobOptions.config).

Sources, later ones winning: `$RANNC_CONF_DIR/rannc.toml` (default `~/.rannc/rannc.toml`), then
`RANNC_<KEY>` environment variables, as RaNNC reads its config. Keys that configure the client
itself or the daemon process (not a job) are not sent.
"""

import os
import tomllib
from typing import Dict

# Keys that steer the client or the daemon process rather than a job.
CLIENT_KEYS = frozenset({
    "daemon", "daemon_bin", "daemon_args", "daemon_log", "daemon_start_timeout",
    "devices", "device_memory", "conf_dir", "client_rank", "client_world", "job", "job_name",
    "client_timeout",
    "listen", "peers", "log_level", "max_message_size", "shm_dir", "links", "profile_cache",
    "advertise", "cluster_size", "heartbeat_interval", "peer_timeout", "trace_batch",
    # 0: never reuse a deployment file's saved trace (pyrannc._saved_trace); default 1.
    "reuse_trace",
    # A folder to write the job to, for daemon/job_bench.cc (pyrannc._save_job).
    "save_job",
    # Seconds of the client's lease on its jobs (JobOptions.lease_ms; pyrannc.module).
    "job_lease",
})


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
    """The job-level keys to send in JobOptions.config, lower-case, values as strings."""
    values = read_file_config(config_path())
    for name, value in os.environ.items():
        if name.startswith("RANNC_") and len(name) > len("RANNC_"):
            values[name[len("RANNC_"):].lower()] = value
    return {k: v for k, v in values.items() if k not in CLIENT_KEYS}


def client_setting(key: str, default: str = "") -> str:
    """A client-side setting: the RANNC_<KEY> environment variable, else the TOML file."""
    env = os.environ.get("RANNC_" + key.upper())
    if env is not None:
        return env
    return read_file_config(config_path()).get(key, default)
