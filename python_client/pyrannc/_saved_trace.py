"""A traced graph kept in a deployment file, so a start from that file can skip torch.jit.trace.

RaNNCModule's first forward traces the model (a full forward on the host CPU) and sends the
TorchScript archive. A deployment file saved after it also holds that trace
(rannc.v1.SavedTrace: the archive with every parameter and buffer a stand-in, the outputs'
structure, and a fingerprint of what determined the graph). When RaNNCModule(...,
load_deployment=path) starts the same model, the archive is sent again with the user's current
tensors bound to its stand-ins by name (JobSpec.model_tensors); no tensor value is ever taken
from the file.

    fp, why_not = fingerprint(model, trace_inputs, training=True, dropout=True)
    ...
    reason = mismatch(json.loads(saved.fingerprint), fp)   # None: the same graph

The fingerprint holds everything this module can see that decides the traced graph: the torch
version, train/eval and dropout mode, the input signature (count, dtypes, shapes, devices), the
module tree (qualified names and types), every parameter's and buffer's name, dtype, shape,
requires_grad and tying, the plain attributes of each module (constants the trace bakes in,
such as a head count or an eps; tensor attributes by a hash of their bytes) and the source of
every module class in the tree (inspect.getsource; a class without source defeats reuse).

Hazard: code the forward calls outside the module classes (a helper function in another file, a
global flag it reads) is not fingerprinted. Changing such code between the run that saved the
deployment and the one that loads it, with everything above unchanged, reuses a graph that no
longer matches the code; set RANNC_REUSE_TRACE=0 (or save the deployment again) after such a
change.

Pure functions of their arguments (apart from reading RANNC_REUSE_TRACE); any thread.
"""

import collections
import hashlib
import inspect
import json
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from pyrannc import _config, _outputs, _tensors

# Bumped when the fingerprint's contents change: an older fingerprint never matches.
_SCHEME = 1


def reuse_enabled() -> bool:
    """reuse_trace = false (RANNC_REUSE_TRACE=0) turns reuse off (the model is always
    traced)."""
    return _config.client_bool("reuse_trace", True)


class _Unfingerprintable(Exception):
    """Something that decides the graph has no stable description; reuse is off."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _class_source(cls: type, cache: Dict[type, str]) -> str:
    """A digest of the source of `cls` and of its nn.Module bases (a forward inherited or
    reached through super() is theirs)."""
    if cls not in cache:
        parts = []
        for base in cls.__mro__:
            if base is torch.nn.Module or not issubclass(base, torch.nn.Module):
                continue
            try:
                parts.append(inspect.getsource(base))
            except (OSError, TypeError) as err:
                raise _Unfingerprintable(
                    f"the source of module class {_type_name(base)} is not available ({err})"
                ) from None
        cache[cls] = _digest("\n".join(parts))
    return cache[cls]


def _describe(value: Any, where: str) -> str:
    """A stable text for a module attribute's value; _Unfingerprintable if there is none."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        flat = t.reshape(-1)
        data = flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8)
        return (f"tensor {t.dtype} {list(t.shape)} "
                f"{hashlib.sha256(data.numpy().tobytes()).hexdigest()[:32]}")
    if isinstance(value, (type(None), bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v, where) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        inner = ", ".join(f"{k!r}: {_describe(v, where)}" for k, v in value.items())
        return f"{type(value).__name__}({inner})"
    if inspect.isfunction(value) or inspect.ismethod(value):
        func = getattr(value, "__func__", value)
        try:
            return f"function {func.__module__}.{func.__qualname__} {_digest(inspect.getsource(func))}"
        except (OSError, TypeError):
            raise _Unfingerprintable(f"the source of {where} is not available") from None
    if inspect.isbuiltin(value) or isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    text = repr(value)
    if " at 0x" in text:
        raise _Unfingerprintable(f"{where} ({type(value).__name__}) has no stable description")
    return f"{_type_name(type(value))} {text}"


def _has_hooks(model: torch.nn.Module) -> bool:
    glob = torch.nn.modules.module
    if any(getattr(glob, name, None) for name in ("_global_forward_hooks",
                                                 "_global_forward_pre_hooks")):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def fingerprint(model: torch.nn.Module, inputs, training: bool, dropout: bool
                ) -> Tuple[Optional[Dict[str, Any]], str]:
    """What decides the graph torch.jit.trace makes of `model` on `inputs` in this mode, as a
    JSON-able dict; (None, why) when something that decides it has no stable description."""
    try:
        if _has_hooks(model):
            raise _Unfingerprintable("the model has forward hooks, whose effect on the graph "
                                     "is not fingerprinted")
        sources: Dict[type, str] = {}
        modules, classes, attributes = [], {}, []
        for name, m in model.named_modules(remove_duplicate=False):
            modules.append([name, _type_name(type(m))])
            classes[_type_name(type(m))] = _class_source(type(m), sources)
            for key, value in sorted(vars(m).items()):
                if key.startswith("_") or key == "training":
                    continue
                where = f"attribute '{name + '.' if name else ''}{key}'"
                attributes.append([f"{name + '.' if name else ''}{key}", _describe(value, where)])
        first_name: Dict[int, str] = {}
        tensors = []
        for s in _tensors.slots(model):
            t = s.tensor
            tied = first_name.setdefault(id(t), s.name)
            tensors.append([s.name, s.kind, str(t.dtype), list(t.shape), bool(t.requires_grad),
                            "" if tied == s.name else tied])
    except _Unfingerprintable as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - a model this code did not foresee: no reuse
        return None, f"fingerprinting the model failed ({type(err).__name__}: {err})"
    return {
        "scheme": _SCHEME,
        "torch": torch.__version__,
        "mode": {"training": bool(training), "dropout": bool(dropout)},
        # Modules whose train/eval flag is not the model's (a frozen BatchNorm): traced as set.
        "other_mode": [name for name, m in model.named_modules(remove_duplicate=False)
                       if m.training != model.training],
        "inputs": [[str(x.dtype), list(x.shape), str(x.device)] for x in inputs],
        "modules": modules,
        "tensors": tensors,
        "attributes": attributes,
        "classes": classes,
    }, ""


def _first_difference(what: str, saved: List, current: List) -> str:
    for i, (a, b) in enumerate(zip(saved, current)):
        if a != b:
            return f"{what} differ: {a} in the saved trace, {b} now"
    return f"{what} differ: {len(saved)} in the saved trace, {len(current)} now"


def mismatch(saved: Dict[str, Any], current: Dict[str, Any]) -> Optional[str]:
    """None when the two fingerprints are equal, else why not, for people."""
    if saved.get("scheme") != current["scheme"]:
        return "the saved fingerprint is of another pyrannc's making"
    if saved.get("torch") != current["torch"]:
        return f"torch {saved.get('torch')} traced it, this is torch {current['torch']}"
    if saved.get("mode") != current["mode"]:
        return f"it was traced in mode {saved.get('mode')}, the model is now in {current['mode']}"
    if saved.get("inputs") != current["inputs"]:
        return _first_difference("the trace inputs (dtype, shape, device)",
                                 saved.get("inputs", []), current["inputs"])
    if saved.get("modules") != current["modules"]:
        return _first_difference("the module trees (name, type)", saved.get("modules", []),
                                 current["modules"])
    if saved.get("tensors") != current["tensors"]:
        return _first_difference("the parameters and buffers (name, kind, dtype, shape, "
                                 "requires_grad, tied to)", saved.get("tensors", []),
                                 current["tensors"])
    saved_classes = saved.get("classes", {})
    for cls, digest in current["classes"].items():
        if saved_classes.get(cls) != digest:
            return f"the source of module class {cls} changed"
    if saved.get("attributes") != current["attributes"]:
        return _first_difference("module attributes", saved.get("attributes", []),
                                 current["attributes"])
    if saved != current:
        return "the fingerprints differ"
    return None


# ----------------------------------------------------------------------------------------------
# The outputs' structure (pyrannc._outputs specs) as JSON. Container classes are named, and
# found again only among modules already imported: loading a file never imports anything.

def _kind_name(kind: type) -> str:
    return {tuple: "tuple", list: "list", dict: "dict"}.get(kind, _type_name(kind))


def _resolve(name: str) -> type:
    builtin = {"tuple": tuple, "list": list, "dict": dict,
               "collections.OrderedDict": collections.OrderedDict}
    if name in builtin:
        return builtin[name]
    # The qualname may itself be dotted (a class inside a class): try each split.
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if isinstance(obj, type):
            return obj
    raise ValueError(f"the output container class {name} is not among the imported modules")


def outputs_to_json(spec) -> str:
    return json.dumps(_outputs.fold(
        spec,
        lambda leaf: {"leaf": leaf.index, "grad": leaf.requires_grad},
        lambda const: {"const": const.value},
        lambda seq, items: {"seq": _kind_name(seq.kind), "items": items},
        lambda m, items: {"map": _kind_name(m.kind), "keys": list(m.keys), "items": items}))


def outputs_from_json(text: str):
    """The spec outputs_to_json wrote; ValueError if it cannot be rebuilt here."""
    def walk(o):
        if "leaf" in o:
            return _outputs.Leaf(int(o["leaf"]), bool(o["grad"]))
        if "const" in o:
            return _outputs.Const(o["const"])
        if "seq" in o:
            return _outputs.Seq(_resolve(o["seq"]), [walk(i) for i in o["items"]])
        if "map" in o:
            return _outputs.Mapping(_resolve(o["map"]), list(o["keys"]),
                                    [walk(i) for i in o["items"]])
        raise ValueError(f"unknown output entry {o!r}")

    try:
        return walk(json.loads(text))
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"the saved outputs' structure is unreadable ({err})") from None


def model_tensors(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Every distinct parameter and buffer of `model`, each once under its first name (in
    named_modules order, as the traced module names them): what binds a saved archive's
    stand-ins."""
    return [(s.name, s.tensor.detach()) for s in _tensors.distinct(model)]
