"""The exception pyrannc raises when the daemon refuses or fails a request."""

from typing import Optional

import grpc


class RanncError(RuntimeError):
    """A call to ranncd failed.

    `code` is the gRPC status code (grpc.StatusCode) when the daemon answered with a status,
    None when the failure happened before a call could be made (e.g. the daemon did not start).
    `details` is the daemon's own message, which says what to change.
    """

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None,
                 details: str = ""):
        super().__init__(message)
        self.code = code
        self.details = details


class JobMoved(RanncError):
    """The daemon that led the job was lost, and another daemon of the cluster took the job over
    from its latest checkpoint (ranncd --cluster-store; docs/cluster.md "Failover"). The module
    drives it there from now on; the call that raised this was not applied, nor were those since
    that checkpoint. `step` is the optimizer steps the checkpoint had taken (also the module's
    `resumed_step`): go on with the training loop from that step's batch, as a resumed job does:

        step = model.resumed_step or 0
        while step < steps:
            try:
                train_one(step); step += 1
            except pyrannc.JobMoved as moved:
                step = moved.step
    """

    def __init__(self, message: str, job_name: str, job_id: str, leader: str, step: int):
        super().__init__(message, code=grpc.StatusCode.UNAVAILABLE, details=message)
        self.job_name = job_name
        self.job_id = job_id
        self.leader = leader
        self.step = step


def from_rpc_error(method: str, err: grpc.RpcError, hint: str = "") -> RanncError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    message = f"ranncd {method} failed: {name}: {details}"
    if hint:
        message += f"\n{hint}"
    return RanncError(message, code=code, details=details or "")
