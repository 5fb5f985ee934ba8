"""Tracing a model for the daemon: the inputs it is traced on, the TorchScript archive, the
structure of its outputs, and the tensors sent beside the archive.

    inputs, plan_batch = trace_inputs(inputs)          # RANNC_TRACE_BATCH: part of the batch
    model_bytes, spec, apart, graph = trace(model, inputs, mode, apart_bytes=1 << 20)

`trace` runs the model's forward once and restores what that forward changes (buffers, the RNG
stream, train/eval flags), so the daemon starts from the state plain PyTorch would have. Like
the model itself, it is for one thread at a time.
"""

import inspect
import io
import logging
import time
import warnings
from typing import List, Optional, Tuple

import torch

from pyrannc import _config, _outputs, _tensors
from pyrannc.proto.rannc.v1 import training_pb2 as pb

logger = logging.getLogger("pyrannc")

_DROPOUT_TYPES = (torch.nn.modules.dropout._DropoutNd,)


def input_names(model: torch.nn.Module, count: int) -> List[str]:
    """Names for `count` positional inputs of model.forward: its parameter names, `args[i]` for a
    *args, `input{i}` where the signature says nothing."""
    names: List[str] = []
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names.extend(f"{p.name}[{i}]" for i in range(count - len(names)))
            break
    names.extend(f"input{i}" for i in range(len(names), count))
    return names[:count]


def trace_inputs(inputs):
    """The inputs the model is traced on and sent as the job's examples, and the batch to
    plan for (None: theirs).

    With the client setting trace_batch (RANNC_TRACE_BATCH) = n, a batch of more than n
    samples (every tensor input with the same first dimension) is traced on its first n
    samples, and the daemon plans for the whole batch (planner key batch_size, unless set):
    the trace's forward and the daemon's IR cost n samples' compute and memory, not the
    batch's. The model must not fix its batch size (x.view(batch, ...)).
    """
    n = _config.client_int("trace_batch", 0)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if n <= 0 or not tensors or any(t.dim() == 0 for t in tensors):
        return inputs, None
    batch = tensors[0].size(0)
    if batch <= n or any(t.size(0) != batch for t in tensors):
        return inputs, None
    return [x[:n] if isinstance(x, torch.Tensor) else x for x in inputs], batch


def _save(traced: torch.jit.ScriptModule) -> bytes:
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    return buf.getvalue()


def _restore_buffers(saved_buffers) -> None:
    with torch.no_grad():
        for b, value in saved_buffers:
            b.copy_(value)


def _trace_keeping_nothing(model: torch.nn.Module, inputs,
                           before_retry) -> torch.jit.ScriptModule:
    """torch.jit.trace with autograd on (the model's code may branch on it, and the graph
    records what it sees), but without what autograd saves for a backward that never runs: a
    model's forward saves about 16 activations of the model's width a token and layer, so on
    one sample of 2048 tokens of a 10B GPT that is ~25 GiB of host memory beside the model.
    Autograd keeps None for each saved tensor, which goes as soon as nothing else holds it.
    A forward that runs a backward itself (torch.autograd.grad inside the model) needs them:
    it is traced again the plain way, after `before_retry()`."""
    unpacked = []

    def unpack(_none):
        unpacked.append(True)
        raise RuntimeError("pyrannc: a backward inside the traced forward read a tensor saved "
                           "for it; tracing again with saved tensors kept")

    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda _t: None, unpack):
            return torch.jit.trace(model, inputs, check_trace=False)
    except Exception:  # noqa: BLE001 - re-raised unless a saved tensor was read
        if not unpacked:
            raise
    logger.debug("pyrannc: the model's forward runs a backward; traced with saved tensors")
    before_retry()
    return torch.jit.trace(model, inputs, check_trace=False)


def trace(model: torch.nn.Module, inputs, mode: pb.Mode, apart_bytes: Optional[int] = None,
          graph_only: bool = False
          ) -> Tuple[bytes, object, List[Tuple[str, torch.Tensor]], Optional[bytes]]:
    """Traces `model` in `mode`; returns the serialized module, its output spec, the tensors
    left out of it and, with `graph_only`, the module serialized with every tensor left out (for
    a deployment file's saved trace; else None).

    With `apart_bytes` set, every parameter or buffer of at least that many bytes is left out
    of the archive (see pyrannc._tensors.leave_out) and returned by name, to be sent beside it.

    Tracing runs forward once; the model's buffers (BatchNorm statistics), its RNG stream
    and its train/eval flags are restored afterwards, so the daemon starts from the state
    plain PyTorch would have.
    """
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    saved_flags = [(m, m.training) for m in model.modules()]
    captured = {}

    def flatten_output(_module, _inputs, output):
        tensors, spec = _outputs.flatten(output)
        captured["spec"] = spec
        # The daemon sees one flat tuple (or a lone tensor); the spec rebuilds the rest.
        if isinstance(spec, _outputs.Leaf):
            return tensors[0]
        return tuple(tensors)

    handle = model.register_forward_hook(flatten_output)
    try:
        # The modules' own flags are the mode (a BatchNorm the user froze in eval mode stays
        # so, as in PyTorch); only enable_dropout() overrides the dropouts'.
        if mode.dropout != mode.training:
            for m in model.modules():
                if isinstance(m, _DROPOUT_TYPES):
                    m.training = mode.dropout
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                warnings.catch_warnings():
            # PyTorch's own modules (BatchNorm's batch-size check, Tensor.split) warn about
            # Python values on every trace; warnings about the user's code still show.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning,
                                    module=r"torch\.")
            started = time.perf_counter()
            traced = _trace_keeping_nothing(model, inputs, lambda: _restore_buffers(saved_buffers))
            logger.debug("pyrannc: traced the model in %.2f s", time.perf_counter() - started)
    finally:
        handle.remove()
        for m, flag in saved_flags:
            m.training = flag
        _restore_buffers(saved_buffers)
    started = time.perf_counter()
    apart = _tensors.leave_out(traced, apart_bytes) if apart_bytes is not None else []
    model_bytes = _save(traced)
    logger.debug("pyrannc: serialized the traced model (%d bytes, %d tensors apart) in %.2f s",
                 len(model_bytes), len(apart), time.perf_counter() - started)
    graph_bytes = None
    if graph_only:
        if apart_bytes == 0:
            graph_bytes = model_bytes
        else:
            # The tensors still in the archive become stand-ins too: a few MB of graph and
            # code, whatever the model's size.
            _tensors.leave_out(traced, 0)
            graph_bytes = _save(traced)
    return model_bytes, captured["spec"], apart, graph_bytes
