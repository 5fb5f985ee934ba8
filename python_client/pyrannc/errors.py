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


def from_rpc_error(method: str, err: grpc.RpcError, hint: str = "") -> RanncError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    message = f"ranncd {method} failed: {name}: {details}"
    if hint:
        message += f"\n{hint}"
    return RanncError(message, code=code, details=details or "")
