"""Reading a torch optimizer for the daemon, and redirecting its step()/zero_grad() there.

The optimizer the user passes to RaNNCModule stays the object they hold: its param_groups (and
thus lr schedulers) are the source of each step's hyper-parameters, but the update itself and
the optimizer state live in the daemon. `patch` replaces the instance's `step`, `zero_grad`,
`state_dict` and `load_state_dict` with bound methods, so lr schedulers, which wrap
`optimizer.step` in a counting wrapper, keep working whether created before or after.
"""

import functools
import inspect
import io
import numbers
import types
import weakref
from typing import Callable, Dict, List, Sequence

import torch

from pyrannc.proto.rannc.v1 import training_pb2 as pb

_SUPPORTED = {
    torch.optim.SGD: pb.SGD,
    torch.optim.Adam: pb.ADAM,
    torch.optim.AdamW: pb.ADAMW,
    torch.optim.RMSprop: pb.RMSPROP,
    torch.optim.Adagrad: pb.ADAGRAD,
    torch.optim.Adamax: pb.ADAMAX,
    torch.optim.NAdam: pb.NADAM,
    torch.optim.RAdam: pb.RADAM,
    torch.optim.Adadelta: pb.ADADELTA,
    torch.optim.ASGD: pb.ASGD,
    torch.optim.Rprop: pb.RPROP,
}
_ADAM_LIKE = (pb.ADAM, pb.ADAMW, pb.ADAMAX, pb.NADAM, pb.RADAM)
# Kinds whose state['step'] PyTorch 1.x keeps as a Python int (2.x: a tensor, as for the rest).
_INT_STEP = (pb.RMSPROP, pb.ADADELTA, pb.RPROP) if torch.__version__.split(".")[0] < "2" else ()

# What this PyTorch does when zero_grad() is called without set_to_none.
OPTIMIZER_SET_TO_NONE_DEFAULT = inspect.signature(
    torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
MODULE_SET_TO_NONE_DEFAULT = inspect.signature(
    torch.nn.Module.zero_grad).parameters["set_to_none"].default


# Optimizer classes registered with register_optimizer: class -> pb.ScriptedOptimizer.
_SCRIPTED: Dict[type, pb.ScriptedOptimizer] = {}


def register_optimizer(cls: type, update: Callable, state: Sequence[str] = ()) -> None:
    """Runs optimizers of class `cls` (a torch.optim.Optimizer subclass that torch.optim does not
    have, such as Lion) in the daemon, with `update` as the per-parameter step.

    `update(param, grad, state, group) -> None`, a function TorchScript can compile (or one
    already scripted), with annotations `param: Tensor, grad: Tensor, state: Dict[str, Tensor],
    group: Dict[str, float]`, updates `param` and the tensors of `state` in place (or assigns new
    ones of the same shape) under no_grad. ranncd runs it for every parameter with a gradient,
    and for each ZeRO shard of one, so it must be elementwise: each element from its own state.

    `state`: the keys of a parameter's state, in the order optimizer.state_dict() lists them.
    Each is a tensor like the parameter, zeros before its first step, except "step": a count that
    ranncd advances before each update and passes as a 0-dim float32 tensor.

    `group`: the parameter's param group, its numbers as floats (bools 0/1); a sequence of
    numbers such as `betas` is flattened to `betas_0`, `betas_1`, ...; other entries are left
    out. Each step sends the groups as they are then, so lr schedulers work.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    if cls in _SUPPORTED:
        raise ValueError(f"torch.optim.{cls.__name__} already runs in the daemon as PyTorch's")
    keys = [state] if isinstance(state, str) else list(state)
    for key in keys:
        if not isinstance(key, str) or not key:
            raise TypeError(f"register_optimizer: state keys are names, got {key!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"register_optimizer: a state key is listed twice in {keys}")
    try:
        scripted = update if isinstance(update, torch.jit.ScriptFunction) else torch.jit.script(
            update)
    except Exception as e:
        raise TypeError(f"register_optimizer({cls.__qualname__}): TorchScript cannot compile "
                        f"the update: {e}") from e

    class Update(torch.nn.Module):
        def forward(self, param: torch.Tensor, grad: torch.Tensor,
                    state: Dict[str, torch.Tensor], group: Dict[str, float]) -> None:
            scripted(param, grad, state, group)

    try:
        module = torch.jit.script(Update())
    except Exception as e:
        raise TypeError(
            f"register_optimizer({cls.__qualname__}): the update must be update(param: Tensor, "
            f"grad: Tensor, state: Dict[str, Tensor], group: Dict[str, float]) -> None: {e}"
        ) from e
    saved = io.BytesIO()
    torch.jit.save(module, saved)
    _SCRIPTED[cls] = pb.ScriptedOptimizer(name=cls.__qualname__, module=saved.getvalue(),
                                          state_keys=keys)


def optimizer_type(optimizer) -> int:
    kind = _SUPPORTED.get(type(optimizer))
    if kind is None and type(optimizer) in _SCRIPTED:
        kind = pb.SCRIPTED
    if kind is None:
        t = type(optimizer)
        module = "torch.optim" if t.__module__.startswith("torch.optim.") else t.__module__
        names = ", ".join(f"torch.optim.{c.__name__}" for c in _SUPPORTED)
        raise NotImplementedError(
            f"pyrannc runs {names} in the daemon, and optimizers registered with "
            f"pyrannc.register_optimizer; {module}.{t.__qualname__} is not supported")
    return kind


def _named_hypers(group: dict) -> Dict[str, float]:
    """A scripted optimizer's group entries as register_optimizer describes them."""
    def number(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return float(v.item())
        if isinstance(v, (bool, numbers.Real)):
            return float(v)
        return None

    named = {}
    for key, value in group.items():
        if key == "params":
            continue
        scalar = number(value)
        if scalar is not None:
            named[key] = scalar
            continue
        items = [number(v) for v in value] if isinstance(value, (tuple, list)) else []
        if items and None not in items:
            named.update((f"{key}_{i}", v) for i, v in enumerate(items))
    return named


def hyper_params(group: dict, kind: int) -> pb.HyperParams:
    """A param group's hyper-parameters as torch.optim's `kind` keeps them (every field it uses
    set, so that the daemon takes none of its defaults)."""
    if kind == pb.SCRIPTED:
        return pb.HyperParams(named=_named_hypers(group))
    h = pb.HyperParams(lr=float(group["lr"]),
                       weight_decay=float(group.get("weight_decay", 0.0)),
                       maximize=bool(group.get("maximize", False)))
    if kind == pb.SGD:
        h.momentum = float(group.get("momentum", 0.0))
        h.dampening = float(group.get("dampening", 0.0))
        h.nesterov = bool(group.get("nesterov", False))
        return h
    if "eps" in group:
        h.eps = float(group["eps"])
    if kind in _ADAM_LIKE:
        beta1, beta2 = group["betas"]
        h.beta1 = float(beta1)
        h.beta2 = float(beta2)
        h.amsgrad = bool(group.get("amsgrad", False))
        if kind == pb.NADAM:
            h.momentum_decay = float(group["momentum_decay"])
        if kind in (pb.NADAM, pb.RADAM):
            h.decoupled_weight_decay = bool(group.get("decoupled_weight_decay", False))
    elif kind == pb.RMSPROP:
        h.alpha = float(group["alpha"])
        h.momentum = float(group["momentum"])
        h.centered = bool(group["centered"])
    elif kind == pb.ADAGRAD:
        h.lr_decay = float(group["lr_decay"])
        h.initial_accumulator_value = float(group["initial_accumulator_value"])
    elif kind == pb.ADADELTA:
        h.rho = float(group["rho"])
    elif kind == pb.ASGD:
        h.lambd = float(group["lambd"])
        h.alpha = float(group["alpha"])
        h.t0 = float(group["t0"])
    elif kind == pb.RPROP:
        h.etaminus, h.etaplus = (float(e) for e in group["etas"])
        h.step_size_min, h.step_size_max = (float(s) for s in group["step_sizes"])
    return h


def group_param_names(optimizer, names_by_id: Dict[int, str]) -> List[List[str]]:
    """Each param group's parameters, by the module's parameter names."""
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            name = names_by_id.get(id(p))
            if name is None:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {list(p.shape)} that is "
                    "not a parameter of the model given to RaNNCModule")
            names.append(name)
        groups.append(names)
    return groups


def group_param_ids(optimizer) -> List[List[int]]:
    return [[id(p) for p in g["params"]] for g in optimizer.param_groups]


def optimizer_spec(optimizer, names_by_id: Dict[int, str]) -> pb.OptimizerSpec:
    if optimizer is None:
        return pb.OptimizerSpec(type=pb.OPTIMIZER_NONE)
    kind = optimizer_type(optimizer)
    spec = pb.OptimizerSpec(type=kind)
    if kind == pb.SCRIPTED:
        spec.scripted.CopyFrom(_SCRIPTED[type(optimizer)])
    for group, names in zip(optimizer.param_groups, group_param_names(optimizer, names_by_id)):
        spec.groups.add(params=names, hyper=hyper_params(group, kind))
    return spec


def _ordered_params(optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters in state_dict()'s index order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_by_index(optimizer, names_by_id: Dict[int, str],
                   by_name: Dict[str, Dict[str, torch.Tensor]]) -> Dict[int, Dict[str, object]]:
    """The daemon's state (parameter name -> {key: tensor}) as torch.optim's state_dict()
    'state': parameter index -> {key: tensor}, on the parameters' devices."""
    int_step = optimizer_type(optimizer) in _INT_STEP
    state = {}
    for index, p in enumerate(_ordered_params(optimizer)):
        entries = by_name.get(names_by_id.get(id(p)))
        if entries:
            state[index] = {
                k: int(v.item()) if k == "step" and int_step else v.to(p.device)
                for k, v in entries.items()}
    return state


def local_state_by_name(optimizer, names_by_id: Dict[int, str]
                        ) -> Dict[str, Dict[str, torch.Tensor]]:
    """The optimizer's own (local) state, by parameter name, for the daemon."""
    by_name = {}
    for p in _ordered_params(optimizer):
        entries = optimizer.state.get(p)
        if entries:
            by_name[names_by_id[id(p)]] = {
                k: torch.as_tensor(v, dtype=torch.float32) if k == "step" else v
                for k, v in entries.items() if isinstance(v, torch.Tensor) or k == "step"}
    return by_name


def _counting(bound, optimizer):
    # Mirrors the step tracking of torch.optim.lr_scheduler, for a scheduler made before the
    # patch: PyTorch 1.x's with_counter (_step_count) and 2.x's patch_track_step_called
    # (_opt_called), so that neither warns that step() was overridden.
    opt_ref = weakref.ref(optimizer)
    counts = hasattr(optimizer, "_step_count")

    @functools.wraps(bound)
    def wrapper(*args, **kwargs):
        opt = opt_ref()
        if counts:
            opt._step_count += 1
        opt._opt_called = True
        return bound(*args, **kwargs)

    wrapper._with_counter = True
    wrapper._wrapped_by_lr_sched = True
    return wrapper


def patch(optimizer, module) -> None:
    """Routes `optimizer`'s step/zero_grad to `module`'s daemon job."""
    module_ref = weakref.ref(module)

    def owner():
        m = module_ref()
        if m is None:
            raise RuntimeError("the RaNNCModule this optimizer was given to no longer exists")
        return m

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner()._optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = OPTIMIZER_SET_TO_NONE_DEFAULT):
        owner()._zero_grad(set_to_none)

    # The class's methods, not the instance's: a second patch must not wrap the first.
    original_state_dict = types.MethodType(type(optimizer).state_dict, optimizer)
    original_load_state_dict = types.MethodType(type(optimizer).load_state_dict, optimizer)

    def state_dict(self, from_global: bool = True, **kwargs):
        # RaNNC's from_global=True gathers every rank's shard; ranncd's state is always whole.
        sd = original_state_dict()
        m = owner()
        if m._has_job():
            sd["state"] = state_by_index(self, m._names_by_id(), m._optimizer_state())
        return sd

    def load_state_dict(self, state_dict, from_global: bool = True, **kwargs):
        # torch.optim checks the groups, takes their hyper-parameters and casts the state to
        # each parameter's dtype and device.
        m = owner()
        if not m._has_job():
            return original_load_state_dict(state_dict)  # sent with the job at its creation
        groups = self.param_groups
        original_load_state_dict(state_dict)
        try:
            m._load_optimizer_state(local_state_by_name(self, m._names_by_id()))
        except BaseException:
            self.param_groups = groups  # refused: the hyper-parameters stay as they were too
            raise
        finally:
            self.state.clear()  # the daemon holds it; state_dict() reads it there

    bound_step = types.MethodType(step, optimizer)
    previous = optimizer.__dict__.get("step")
    if previous is not None and (getattr(previous, "_with_counter", False) or
                                 getattr(previous, "_wrapped_by_lr_sched", False)):
        optimizer.step = _counting(bound_step, optimizer)
    else:
        optimizer.step = bound_step
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    optimizer._rannc_patched = True
