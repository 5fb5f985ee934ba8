"""What a RaNNCModule knows of its daemon job, and the job-level settings the client reads.

    job = Job(resp.job_id, mode, spec, group_ids, list(resp.devices))
    name = job_name(model)          # RANNC_JOB, else the model's class name
    lease = lease_seconds()         # RANNC_JOB_LEASE, checked

A Job belongs to one RaNNCModule and is driven from that module's thread. The orphan queue is
the one piece of shared state: a finalizer on any thread may add to it (deque appends are
thread-safe), and the next job creation drains it.
"""

import collections
import logging
import os
from typing import Dict, List, Optional, Tuple

from pyrannc import _config, _daemon
from pyrannc.proto.rannc.v1 import training_pb2 as pb

logger = logging.getLogger("pyrannc")


def mode_key(mode: pb.Mode) -> Tuple[bool, bool]:
    return (mode.training, mode.dropout)


class Job:
    """What the client knows of its daemon job."""

    def __init__(self, job_id: str, mode: pb.Mode, spec, group_ids: List[List[int]],
                 devices: List[str], owner: bool = True, address: Optional[str] = None):
        self.id = job_id
        # The daemon that leads the job: RANNC_DAEMON's (None), or the one JoinJob named.
        self.address = address
        # Client rank 0 created the job and deletes it; other ranks only joined it.
        self.owner = owner
        self.mode = mode
        self.specs = {mode_key(mode): spec}  # output structure per traced mode
        self.group_ids = group_ids
        self.devices = devices
        self.lease_conn = None  # the connection renewing the job's lease (hold_lease)
        self.lease = 0.0  # seconds
        self.name = ""  # the job's name (JobSpec.name): a cluster's registry knows it by it
        # Counted here rather than taken from ForwardResponse.forward_id, so the check that a
        # backward belongs to the last forward does not depend on the daemon numbering them.
        self.forwards = 0
        self.last_forward_id: Optional[int] = None
        self.undeployed = False
        # backward/step/zero_grad calls not yet sent: they ride on the next Forward (or a Flush
        # before anything that reads daemon state), so a training step is one round trip.
        self.pending: List[pb.DeferredOp] = []
        # A backward without keep_graph released the last forward's graph; mirrored here so a
        # second backward fails at once even while the first is deferred.
        self.graph_released = False

    def __del__(self):
        # Once the client lets go of the job (deleted, dropped, or its module collected), the
        # lease is no longer renewed: a job still on the daemon expires there.
        if self.lease_conn is not None:
            self.lease_conn.release_lease(self.id)
        if _daemon is not None:  # None at interpreter exit
            _daemon.stop_watching(self.id)


def defer_ops() -> bool:
    """defer_ops = false (RANNC_DEFER_OPS=0) sends each backward/step/zero_grad at once, so an
    error in one is raised by that call rather than by the next forward."""
    return _config.client_bool("defer_ops", True)


def job_name(model) -> str:
    """The job's name: RANNC_JOB (every client rank of a job gives the same), else the model's
    class name."""
    name = _config.client_setting("job") or _config.client_setting("job_name")
    if name:
        return name
    if model is None:
        raise ValueError("pyrannc: set RANNC_JOB to name the job that several client ranks share")
    return type(model).__name__


def job_config(plan_batch: Optional[int]) -> Dict[str, str]:
    """JobOptions.config: the job keys, and the batch to plan for when the model was traced on
    part of it (a batch_size the user set wins)."""
    config = _config.job_config()
    if plan_batch is not None:
        config.setdefault("batch_size", str(plan_batch))
    if config.get("checkpoint_dir"):
        # A relative directory is the client's, as a user running the script means it.
        config["checkpoint_dir"] = checkpoint_dir(config)
    return config


def checkpoint_dir(config: Optional[Dict[str, str]] = None) -> str:
    """The job key checkpoint_dir (RANNC_CHECKPOINT_DIR), absolute; "" when unset."""
    value = (config if config is not None else _config.job_config()).get("checkpoint_dir", "")
    return os.path.abspath(os.path.expanduser(value)) if value else ""


def lease_seconds() -> float:
    """The client's lease on its jobs (RANNC_JOB_LEASE seconds, default 300; 0: none): a job
    whose client has not been heard from for that long is deleted by the daemon (a client that
    died does not hold a shared daemon's devices). pyrannc renews it while the process lives."""
    return _config.client_seconds("job_lease", 300.0, maximum=4e6)


def client_timeout_ms() -> int:
    """How long a client rank waits for the others (RANNC_CLIENT_TIMEOUT seconds, default 300)."""
    return int(_config.client_seconds("client_timeout", 300.0) * 1000)


# Jobs of RaNNCModules that were garbage-collected; deque appends are thread-safe.
_orphaned_jobs: "collections.deque[str]" = collections.deque()


def orphan(job_id: str) -> None:
    """Queues the job for deletion at the next job creation. A finalizer may run inside any
    call, gRPC's included, so it must not call the daemon itself."""
    _orphaned_jobs.append(job_id)


def delete_orphaned_jobs(conn) -> None:
    while _orphaned_jobs:
        job_id = _orphaned_jobs.popleft()
        try:
            conn.call("DeleteJob", pb.JobRef(job_id=job_id), timeout=10.0)
        except Exception as err:  # noqa: BLE001 - cleanup of a job nobody can use any more
            logger.debug("pyrannc: deleting orphaned job %s: %s", job_id, err)
