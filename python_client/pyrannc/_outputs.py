"""The structure of a model's output, so the daemon's flat output list can be put back together.

The daemon returns outputs flattened depth-first. `flatten` turns a traced output (tensors inside
tuples, lists, dicts, namedtuples, with non-tensor constants such as None) into that flat tensor
list plus a spec; `unflatten` rebuilds the same nesting from a spec and a new flat list.
"""

from typing import Any, List, Tuple

import torch


class Leaf:
    """A tensor position in the output. `requires_grad`: the traced output needed grads."""

    __slots__ = ("index", "requires_grad")

    def __init__(self, index: int, requires_grad: bool):
        self.index = index
        self.requires_grad = requires_grad


class Const:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Seq:
    __slots__ = ("kind", "items")

    def __init__(self, kind, items):
        self.kind = kind  # tuple, list, or a namedtuple class
        self.items = items


class Mapping:
    __slots__ = ("kind", "keys", "items")

    def __init__(self, kind, keys, items):
        self.kind = kind
        self.keys = keys
        self.items = items


_CONSTANT_TYPES = (type(None), bool, int, float, str)


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def flatten(obj: Any) -> Tuple[List[torch.Tensor], Any]:
    tensors: List[torch.Tensor] = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            tensors.append(o)
            return Leaf(len(tensors) - 1, bool(o.requires_grad))
        if _is_namedtuple(o):
            return Seq(type(o), [walk(e) for e in o])
        if isinstance(o, (tuple, list)):
            return Seq(type(o) if type(o) in (tuple, list) else tuple, [walk(e) for e in o])
        if isinstance(o, dict):
            keys = list(o.keys())
            return Mapping(type(o), keys, [walk(o[k]) for k in keys])
        if isinstance(o, _CONSTANT_TYPES):
            return Const(o)
        raise TypeError(f"pyrannc cannot return a model output of type {type(o).__name__}; "
                        "outputs may be tensors, constants, and tuples/lists/dicts of them")

    spec = walk(obj)
    return tensors, spec


def leaves(spec) -> List[Leaf]:
    out: List[Leaf] = []

    def walk(s):
        if isinstance(s, Leaf):
            out.append(s)
        elif isinstance(s, (Seq, Mapping)):
            for item in s.items:
                walk(item)

    walk(spec)
    return out


def unflatten(spec, flat: List[torch.Tensor]) -> Any:
    # A module-level recursion: a nested recursive closure would form a reference cycle that
    # keeps `flat` (every output tensor) alive until the garbage collector runs.
    if isinstance(spec, Leaf):
        return flat[spec.index]
    if isinstance(spec, Const):
        return spec.value
    if isinstance(spec, Seq):
        items = [unflatten(i, flat) for i in spec.items]
        if spec.kind is list:
            return items
        if spec.kind is tuple:
            return tuple(items)
        return spec.kind(*items)
    if isinstance(spec, Mapping):
        pairs = [(k, unflatten(i, flat)) for k, i in zip(spec.keys, spec.items)]
        try:
            return spec.kind(pairs)
        except TypeError:
            return dict(pairs)
    raise AssertionError(f"unknown output spec {spec!r}")
