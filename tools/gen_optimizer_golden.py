#!/usr/bin/env python3
"""Writes daemon/optim/testdata/optimizer_golden.pt: what torch.optim itself computes, step by
step, for the optimizer kinds that LibTorch's C++ API lacks (and RMSprop and Adagrad, which it
has), so that daemon/optim/optimizer_kinds_test.cc can hold rannc's ports to PyTorch.

Run it with the PyTorch whose algorithms rannc follows (Debian's 1.13), from the repository root:

    /usr/bin/python3 tools/gen_optimizer_golden.py

It is deterministic (fixed seeds), so running it again rewrites the same file. Each config runs
one torch.optim optimizer over two param groups for STEPS steps, with grads that some params lack
on some steps (one never has one) and hyper-parameters changed part-way, as a scheduler would.
Options PyTorch 1.13 lacks but 2.x has (NAdam/RAdam `maximize` and `decoupled_weight_decay`) are
produced with 1.13's ops the way 2.x applies them: maximize negates the grad before anything
else, and decoupled weight decay multiplies the param by 1 - lr * weight_decay before the step
(nothing in the step reads the param before 2.x does that). Adagrad's per-group
initial_accumulator_value (1.13 takes only the constructor's) is set by filling each group's
`sum` after construction.

The file is a dict of tensors (torch.save's zip format, which LibTorch's torch::pickle_load
reads). S is STEPS; p numbers params across groups; a step's row holds the value after it:
  steps                                 int64 scalar S
  defaults/<kind>/<field>               float64 [] or [2]: torch.optim.<Kind>'s defaults
  <kind>/<config>/group_sizes           int64 [groups]
  <kind>/<config>/hyper/<g>/<field>     float64 [S] or [S, 2] (betas, etas, step_sizes): group
                                        g's value at each step, with torch.optim's field names
  <kind>/<config>/init/<p>              float32: param p before the first step
  <kind>/<config>/has_grad/<p>          int64 [S]: 1 where p has a grad at that step
  <kind>/<config>/grad/<p>              float32 [S, *shape]: p's dense grads (zeros where none)
  <kind>/<config>/grad_indices/<s>/<p>  int64 [1, nnz] and
  <kind>/<config>/grad_values/<s>/<p>   float32 [nnz, ...]: a sparse grad instead (uncoalesced)
  <kind>/<config>/param/<p>             float32 [S, *shape]: p after each step
  <kind>/<config>/first/<p>             int64 scalar: first step after which p has state (S: none)
  <kind>/<config>/state/<p>/<key>       float32 [S, *shape], or [S] for scalar keys:
                                        state_dict()['state'][p][key] after each step (zeros
                                        before `first`); Python numbers as float32
"""
import os

import torch

STEPS = 12
CHANGE_AT = 4  # the step before which `changes` apply
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "daemon", "optim", "testdata", "optimizer_golden.pt")

# Two groups: [3, 4] and [5] in group 0; [2, 3], [4] and [6] in group 1.
SHAPES = [[(3, 4), (5,)], [(2, 3), (4,), (6,)]]


def has_grad(p, step):
    return [True,              # every step
            step % 2 == 0,     # even steps: step counts differ between params
            step >= 6,         # first grad after the hyper change: state starts from new hypers
            step != 7,         # skips one step mid-run
            False][p]          # never: no state (except Adagrad's, made at construction)


# kind -> config -> (hypers of each group, {group: changes applied before step CHANGE_AT}).
# Hyper names are torch.optim's; maximize and decoupled_weight_decay of NAdam/RAdam are emulated.
CONFIGS = {
    "rmsprop": {
        "plain_and_centered_momentum": (
            [dict(lr=1e-2),
             dict(lr=5e-3, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9, centered=True)],
            {0: dict(lr=5e-3), 1: dict(lr=2.5e-3, alpha=0.95, momentum=0.5)}),
        "maximize": (
            [dict(lr=1e-2, momentum=0.8, maximize=True),
             dict(lr=2e-2, centered=True, maximize=True, weight_decay=0.01)],
            {0: dict(lr=4e-3), 1: dict(eps=1e-3)}),
    },
    "adagrad": {
        "lr_decay_and_accumulator": (
            [dict(lr=0.1, lr_decay=0.1, initial_accumulator_value=0.5),
             dict(lr=0.05, weight_decay=0.1, eps=1e-6, initial_accumulator_value=0.1)],
            {0: dict(lr=0.05), 1: dict(eps=1e-4, lr_decay=0.2)}),
        "maximize": (
            [dict(lr=0.01, maximize=True),
             dict(lr=0.02, maximize=True, weight_decay=0.05, lr_decay=0.01)],
            {0: dict(lr=0.03)}),
        # Group 0's one param gets sparse grads with duplicate indices; group 1's, dense ones.
        "sparse": (
            [dict(lr=0.1, lr_decay=0.05, eps=1e-8, maximize=True),
             dict(lr=0.05, weight_decay=0.1)],
            {0: dict(lr=0.2)}),
    },
    "adamax": {
        "defaults_and_betas": (
            [dict(lr=2e-3),
             dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.1)],
            {0: dict(lr=1e-3), 1: dict(betas=(0.85, 0.95))}),
        "maximize": (
            [dict(lr=1e-2, maximize=True, weight_decay=0.01),
             dict(lr=5e-3, maximize=True)],
            {1: dict(lr=1e-2)}),
    },
    "nadam": {
        "defaults_and_momentum_decay": (
            [dict(lr=2e-3),
             dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, momentum_decay=0.01)],
            {0: dict(lr=1e-3), 1: dict(momentum_decay=0.02, betas=(0.85, 0.995))}),
        "decoupled_and_maximize": (
            [dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
             dict(lr=5e-3, maximize=True, weight_decay=0.05, decoupled_weight_decay=True)],
            {0: dict(weight_decay=0.2, lr=5e-3)}),
        "maximize_l2": (
            [dict(lr=1e-2, maximize=True, weight_decay=0.05),
             dict(lr=3e-3)],
            {1: dict(lr=6e-3)}),
    },
    "radam": {
        "defaults_and_betas": (
            [dict(lr=1e-3),
             dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)],
            {0: dict(lr=5e-3), 1: dict(betas=(0.85, 0.92))}),
        "decoupled_and_maximize": (
            [dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, betas=(0.9, 0.9)),
             dict(lr=5e-3, maximize=True, weight_decay=0.05)],
            {0: dict(weight_decay=0.2), 1: dict(decoupled_weight_decay=True)}),
    },
    "adadelta": {
        "defaults_and_rho": (
            [dict(lr=1.0),
             dict(lr=0.5, rho=0.5, eps=1e-4, weight_decay=0.1)],
            {0: dict(lr=0.5, rho=0.8)}),
        "maximize": (
            [dict(lr=1.0, maximize=True),
             dict(lr=2.0, maximize=True, weight_decay=0.01, rho=0.99)],
            {1: dict(lr=1.5)}),
    },
    "asgd": {
        "averaging": (
            [dict(lr=1e-2, t0=3),
             dict(lr=5e-2, lambd=1e-2, alpha=0.5, t0=0, weight_decay=0.1)],
            {0: dict(lr=5e-3), 1: dict(lambd=5e-3, alpha=0.6)}),
        "defaults_and_maximize": (
            [dict(lr=1e-2, maximize=True),
             dict(lr=2e-2, maximize=True, t0=5)],
            {1: dict(t0=2, lr=3e-2)}),
    },
    "rprop": {
        "etas_and_step_sizes": (
            [dict(lr=1e-2),
             dict(lr=4e-2, etas=(0.3, 1.5), step_sizes=(1e-3, 5e-2))],
            {0: dict(lr=5e-3), 1: dict(lr=3e-2, etas=(0.4, 1.3))}),
        "maximize": (
            [dict(lr=1e-2, maximize=True),
             dict(lr=1e-2, maximize=True, step_sizes=(1e-6, 1e-2))],
            {0: dict(step_sizes=(1e-4, 2e-2))}),
    },
}

CLASSES = {
    "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad, "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam, "adadelta": torch.optim.Adadelta, "asgd": torch.optim.ASGD,
    "rprop": torch.optim.Rprop,
}
EMULATED = ("maximize", "decoupled_weight_decay")  # for NAdam and RAdam, which 1.13 lacks
NOT_HYPERS = ("params", "foreach", "differentiable", "capturable", "fused")


def hyper_value(v):
    return torch.tensor([float(x) for x in v] if isinstance(v, tuple) else float(v),
                        dtype=torch.float64)


def state_value(v):
    return (v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))).float()


def make_inputs(gen, sparse):
    params = [torch.randn(s, generator=gen) for group in SHAPES for s in group]
    if sparse:  # group 0: one [6, 3] param with sparse grads; group 1: [4]
        params = [torch.randn(6, 3, generator=gen), torch.randn(4, generator=gen)]
    grads = []  # [step][p]: a dense tensor, (indices, values), or None
    for step in range(STEPS):
        row = []
        for p, param in enumerate(params):
            if sparse:
                if p == 0:
                    # nnz 0 would make 1.13 fail (its sparse_mask of a hybrid tensor).
                    nnz = int(torch.randint(1, 6, (), generator=gen))
                    indices = torch.randint(0, 6, (1, nnz), generator=gen)
                    row.append((indices, torch.randn(nnz, 3, generator=gen)))
                else:
                    row.append(torch.randn(param.shape, generator=gen))
            else:
                row.append(torch.randn(param.shape, generator=gen) if has_grad(p, step) else None)
        grads.append(row)
    return params, grads


def run_config(kind, name, hypers, changes, seed, out):
    prefix = "%s/%s/" % (kind, name)
    sparse = name == "sparse"
    gen = torch.Generator().manual_seed(seed)
    init, grads = make_inputs(gen, sparse)
    group_sizes = [1, 1] if sparse else [len(g) for g in SHAPES]
    params = [t.clone().requires_grad_(True) for t in init]
    groups, first = [], 0
    for size in group_sizes:
        groups.append(params[first:first + size])
        first += size

    # The hypers rannc sees, and those torch.optim gets (without the emulated ones).
    ours = [dict(h) for h in hypers]
    emulate = kind in ("nadam", "radam")

    def torch_group(h):
        h = dict(h)
        if emulate:
            h.pop("maximize", None)
            if h.pop("decoupled_weight_decay", False):
                h["weight_decay"] = 0
        return h

    cls = CLASSES[kind]
    kwargs = {}
    if kind == "adagrad":
        kwargs["initial_accumulator_value"] = hypers[0].get("initial_accumulator_value", 0)
    opt = cls([dict(params=g, **torch_group(h)) for g, h in zip(groups, hypers)], **kwargs)
    if kind == "adagrad":
        for g, group in zip(groups, opt.param_groups):
            for p in g:
                opt.state[p]["sum"].fill_(group["initial_accumulator_value"])

    hyper_rows = [[] for _ in groups]
    params_after = [[] for _ in params]
    states_after = []
    for step in range(STEPS):
        if step == CHANGE_AT:
            for g, change in changes.items():
                ours[g].update(change)
                for k, v in torch_group(ours[g]).items():
                    opt.param_groups[g][k] = v
        for g, group in enumerate(opt.param_groups):
            row = {k: v for k, v in group.items() if k not in NOT_HYPERS}
            if emulate:
                row.update(maximize=ours[g].get("maximize", False),
                           decoupled_weight_decay=ours[g].get("decoupled_weight_decay", False),
                           weight_decay=ours[g].get("weight_decay", 0))
            hyper_rows[g].append(row)
        for p, param in enumerate(params):
            grad = grads[step][p]
            g = 0 if p < group_sizes[0] else 1
            if isinstance(grad, tuple):
                grad = torch.sparse_coo_tensor(grad[0], grad[1], param.shape)
            if grad is not None and emulate and ours[g].get("maximize", False):
                grad = -grad
            param.grad = None if grad is None else grad.clone()
        if emulate:
            with torch.no_grad():
                for g, h in enumerate(ours):
                    if h.get("decoupled_weight_decay", False) and h.get("weight_decay", 0) != 0:
                        for param in groups[g]:
                            if param.grad is not None:
                                param.mul_(1 - h["lr"] * h["weight_decay"])
        opt.step()
        for p, param in enumerate(params):
            params_after[p].append(param.detach().clone())
        states_after.append({p: {k: state_value(v) for k, v in s.items()}
                             for p, s in opt.state_dict()["state"].items()})

    out[prefix + "group_sizes"] = torch.tensor(group_sizes)
    for g, rows in enumerate(hyper_rows):
        for field in rows[0]:
            out[prefix + "hyper/%d/%s" % (g, field)] = torch.stack(
                [hyper_value(r[field]) for r in rows])
    for p, param in enumerate(init):
        out[prefix + "init/%d" % p] = param
        out[prefix + "param/%d" % p] = torch.stack(params_after[p])
        mask = [grads[s][p] is not None for s in range(STEPS)]
        out[prefix + "has_grad/%d" % p] = torch.tensor(mask, dtype=torch.int64)
        if isinstance(grads[0][p], tuple):
            for s in range(STEPS):
                out[prefix + "grad_indices/%d/%d" % (s, p)] = grads[s][p][0]
                out[prefix + "grad_values/%d/%d" % (s, p)] = grads[s][p][1]
        else:
            out[prefix + "grad/%d" % p] = torch.stack(
                [g if g is not None else torch.zeros_like(param) for g in
                 (grads[s][p] for s in range(STEPS))])
        steps_with_state = [s for s in range(STEPS) if p in states_after[s]]
        first = steps_with_state[0] if steps_with_state else STEPS
        out[prefix + "first/%d" % p] = torch.tensor(first)
        if steps_with_state:
            for key, value in states_after[first][p].items():
                rows = [states_after[s][p][key] if s >= first else torch.zeros_like(value)
                        for s in range(STEPS)]
                out[prefix + "state/%d/%s" % (p, key)] = torch.stack(rows)


def packed(tensors):
    """The same tensors as views of one storage per dtype: the zip then holds three storages
    instead of one per tensor (half the file)."""
    out = {}
    for dtype in {t.dtype for t in tensors.values()}:
        names = sorted(k for k, t in tensors.items() if t.dtype == dtype)
        flat = torch.cat([tensors[k].reshape(-1) for k in names])
        offset = 0
        for k in names:
            n = tensors[k].numel()
            out[k] = flat[offset:offset + n].view(tensors[k].shape)
            offset += n
    return dict(sorted(out.items()))


def main():
    out = {"steps": torch.tensor(STEPS)}
    for kind, cls in CLASSES.items():
        defaults = cls([torch.zeros(1, requires_grad=True)]).defaults
        for field, value in defaults.items():
            if field not in NOT_HYPERS:
                out["defaults/%s/%s" % (kind, field)] = hyper_value(value)
    seed = 1000
    for kind, configs in CONFIGS.items():
        for name, (hypers, changes) in configs.items():
            seed += 1
            run_config(kind, name, hypers, changes, seed, out)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(packed(out), OUT, _use_new_zipfile_serialization=True)
    print("wrote %s: %d tensors, %d bytes" % (OUT, len(out), os.path.getsize(OUT)))


if __name__ == "__main__":
    main()
