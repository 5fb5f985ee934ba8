"""Checkpoints the daemons write (docs/checkpoints.md): RaNNCModule.checkpoint(),
.checkpoints() and .resumed_step, and pyrannc.export_checkpoint().

    model = pyrannc.RaNNCModule(net, opt)     # RANNC_CHECKPOINT_DIR=ckpt RANNC_RESUME=latest
    start = model.resumed_step or 0           # before the first forward: what resume will take
    for step, batch in enumerate(batches):
        if step < start: continue             # an uninterrupted run's batches from here on
        ...
        model.checkpoint()                    # or RANNC_CHECKPOINT_EVERY=N

Each daemon of the job writes the tensors it holds; the manifest, written last, commits the
checkpoint. The directory is `<checkpoint_dir>/<job name>/step-<N>/` (the job's name is RANNC_JOB,
else the model's class name).
"""

import dataclasses
import os
from typing import List, Optional

from pyrannc import _config, _daemon, _jobs
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import training_pb2 as pb


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint: its step (optimizer steps taken), directory, whether it is committed
    (False: the daemon's threads are still writing it), the bytes of its tensor files, when it
    was made (Unix ms), how long training was held for it and how long the write took (s)."""
    step: int
    path: str
    committed: bool
    bytes: int
    created_unix_ms: int
    blocked_s: float
    write_s: float

    @staticmethod
    def from_proto(c) -> "CheckpointInfo":
        return CheckpointInfo(c.step, c.path, c.committed, c.bytes, c.created_unix_ms,
                              c.blocked_s, c.write_s)


def save(conn, job_id: str, wait: bool) -> CheckpointInfo:
    resp = conn.call("Checkpoint", pb.CheckpointRequest(job_id=job_id, wait=wait))
    return CheckpointInfo.from_proto(resp)


def ref(job_id: Optional[str], model) -> pb.CheckpointsRef:
    """Names a job's checkpoints: the live job, else the job's name under checkpoint_dir."""
    if job_id is not None:
        return pb.CheckpointsRef(job_id=job_id)
    directory = _jobs.checkpoint_dir()
    if not directory:
        raise RuntimeError("pyrannc: set the config key checkpoint_dir (RANNC_CHECKPOINT_DIR) "
                           "to name where the job's checkpoints are")
    return pb.CheckpointsRef(job_name=_jobs.job_name(model), checkpoint_dir=directory)


def listed(conn, checkpoints_ref: pb.CheckpointsRef) -> List[CheckpointInfo]:
    resp = conn.call("ListCheckpoints", checkpoints_ref)
    return [CheckpointInfo.from_proto(c) for c in resp.checkpoints]


def step_to_resume(conn, model) -> Optional[int]:
    """The step of the checkpoint a job made now would start from (None: afresh): the config
    key resume's, or, without it, the latest of a suspended job of this name and checkpoint
    directory that the new job attaches to (ranncd --state-dir). A resume step that is not
    there raises."""
    resume = _config.job_config().get("resume", "")
    directory = _jobs.checkpoint_dir()
    if not resume:
        name = _jobs.job_name(model)
        jobs = conn.call("ListJobs", pb.Empty()).jobs
        if not directory or not any(j.state == pb.SUSPENDED and j.name == name and
                                    j.checkpoint_dir == directory for j in jobs):
            return None
        resume = "latest"
    steps = [c.step for c in listed(conn, ref(None, model))]
    if resume == "latest":
        return steps[-1] if steps else None
    if int(resume) not in steps:
        raise RanncError(f"resume={resume}: no checkpoint of that step under "
                         f"{_jobs.checkpoint_dir()} for job '{_jobs.job_name(model)}' (it has "
                         f"{', '.join(map(str, steps)) or 'none'})")
    return int(resume)


def export(conn, checkpoints_ref: pb.CheckpointsRef, path) -> int:
    """Writes the consolidated {'model', 'optimizer'} file of checkpoint_ref.step (0: the newest)
    to `path` (through a temporary file beside it); returns its step."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    total, received, step = 0, 0, 0
    try:
        with open(tmp, "wb") as f:
            for chunk in conn.stream("ExportCheckpoint", checkpoints_ref):
                f.write(chunk.data)
                received += len(chunk.data)
                total, step = chunk.total_bytes, chunk.step
        if received != total:
            raise RanncError(f"export_checkpoint: the daemon sent {received} of {total} bytes")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return step
