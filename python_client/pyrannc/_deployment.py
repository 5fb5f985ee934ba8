"""Deployment files: reading, writing and printing the plans ranncd makes (rannc.v1.Deployment).

A deployment file is one serialized rannc.v1.Deployment (proto/rannc/v1/deployment.proto):
RaNNCModule.save_deployment(path) writes it, RaNNCModule(..., load_deployment=path) sends it
back so the daemon skips planning, and show_deployment(path, batch_size) prints it. pyrannc also
keeps its trace of the model in the file (Deployment.saved_trace, see pyrannc._saved_trace), so
that a start from the file can skip tracing; the daemon never reads it.

    import pyrannc
    text = pyrannc.show_deployment("mlp.deployment", batch_size=64)

Everything here is local: nothing contacts the daemon, so a bad file is reported before any job
is created. Functions are pure apart from file I/O and are safe to call from any thread.
"""

import math
import os
import warnings
from typing import Dict, List, Optional, Tuple, Union

from google.protobuf.message import DecodeError

from pyrannc.proto.rannc.v1 import deployment_pb2

Deployment = deployment_pb2.Deployment
PathLike = Union[str, "os.PathLike[str]"]

# The only format this client reads; a newer daemon bumps it only when old readers must refuse.
FORMAT_VERSION = 1

# How many ops of a stage the summary names before it only counts the rest.
_OPS_SHOWN = 4


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


def _device_name(deployment: Deployment, index: int) -> str:
    return f"{deployment.device_type or 'cpu'}:{index}"


def _schedule_name(schedule: int) -> str:
    return {deployment_pb2.SCHEDULE_1F1B: "1F1B",
            deployment_pb2.SCHEDULE_GPIPE: "GPipe"}.get(schedule, f"schedule {schedule}")


def ops_summary(ops: List[str]) -> str:
    """The stage's ops condensed: the first few, then how many there are in all.

    Each entry of `ops` is one atomic node's ops joined by commas.
    """
    flat = [op for node in ops for op in node.split(",") if op]
    if not flat:
        return "(no ops recorded)"
    shown = ", ".join(flat[:_OPS_SHOWN])
    if len(flat) > _OPS_SHOWN:
        shown += ", ..."
    return f"{shown} ({len(flat)} ops)"


def micro_batch_sizes(deployment: Deployment, batch_size: int) -> Dict[int, int]:
    """Samples per device per micro-batch of each stage (by stage index) for `batch_size`.

    A stage's replicas split each micro-batch, so its devices get
    ceil(batch_size / (micro_batches * replicas)) samples (the last replica may get fewer).
    ValueError when the batch is too small for every replica of every micro-batch to get one.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"pyrannc: batch_size must be a positive integer, got {batch_size!r}")
    micro = max(deployment.micro_batches, 1)
    replicas = max(max(len(s.devices), 1) for s in deployment.stages)
    if batch_size < micro * replicas:
        raise ValueError(
            f"pyrannc: this plan cannot run batch size {batch_size}: it splits each batch into "
            f"{micro} micro-batches over up to {replicas} replicas, so it needs a batch of at "
            f"least {micro * replicas}")
    return {s.index: math.ceil(batch_size / (micro * max(len(s.devices), 1)))
            for s in deployment.stages}


def format_deployment(deployment: Deployment, batch_size: int) -> str:
    """The deployment for people: header, one block per stage, then which device runs what.

    Memory and time estimates are the planner's, at the batch size it planned for.
    """
    sizes = micro_batch_sizes(deployment, batch_size)
    d = deployment
    lines = [
        f"Deployment of model {d.model_hash or '(unknown)'} ({d.num_nodes} atomic nodes)",
        f"  devices:   {d.num_devices} x {d.device_type or 'cpu'}, "
        f"{human_bytes(d.device_memory_bytes)} each (mem_margin {d.mem_margin:g})",
        f"  schedule:  {_schedule_name(d.schedule)}, {d.micro_batches} micro-batches",
        f"  estimated step time: {d.estimated_step_ms:.2f} ms at the planned batch size "
        f"{d.batch_size}",
    ]
    extra = []
    if d.optimizer:
        extra.append(f"optimizer {d.optimizer}{' + ZeRO' if d.zero else ''}")
    if d.created_by:
        extra.append(f"created by {d.created_by}")
    if d.loaded:
        extra.append("loaded from a file")
    if extra:
        lines.append("  " + "; ".join(extra))
    if d.batch_whole:
        lines.append(f"  batch kept whole: {d.batch_whole}")
    lines.append(f"Batch size {batch_size}:")
    for s in d.stages:
        replicas = max(len(s.devices), 1)
        devices = ", ".join(_device_name(d, i) for i in s.devices) or "(none)"
        lines += [
            f"Stage {s.index}: nodes [{s.first_node}, {s.end_node})  ops: {ops_summary(s.ops)}",
            f"  devices: {devices} ({replicas} replica{'s' if replicas != 1 else ''}), "
            f"micro-batch size {sizes[s.index]} per device, "
            f"recompute {'yes' if s.recompute else 'no'}",
            f"  memory: {human_bytes(s.memory_bytes)} per device (params "
            f"{human_bytes(s.param_bytes)}, fixed {human_bytes(s.fixed_bytes)}, activations "
            f"{human_bytes(s.activation_bytes)}); fwd {s.fwd_ms:.2f} ms, bwd {s.bwd_ms:.2f} ms "
            "per micro-batch",
        ]
    lines.append("Devices:")
    assigned: Dict[int, List[str]] = {}
    for s in d.stages:
        for i in s.devices:
            assigned.setdefault(i, []).append(
                f"stage {s.index}, micro-batch size {sizes[s.index]}")
    for i in range(max([d.num_devices] + [k + 1 for k in assigned])):
        what = "; ".join(assigned.get(i, [])) or "unused"
        lines.append(f"  {_device_name(d, i)} -> {what}")
    return "\n".join(lines) + "\n"


def show_deployment(path: PathLike, batch_size: int) -> str:
    """RaNNC's show_deployment: prints the deployment in `path` as it would run `batch_size`
    (stages, their devices and per-device micro-batch sizes) and returns the same text."""
    text = format_deployment(load_deployment_file(path), batch_size)
    print(text, end="")
    return text
