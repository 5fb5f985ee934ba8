"""A model's parameters and buffers, walked one way.

What pyrannc does with a model's tensors has to agree on which tensors there are and what they
are called: the fingerprint of a saved trace names every slot and its tying
(pyrannc._saved_trace), the tensors sent beside a TorchScript archive (leave_out) and those bound
to a saved archive's stand-ins (distinct) are each distinct tensor once under the name the traced
module gives it, and the bytes checked against shared memory's free space (distinct_bytes) are
those tensors'. `slots` is the one walk they all take.

    for s in slots(model):           # every slot, a tied tensor at each of its slots
        print(s.name, s.kind, s.tensor.shape)
    apart = leave_out(traced, min_bytes=1 << 20)   # [(name, tensor)] now outside the archive

Works on torch.nn.Module and on traced ScriptModules alike (both keep their slots in
_parameters/_buffers). Functions read the model only, except leave_out, which rebinds the traced
module's slots, and release/Released, which free and reallocate tensors' memory; callers own the
thread safety of the module they pass.
"""

from typing import Dict, Iterable, Iterator, List, NamedTuple, Set, Tuple

import torch


class Slot(NamedTuple):
    """One parameter or buffer slot of one module."""
    name: str              # dotted from the root: "encoder.layers.0.weight"
    module: torch.nn.Module  # the module holding the slot
    attr: str              # the slot's name in that module: "weight"
    kind: str              # "parameter" or "buffer"
    tensor: torch.Tensor


def slots(model: torch.nn.Module) -> Iterator[Slot]:
    """Every filled slot: modules in named_modules order with repeats (a module reached by two
    paths shows under both), each module's parameters then its buffers. A tensor held by several
    slots (tied weights) shows at each of them."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is not None:
                    yield Slot(f"{prefix}.{attr}" if prefix else attr, module, attr, kind, tensor)


def distinct(model: torch.nn.Module) -> Iterator[Slot]:
    """Each tensor once (by identity), at its first slot: what names it in a traced archive."""
    seen = set()
    for s in slots(model):
        if id(s.tensor) not in seen:
            seen.add(id(s.tensor))
            yield s


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def distinct_bytes(model: torch.nn.Module, min_bytes: int) -> int:
    """Bytes of the model's distinct tensors of at least `min_bytes` each: what leave_out
    takes out of the model's trace."""
    return sum(n for n in (nbytes(s.tensor) for s in distinct(model)) if n >= min_bytes)


def leave_out(traced: torch.jit.ScriptModule,
              min_bytes: int) -> List[Tuple[str, torch.Tensor]]:
    """Replaces each parameter and buffer of at least `min_bytes` in `traced` by a stand-in and
    returns the tensors replaced, by dotted name, each once (see JobSpec.model_tensors).

    A stand-in has the tensor's dtype, shape and requires_grad but one stored element (stride 0),
    so the archive keeps the module's structure and costs bytes only for what stays in it. Tied
    tensors share one stand-in, which keeps them tied in the archive. Only the traced module's
    slots change: the user's model keeps its tensors.
    """
    stand_ins: Dict[int, torch.Tensor] = {}
    apart: List[Tuple[str, torch.Tensor]] = []
    # Listed before rebinding: a slot rebound while the walk runs would be met again as its
    # stand-in.
    for s in list(slots(traced)):
        t = s.tensor
        if nbytes(t) < min_bytes:
            continue
        stand_in = stand_ins.get(id(t))
        if stand_in is None:
            stand_in = torch.zeros((), dtype=t.dtype).expand(t.shape)
            stand_in.requires_grad_(t.requires_grad)
            stand_ins[id(t)] = stand_in
            apart.append((s.name, t.detach()))
        s.module._c.setattr(s.attr, stand_in)
    return apart


def _storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's storage (PyTorch 2's untyped_storage; 1.13's storage())."""
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().nbytes()
    return t.storage().nbytes()


class Released:
    """Tensors whose memory release() freed: each holds an empty tensor of its dtype (shape [0])
    until restore() gives it memory of its shape again, values undefined until the caller fills
    them; free() frees it once more."""

    def __init__(self, tensors: List[Tuple[torch.Tensor, torch.Size]]):
        self._tensors = tensors
        self._shapes = {id(t): shape for t, shape in tensors}

    def nbytes(self) -> int:
        return sum(shape.numel() * t.element_size() for t, shape in self._tensors)

    def shape_of(self, t: torch.Tensor) -> torch.Size:
        """The shape `t` has when it holds its memory."""
        return self._shapes.get(id(t), t.shape)

    def restore(self) -> Set[int]:
        """Gives each tensor memory of its shape again; returns their ids."""
        for t, shape in self._tensors:
            t.data = torch.empty(shape, dtype=t.dtype)
        return set(self._shapes)

    def free(self) -> None:
        for t, _ in self._tensors:
            t.data = torch.empty(0, dtype=t.dtype)


def release(tensors: Iterable[torch.Tensor]) -> Released:
    """Frees the memory of CPU tensors that each own their storage whole (no view into another's)
    while the tensor objects stay: the module slots that hold them, tied ones included, and the
    references others keep (an optimizer's) still reach them. Until Released.restore() each is an
    empty tensor of its dtype, so a computation with it fails on its shape instead of reading
    freed memory (FSDP's storage resize would leave kernels a null pointer to read)."""
    kept: Dict[int, Tuple[torch.Tensor, torch.Size]] = {}
    for t in tensors:
        owns = t.storage_offset() == 0 and t.is_contiguous() and _storage_nbytes(t) == nbytes(t)
        if t.device.type == "cpu" and t.numel() > 0 and owns:
            kept.setdefault(id(t), (t, t.shape))
    released = Released(list(kept.values()))
    released.free()
    return released
