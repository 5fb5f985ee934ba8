"""The structure of a model's output, so the daemon's flat output list can be put back together.

The daemon returns outputs flattened depth-first. `flatten` turns a traced output (tensors inside
tuples, lists, dicts, namedtuples, with non-tensor constants such as None) into that flat tensor
list plus a spec; `unflatten` rebuilds the same nesting from a spec and a new flat list. Every walk
over a spec (leaves, unflatten, pyrannc._saved_trace's JSON) is `fold`.
"""

from typing import Any, Callable, List, Tuple

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


def fold(spec, leaf: Callable, const: Callable, seq: Callable, mapping: Callable) -> Any:
    """The one walk over a spec, depth-first, children before their container: leaf(Leaf),
    const(Const), seq(Seq, [its items folded]), mapping(Mapping, [its items folded])."""
    # A module-level recursion: a nested recursive closure would form a reference cycle, and
    # one that holds what the callbacks hold (unflatten's every output tensor) stays alive until
    # the garbage collector runs.
    if isinstance(spec, Leaf):
        return leaf(spec)
    if isinstance(spec, Const):
        return const(spec)
    if isinstance(spec, Seq):
        return seq(spec, [fold(i, leaf, const, seq, mapping) for i in spec.items])
    if isinstance(spec, Mapping):
        return mapping(spec, [fold(i, leaf, const, seq, mapping) for i in spec.items])
    raise AssertionError(f"unknown output spec {spec!r}")


def _concat(_container, items: List[List[Leaf]]) -> List[Leaf]:
    return [leaf for item in items for leaf in item]


def leaves(spec) -> List[Leaf]:
    return fold(spec, lambda leaf: [leaf], lambda _: [], _concat, _concat)


def _rebuild_seq(spec: Seq, items: List[Any]) -> Any:
    if spec.kind is list:
        return items
    if spec.kind is tuple:
        return tuple(items)
    return spec.kind(*items)


def _rebuild_mapping(spec: Mapping, items: List[Any]) -> Any:
    pairs = list(zip(spec.keys, items))
    try:
        return spec.kind(pairs)
    except TypeError:
        return dict(pairs)


def unflatten(spec, flat: List[torch.Tensor]) -> Any:
    return fold(spec, lambda leaf: flat[leaf.index], lambda const: const.value, _rebuild_seq,
                _rebuild_mapping)
