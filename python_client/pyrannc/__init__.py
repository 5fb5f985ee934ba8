"""pyrannc: RaNNC's Python API, with the model trained by the ranncd daemon.

    import pyrannc
    model = pyrannc.RaNNCModule(model, optimizer)
    loss = model(x, y); loss.backward(); optimizer.step(); model.zero_grad()

The daemon is `RANNC_DAEMON=host:port`, or an embedded ranncd that pyrannc starts on first use
and stops at exit (see pyrannc._daemon). Job-level config comes from `$RANNC_CONF_DIR/rannc.toml`
and `RANNC_<KEY>` environment variables (see pyrannc._config). The daemon plans each job at its
first forward; RaNNCModule.save_deployment / load_deployment and show_deployment work with the
saved plans (see pyrannc._deployment and docs/planner.md).
"""

import time

import grpc

from pyrannc import _config, _daemon, _jobs, _runtime
from pyrannc._deployment import show_deployment
from pyrannc._optim import register_optimizer
from pyrannc._runtime import get_rank, get_world_size
from pyrannc.errors import JobMoved, RanncError
from pyrannc.module import RaNNCModule
from pyrannc.proto.rannc.v1 import training_pb2 as _pb

__all__ = [
    "JobMoved", "RaNNCModule", "RanncError", "barrier", "clear", "delay_grad_allreduce", "get_rank",
    "get_world_size", "keep_graph", "recreate_all_communicators", "register_optimizer",
    "show_deployment",
    "sync_params_on_init", "daemon_info",
]


def barrier() -> None:
    """Blocks until every client rank of the job (same RANNC_JOB) reaches it; with one rank it
    returns at once. Ranks on different daemons meet at the cluster's coordinator; while a
    cluster on etcd has none (the last one just died), the call is retried for up to
    call_retry_timeout seconds (it reached no rendezvous, so it cannot be counted twice)."""
    world = _runtime.get_world_size()
    if world <= 1:
        return
    request = _pb.ClientBarrierRequest(
        name=_jobs.job_name(None), client_rank=_runtime.get_rank(), client_world=world,
        timeout_ms=_jobs.client_timeout_ms())
    deadline = time.monotonic() + _config.client_seconds("call_retry_timeout", 30.0)
    while True:
        try:
            _daemon.connection().call("ClientBarrier", request)
            return
        except RanncError as err:
            if (err.code != grpc.StatusCode.UNAVAILABLE or
                    "has no coordinator yet" not in str(err) or time.monotonic() > deadline):
                raise
            time.sleep(0.2)


def clear() -> None:
    """Deletes every RaNNCModule's daemon job (their state is first copied into the local
    models); the next forward of each creates a new job."""
    for module in _runtime.live_modules():
        module._drop_job()


def delay_grad_allreduce(delay: bool) -> None:
    """With True, backwards leave their gradients unreduced over the daemon's data-parallel
    replicas, each accumulating its own, until RaNNCModule.allreduce_grads() reduces them once
    (gradient accumulation); optimizer.step() and clip_grad_norm() fail until then."""
    _runtime.delay_grad_allreduce_flag = bool(delay)


def keep_graph(keep: bool) -> None:
    """Keep each forward's graph after backward (retain_graph), so it can be run again."""
    _runtime.keep_graph_flag = bool(keep)


def recreate_all_communicators() -> None:
    """Rebuilds the data-plane communicators of every job of this process."""
    for module in _runtime.live_modules():
        module.recreate_communicators()


def sync_params_on_init(sync: bool) -> None:
    """With True (the default), a client rank other than 0 copies the job's parameters and
    buffers (rank 0's model) into its local model when it joins the job at its first forward;
    with False its local model keeps its own values until it reads the job's state. The job
    trains rank 0's model either way."""
    _runtime.sync_params_on_init_flag = bool(sync)


def daemon_info():
    """The connected daemon's DaemonInfo (version, devices, limits); connects if needed."""
    return _daemon.connection().info
