"""Deployment files: reading, writing and printing the plans ranncd makes (rannc.v1.Deployment).

A deployment file is one serialized rannc.v1.Deployment (proto/rannc/v1/deployment.proto):
RaNNCModule.save_deployment(path) writes it, RaNNCModule(..., load_deployment=path) sends it
back so the daemon skips planning, and show_deployment(path, batch_size) prints it. pyrannc also
keeps its trace of the model in the file (Deployment.saved_trace, see pyrannc._saved_trace), so
that a start from the file can skip tracing; the daemon never reads it.

    import pyrannc
    text = pyrannc.show_deployment("mlp.deployment", batch_size=64)

Everything here is local: nothing contacts the daemon, so a bad file is reported before any job
is created. Reading and checking a file is done here; printing one runs the rannc CLI (`rannc
plan --show -`), whose formatter is the only one, so pyrannc and the CLI print a deployment
alike. Functions are pure apart from file I/O and that child process, and are safe to call from
any thread.
"""

import os
import subprocess
import warnings
from typing import Optional, Tuple, Union

from google.protobuf.message import DecodeError

from pyrannc import _binaries
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import deployment_pb2

Deployment = deployment_pb2.Deployment
PathLike = Union[str, "os.PathLike[str]"]

# The only format this client reads; a newer daemon bumps it only when old readers must refuse.
FORMAT_VERSION = 1


def parse_deployment(data: bytes, source: str = "<bytes>") -> Deployment:
    """Parses and checks serialized Deployment bytes; ValueError naming `source` otherwise.

    Protobuf parses many non-protobuf files without complaint (a text file often decodes as
    unknown fields), so format_version is what tells a deployment from anything else.
    """
    if not data:
        raise ValueError(f"pyrannc: {source} is empty, not a deployment file")
    deployment = Deployment()
    try:
        # The C++ protobuf backend reports a parse that stopped early only as a warning (and
        # breaks if that warning is turned into an exception), so warnings are collected.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            deployment.ParseFromString(data)
        stopped = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        if stopped:
            raise DecodeError(str(stopped[0].message))
    except (DecodeError, RuntimeError) as err:
        raise ValueError(f"pyrannc: {source} is not a deployment file (a serialized "
                         f"rannc.v1.Deployment, as save_deployment writes): {err}") from None
    if deployment.format_version == 0:
        raise ValueError(f"pyrannc: {source} is not a deployment file (a serialized "
                         "rannc.v1.Deployment, as save_deployment writes): it has no "
                         "format_version")
    if deployment.format_version != FORMAT_VERSION:
        raise ValueError(f"pyrannc: {source} has deployment format_version "
                         f"{deployment.format_version}; this pyrannc reads only version "
                         f"{FORMAT_VERSION} (the file was written by a newer ranncd)")
    if not deployment.stages:
        raise ValueError(f"pyrannc: {source} is not a usable deployment file: it has no stages")
    return deployment


def read_deployment_bytes(path: PathLike) -> bytes:
    """The file's bytes, after checking that they are a deployment (ValueError otherwise).

    The bytes themselves, not a re-serialization, are what gets sent: fields this client does
    not know survive the round trip to the daemon.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"pyrannc: cannot read deployment file {name}: "
                         f"{err.strerror or err}") from None
    parse_deployment(data, name)
    return data


def split_saved_trace(data: bytes) -> Tuple[bytes, Optional[deployment_pb2.SavedTrace]]:
    """The deployment bytes without their saved trace (what the daemon needs: it drops the
    trace anyway), and the trace (None when the file has none). Fields this client does not
    know survive: protobuf keeps unknown fields through a parse and serialize."""
    deployment = Deployment.FromString(data)
    if not deployment.HasField("saved_trace"):
        return data, None
    trace = deployment_pb2.SavedTrace()
    trace.CopyFrom(deployment.saved_trace)
    deployment.ClearField("saved_trace")
    return deployment.SerializeToString(), trace


def load_deployment_file(path: PathLike) -> Deployment:
    """Reads a deployment file; ValueError naming the path if it is unreadable or not one."""
    name = os.fspath(path)
    return parse_deployment(read_deployment_bytes(name), name)


def save_deployment_file(deployment: Deployment, path: PathLike,
                         saved_trace: Optional[deployment_pb2.SavedTrace] = None) -> None:
    """Writes `deployment` (with `saved_trace`, when given, in its saved_trace field) to `path`,
    replacing it whole: a reader never sees half a file."""
    name = os.fspath(path)
    if saved_trace is not None:
        copy = Deployment()
        copy.CopyFrom(deployment)
        copy.saved_trace.CopyFrom(saved_trace)
        deployment = copy
    tmp = f"{name}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(deployment.SerializeToString())
    os.replace(tmp, name)


def human_bytes(n: int) -> str:
    """1288490189 -> "1.2 GiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _check_batch_size(batch_size) -> None:
    # `rannc plan --show` reads --batch 0 as "the planned batch"; here a batch must be given.
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"pyrannc: batch_size must be a positive integer, got {batch_size!r}")


def format_deployment(deployment: Deployment, batch_size: int) -> str:
    """The deployment for people at `batch_size`, as `rannc plan --show` prints it: a header,
    one block per stage (with its per-device micro-batch size), then which device runs what.

    The text is the rannc CLI's (client/planning.cc, FormatDeployment), so pyrannc and the CLI
    print a deployment alike; the CLI is found as pyrannc._binaries says. ValueError when the
    plan cannot run `batch_size`; RanncError when there is no CLI to run.
    """
    _check_batch_size(batch_size)
    cli = _binaries.find_cli_binary()
    try:
        done = subprocess.run([cli, "plan", "--show", "-", "--batch", str(batch_size)],
                              input=deployment.SerializeToString(), capture_output=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RanncError(f"pyrannc: running {cli} to print the deployment failed: {err}") from None
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip()
        why = why[len("rannc: "):] if why.startswith("rannc: ") else why
        raise ValueError(f"pyrannc: {why or f'{cli} exited with status {done.returncode}'}")
    return done.stdout.decode("utf-8", "replace")


def show_deployment(path: PathLike, batch_size: int) -> str:
    """RaNNC's show_deployment: prints the deployment in `path` as it would run `batch_size`
    (stages, their devices and per-device micro-batch sizes) and returns the same text."""
    text = format_deployment(load_deployment_file(path), batch_size)
    print(text, end="")
    return text
