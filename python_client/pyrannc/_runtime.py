"""Process-wide pyrannc settings and the module functions of RaNNC's API.

RaNNC's module functions act on every RaNNCModule of the process; the live ones are tracked in
a weak set so `clear()` and `recreate_all_communicators()` can reach them.
"""

import os
import threading
import weakref

from pyrannc import _config

_lock = threading.Lock()
_live_modules = weakref.WeakSet()

# keep_graph(True): every Backward keeps the forward's graph (retain_graph).
keep_graph_flag = False
# delay_grad_allreduce(True): forwards and backwards ask the daemon to leave gradients
# unreduced over its replicas until RaNNCModule.allreduce_grads().
delay_grad_allreduce_flag = False
# sync_params_on_init(): a joining client rank copies the job's parameters into its local model.
sync_params_on_init_flag = True


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"pyrannc: {name}={value} is not an integer") from None


# Where a client process finds its rank and the number of ranks, when rannc's own client keys
# client_rank and client_world are not set (RANNC_CLIENT_RANK/_WORLD, else rannc.toml):
# torchrun's variables, then Open MPI's, then other MPIs' (PMI).
_LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("PMI_RANK", "PMI_SIZE"))


def _rank_and_world():
    if _config.client_setting_from("client_rank")[1] or \
            _config.client_setting_from("client_world")[1]:
        return _config.client_int("client_rank", 0), _config.client_int("client_world", 1)
    for rank_name, world_name in _LAUNCHER_VARIABLES:
        if rank_name in os.environ or world_name in os.environ:
            return _env_int(rank_name, 0), _env_int(world_name, 1)
    return 0, 1


def get_rank() -> int:
    """This client's rank among the client processes of a job (client_rank: RANNC_CLIENT_RANK
    or rannc.toml; else RANK from torchrun, or the MPI rank; default 0)."""
    return _rank_and_world()[0]


def get_world_size() -> int:
    """The number of client processes of a job (client_world: RANNC_CLIENT_WORLD or rannc.toml;
    else WORLD_SIZE from torchrun, or the MPI size; default 1)."""
    return _rank_and_world()[1]


def check_ranks() -> None:
    rank, world = _rank_and_world()
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"pyrannc: client rank {rank} is outside 0..{world - 1} "
                         "(RANNC_CLIENT_RANK / RANNC_CLIENT_WORLD, client_rank / client_world "
                         "in rannc.toml, or the launcher's variables)")


def register(module) -> None:
    with _lock:
        _live_modules.add(module)


def live_modules():
    with _lock:
        return list(_live_modules)
