"""Process-wide pyrannc settings and the module functions of RaNNC's API.

RaNNC's module functions act on every RaNNCModule of the process; the live ones are tracked in
a weak set so `clear()` and `recreate_all_communicators()` can reach them.
"""

import os
import threading
import weakref

_lock = threading.Lock()
_live_modules = weakref.WeakSet()

# keep_graph(True): every Backward keeps the forward's graph (retain_graph).
keep_graph_flag = False
# RaNNC skips the gradient all-reduce after backward when set. With one client rank the daemon
# accumulates gradients locally either way, so this only records the choice.
delay_grad_allreduce_flag = False
# RaNNC synchronizes initial parameters over ranks; with one client rank there is nothing to
# synchronize.
sync_params_on_init_flag = True


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def get_rank() -> int:
    """This client's rank among the client processes of a job (RANNC_CLIENT_RANK, default 0)."""
    return _env_int("RANNC_CLIENT_RANK", 0)


def get_world_size() -> int:
    """The number of client processes of a job (RANNC_CLIENT_WORLD, default 1)."""
    return _env_int("RANNC_CLIENT_WORLD", 1)


def require_single_client(what: str) -> None:
    if get_world_size() > 1:
        raise NotImplementedError(
            f"{what}: several client ranks per job (RANNC_CLIENT_WORLD={get_world_size()}) are "
            "not supported yet; run one client process per job")


def register(module) -> None:
    with _lock:
        _live_modules.add(module)


def live_modules():
    with _lock:
        return list(_live_modules)
