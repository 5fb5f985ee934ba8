"""RaNNCModule's memory switches (the memory and precision issue) against PyTorch on four
devices, with forced plans that have replicas.

Needs a daemon with exactly four devices, as test_pipeline_conformance does: RANNC_DEVICES=cpu:4
(set by the Bazel target) or e.g. cuda:0,1,2,3; with any other number every test fails at setup
saying so. The PyTorch reference runs on RANNC_TEST_REF_DEVICE (see conftest): model,
optimizer(s) and batches there, its values compared on the CPU.

enable_zero=True: gradients and optimizer state sharded over each stage's replicas;
offload_params=True: parameters, gradients between steps and optimizer state in host memory;
and both; and offload streamed block by block on stages without replicas. The runtime issue's four conformance models (test_pipeline_conformance.MODELS: SGD
with momentum or Adam) must train exactly as PyTorch does (conftest.assert_close: rtol 1e-5,
atol 1e-6): losses and every gradient after each backward, clip_grad_norm, an undeploy with the
(sharded) optimizer state parked on the host in between, and the state after the last step. The
devices must hold the sharded share of gradients and optimizer state, or nothing between steps
when offloaded.

enable_apex_amp=True (bf16, the default amp_dtype; and fp16 with dynamic loss scaling on a daemon
with CUDA devices), at amp_level O1 (autocast) and O2 (the whole forward in the low precision):
against PyTorch's autocast, or the model reading bf16/fp16 casts of its parameters, on the
reference's device, with the tolerance stated above test_amp_trains_like_pytorch.
"""

import contextlib

import pytest
import torch

import pyrannc
from pyrannc import _daemon
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from conftest import REF_DEVICE, assert_close, daemon_device_names, ref_copy, to_cpu, to_ref
import test_pipeline_conformance as tpc

pytestmark = pytest.mark.usefixtures("pyrannc_daemon", "four_devices")

# (partition_num, pipeline_num, replica_num): one stage on all four devices, and 2 stages x 2
# micro-batches x 2 replicas.
PLANS = {"1x1x4": (1, 1, 4), "2x2x2": (2, 2, 2)}
# RaNNCModule's switches per mode.
MODES = {"zero": {"enable_zero": True}, "offload": {"offload_params": True},
         "zero+offload": {"enable_zero": True, "offload_params": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(tpc.MODELS))
def test_memory_modes_train_like_pytorch(model_name, plan_name, mode, monkeypatch):
    _train_like_pytorch(model_name, PLANS[plan_name], MODES[mode], monkeypatch)


# Offload's streaming: a stage of one replica runs as blocks whose parameters are on the device
# only while the block computes, and whose gradients go to the host as its backward ends (config
# key offload_block_bytes; 1 byte: every atomic node that reads a parameter starts a block).
# One stage over two micro-batches, and two stages (the first holding two micro-batches in
# flight under 1F1B). With offload_keep_on_device (the default) the planner keeps what the
# devices have room for on them: these small models whole (a part kept and the rest streamed is
# pipeline_engine_offload_test's); without it, every parameter streams.
STREAMED_PLANS = {"1x2x1": (1, 2, 1), "2x2x1": (2, 2, 1)}


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("plan_name", list(STREAMED_PLANS))
@pytest.mark.parametrize("model_name", list(tpc.MODELS))
def test_streamed_offload_trains_like_pytorch(model_name, plan_name, keep, monkeypatch):
    monkeypatch.setenv("RANNC_OFFLOAD_BLOCK_BYTES", "1")
    monkeypatch.setenv("RANNC_OFFLOAD_KEEP_ON_DEVICE", str(keep).lower())
    rmod_stages = _train_like_pytorch(model_name, STREAMED_PLANS[plan_name],
                                      MODES["offload"], monkeypatch)
    blocks = [s.offload_blocks for s in rmod_stages]
    assert max(blocks) > 1, blocks
    kept = [s.kept_on_device_bytes for s in rmod_stages]
    assert any(kept) == keep, kept


def _train_like_pytorch(model_name, plan, switches, monkeypatch):
    """Trains tpc.MODELS[model_name] with `plan` (partition_num, pipeline_num, replica_num) and
    RaNNCModule's `switches` beside PyTorch, comparing as the module doc says; returns the
    deployment's stages."""
    case = tpc.MODELS[model_name]
    tpc._set_plan_config(monkeypatch, plan, "1f1b")
    torch.manual_seed(0)
    model = case.make()
    ref = ref_copy(model)
    opt, ref_opt = case.optimizer(model), case.optimizer(ref)
    rmod = pyrannc.RaNNCModule(model, opt, **switches)
    try:
        for step in range(tpc.STEPS):
            batch = case.batch(step)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, to_ref(batch))
            ref_loss.backward()
            if step == 0:
                assert rmod.deployment.zero == switches.get("enable_zero", False)
                assert rmod.deployment.offload == switches.get("offload_params", False)
                replicas = [len(s.devices) for s in rmod.deployment.stages]
                assert replicas == [plan[2]] * plan[0], replicas
                stages = list(rmod.deployment.stages)
            assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
            if step == 1:
                norm = rmod.clip_grad_norm(0.5)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                assert_close(norm, ref_norm, "clip_grad_norm's total norm")
            tpc._compare_grads(rmod, ref, step)
            if step == 2:
                rmod.undeploy()  # the shards' optimizer state goes to the host and comes back
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for name, value in ref.state_dict().items():
            assert_close(rmod.state_dict()[name], value, f"{name} after {tpc.STEPS} steps")
    finally:
        pyrannc.clear()
    return stages


def _job_summary(job_id):
    jobs = _daemon.connection().call("ListJobs", pb.Empty()).jobs
    return next(j for j in jobs if j.job_id == job_id)


@pytest.mark.parametrize("mode", ["plain"] + list(MODES))
def test_devices_hold_a_replicas_share(mode, monkeypatch):
    # Adam over 4 replicas of one stage: each device holds the parameters (P bytes), the
    # gradients (P), two moments (2P) and a gradient bucket buffer (P) whole, or a quarter of the
    # gradients and moments with ZeRO (plus padding of fewer than 4 elements per tensor group;
    # nothing left for the bucket). Offloaded, nothing stays between steps (this model has no
    # buffers), and a step held the parameters and more.
    tpc._set_plan_config(monkeypatch, (1, 1, 4), "1f1b")
    monkeypatch.setenv("RANNC_DEFER_OPS", "0")  # backward and step run before ListJobs
    torch.manual_seed(0)
    model = tpc.DeepMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rmod = pyrannc.RaNNCModule(model, opt, **MODES.get(mode, {}))
    try:
        x, y = tpc._classification_batch(0, 8, 4)
        rmod(x, y).backward()
        opt.step()
        p = sum(t.numel() * t.element_size() for t in model.parameters())
        expected = {"plain": p * 5, "zero": p * (1 + 3 / 4)}.get(mode, 0)
        summary = _job_summary(rmod._job.id)
        got = list(summary.device_bytes)
        assert len(got) == tpc.NUM_DEVICES
        for b in got:
            assert abs(b - expected) <= 0.02 * expected, (got, expected)
        if mode.endswith("offload"):
            for peak in summary.peak_device_bytes:
                assert peak > p, (list(summary.peak_device_bytes), p)
    finally:
        pyrannc.clear()


class _WideMLP(torch.nn.Module):
    """Two layers: the first's weight (2 MiB) goes to the daemon beside the archive, through
    shared memory; the second's tensors (under pyrannc._shm.MIN_BYTES) inside it."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(512, 1024)
        self.out = torch.nn.Linear(1024, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.out(torch.relu(self.wide(x))), y)


def _holds_memory(t):
    return t.numel() > 0


@pytest.mark.parametrize("keep", [False, True])
def test_offload_frees_the_local_model_until_it_is_read(keep, monkeypatch):
    # With offload_params the client's copy of the tensors it sent apart is freed once the job
    # holds them (one host copy of the model); a read of the local model (a trace in another
    # mode, named_parameters) fetches it back, into the same tensor objects (the optimizer's
    # and the caller's references), with the daemon's values. keep_local_model=true keeps the
    # copy.
    tpc._set_plan_config(monkeypatch, (1, 1, 4), "1f1b")
    monkeypatch.setenv("RANNC_KEEP_LOCAL_MODEL", "1" if keep else "0")
    torch.manual_seed(0)
    model = _WideMLP()
    ref = ref_copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wide = model.wide.weight
    rmod = pyrannc.RaNNCModule(model, opt, offload_params=True)
    try:
        for step in range(3):
            x, y = tpc._classification_batch(step, 512, 4)
            loss = rmod(x, y)
            ref_loss = ref(*to_ref((x, y)))
            assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if step == 0:
                assert _holds_memory(wide) == keep
                assert _holds_memory(model.out.weight)  # sent inside the archive: kept
                if not keep:
                    with pytest.raises(RuntimeError):
                        model.wide(x)  # fails on the freed weight's shape
                # Another mode traces the model again, which needs its values back first.
                rmod.eval()
                ref.eval()
                with torch.no_grad():
                    assert_close(rmod(x, y), ref(*to_ref((x, y))), "eval loss after step 0")
                rmod.train()
                ref.train()
            if step == 1:
                params = dict(rmod.named_parameters())
                assert params["wide.weight"] is wide
                assert wide.shape == (1024, 512)
                assert_close(wide.detach(), ref.wide.weight, f"wide.weight after step {step}")
        state = rmod.state_dict()
        for name, value in ref.state_dict().items():
            assert_close(state[name], value, f"{name} after 3 steps")
    finally:
        pyrannc.clear()


def test_offload_gives_the_local_model_back_when_the_job_is_refused(monkeypatch):
    # The local copy is freed before CreateJob (the daemon's copies would meet it there); a job
    # the daemon refuses puts it back from shared memory, into the same tensor objects, and a
    # later forward creates the job from it.
    tpc._set_plan_config(monkeypatch, (1, 1, 4), "1f1b")
    monkeypatch.setenv("RANNC_KEEP_LOCAL_MODEL", "0")
    monkeypatch.setenv("RANNC_JOB_LEASE", "0.2")  # under a second: refused in CreateJob
    torch.manual_seed(0)
    model = _WideMLP()
    ref = ref_copy(model)
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    wide = model.wide.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rmod = pyrannc.RaNNCModule(model, opt, offload_params=True)
    try:
        x, y = tpc._classification_batch(0, 512, 4)
        with pytest.raises(pyrannc.RanncError) as err:
            rmod(x, y)
        assert "lease_ms=200" in str(err.value)
        assert model.wide.weight is wide and _holds_memory(wide)
        for name, t in model.state_dict().items():
            assert torch.equal(t, before[name]), name
        monkeypatch.delenv("RANNC_JOB_LEASE")
        loss = rmod(x, y)
        ref_loss = ref(*to_ref((x, y)))
        assert_close(loss.detach(), ref_loss.detach(), "loss after the refused job")
        assert not _holds_memory(wide)  # freed again, for the job now created
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        state = rmod.state_dict()
        for name, value in ref.state_dict().items():
            assert_close(state[name], value, f"{name} after a step")
    finally:
        pyrannc.clear()


# Mixed precision. The reference is PyTorch's torch.autocast(<its device type>, dtype) ("cpu", or
# "cuda" with RANNC_TEST_REF_DEVICE=cuda) around the model's forward, run on the same shards of
# the batch as the plan's devices run (each micro-batch split over the replicas, as DDP with
# autocast would): low-precision products round differently over a whole batch than over its
# shards, by as much as they differ from fp32, so an unsharded reference could not tell a correct
# run from a wrong one. A loss the client computes from the returned logits is computed outside
# autocast and on the CPU, as the client does. Each shard's forward is an autocast region of its own, as each
# device's is (within one region the cast of a weight is cached, and its gradient would be summed
# over the shards in low precision). fp16 adds GradScaler's loss scaling: each shard's loss, in
# fp32, times the scale (FP16_SCALE, which never overflows here) is backpropagated and the
# gradients are multiplied by its inverse, exactly (powers of two).
# amp_level=O2's reference is the same with the parameters read through casts (and floating
# inputs cast) instead of autocast: _whole_forward_in.
# The stated tolerance: on one device the same ops run, and everything must be bitwise equal.
# With a split batch only the order of fp32 sums differs, but one step's fp32-sized difference
# can move a later activation across a rounding boundary of the low precision: the loss within
# rtol 1e-4 / atol 1e-5 each step (AMP_TOLERANCE at O2, whose loss is low precision itself), every
# gradient and parameter within AMP_TOLERANCE of the reference's as a whole tensor, in norm
# (|ours - ref| <= rtol |ref| + atol sqrt(n): about a bf16 ulp, 2^-8 relative, or four fp16 ulps,
# 2^-11 each; not elementwise: an element summed from larger terms that cancel, such as a
# LayerNorm weight's gradient over the tokens, carries their rounding, not its own; twice that at
# O2, see _amp_tolerance), and the parameters on average far closer to the reference than full-precision training is (so the test
# fails if ranncd ran in fp32).
#
# CUDA_KERNELS_DIFFER: on a daemon with CUDA devices, the daemon's attention (batched GEMMs,
# masked softmax) differs from the same ops run eagerly in the test's process by up to a bf16 ulp
# even on one device, while its linear layers, LayerNorm, MLP and loss are bitwise equal, and the
# traced module run in the test's process (on either stream, on another thread) is bitwise equal
# to eager: the kernels cuBLAS picks in the daemon's process are not always the test's. There,
# every plan is held to the split-batch bounds (the loss too within AMP_TOLERANCE), and the
# parameters must be at least twice as close to the reference as full precision is (bf16
# differences compound over the steps on CUDA; fp32 training is still told apart).
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AMP_TOLERANCE = {"bf16": (1e-2, 1e-4), "fp16": (2e-3, 1e-5)}  # rtol, atol
# The fp16 runs' loss scale (RANNC_LOSS_SCALE_INIT): the default, 65536, is past an fp16 loss's
# range at O2, whose first step then overflows and is skipped, as with Apex.
FP16_SCALE = 1024.0


def _amp_tolerance(amp_dtype, amp_level):
    """AMP_TOLERANCE, doubled at O2, whose backward also sums in the low precision (a LayerNorm
    weight's gradient over every token): measured on one H200, such a gradient of gpt_tied
    came 1.2 x a bf16 ulp of its norm from the reference."""
    rtol, atol = AMP_TOLERANCE[amp_dtype]
    return (2 * rtol, atol) if amp_level == "O2" else (rtol, atol)


def _assert_amp_close(actual, expected, what, exact, tolerance):
    expected = to_cpu(expected)
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bitwise equal on one device"
    else:
        rtol, atol = tolerance
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
        error = float((actual.double() - expected.double()).norm())
        bound = rtol * float(expected.double().norm()) + atol * expected.numel() ** 0.5
        assert error <= bound, f"{what}: |ours - reference| = {error:.3g} > {bound:.3g}"


def _relative_differences(ours, theirs):
    ours, theirs = to_cpu(ours), to_cpu(theirs)  # the fp32 run's are on the reference's device
    return [float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(ours, theirs)]


def _shards(plan, batch):
    """(offset, count) of each device's share of the batch, in order."""
    _, micro_batches, replicas = plan
    out = []
    for m in range(micro_batches):
        start, size = m * batch // micro_batches, batch // micro_batches
        out += [(start + r * size // replicas, size // replicas) for r in range(replicas)]
    return out


@contextlib.contextmanager
def _whole_forward_in(model, dtype):
    """amp_level=O2's reference: while inside, the model reads each floating parameter through
    one differentiable cast to `dtype` (tied weights share theirs), as FSDP2's bf16 parameters
    and Apex's O2 do, and gradients reach the fp32 parameters through the casts."""
    saved, casts = [], {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in casts:
                casts[id(p)] = p.to(dtype)
            saved.append((module, name, p))
            module._parameters[name] = casts[id(p)]
    try:
        yield
    finally:
        for module, name, p in saved:
            module._parameters[name] = p


def _low_precision(level, model, dtype):
    """The region one shard's forward runs in: autocast at O1, cast parameters at O2."""
    if level == "O1":
        return torch.autocast(REF_DEVICE.type, dtype=dtype)
    return _whole_forward_in(model, dtype)


def _reference_loss(case, model, batch, shards, dtype, scale, level):
    """The loss of `model` on `batch` computed shard by shard in `dtype` at amp_level `level`
    (O2 also casts floating inputs, as the daemon's graph does on entry), its gradients (the loss
    times `scale`, backpropagated, then times 1 / scale) in the .grads."""
    n = len(batch[0])
    if level == "O2":
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    if case.loss is tpc._client_loss:
        logits = []
        for o, c in shards:
            with _low_precision(level, model, dtype):
                logits.append(model(batch[0][o:o + c]))
        # On the CPU, where the client computes it from the returned logits.
        loss = torch.nn.functional.cross_entropy(torch.cat(logits).cpu(), batch[1].cpu())
        (loss.float() * scale).backward()  # as GradScaler and Apex: in fp32
        total = loss
    else:
        total = 0
        for o, c in shards:
            with _low_precision(level, model, dtype):
                part = case.loss(model, tuple(t[o:o + c] for t in batch)) * (c / n)
            (part.float() * scale).backward()
            total = total + part.detach()
    if scale != 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)
    return total


def _cuda_daemon():
    return daemon_device_names()[0].startswith("cuda")


@pytest.mark.parametrize("amp_level", ["O1", "O2"])
@pytest.mark.parametrize("amp_dtype", list(AMP_DTYPES))
@pytest.mark.parametrize("plan_name", ["1x1x1", "1x1x4", "2x2x2"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt_tied", "client_loss"])
def test_amp_trains_like_pytorch(model_name, plan_name, amp_dtype, amp_level, monkeypatch):
    plan = dict(PLANS, **{"1x1x1": (1, 1, 1)})[plan_name]
    # On CUDA devices even one device is not bitwise: see CUDA_KERNELS_DIFFER above.
    exact = plan == (1, 1, 1) and not _cuda_daemon()
    case = tpc.MODELS[model_name]
    tpc._set_plan_config(monkeypatch, plan, "1f1b")
    monkeypatch.setenv("RANNC_AMP_DTYPE", amp_dtype)
    monkeypatch.setenv("RANNC_AMP_LEVEL", amp_level)
    monkeypatch.setenv("RANNC_LOSS_SCALE_INIT", str(FP16_SCALE))
    torch.manual_seed(0)
    model = case.make()
    ref, fp32 = ref_copy(model), ref_copy(model)
    # SGD for every model: Adam turns the fp32 round-off of differently ordered sums into
    # lr-sized steps for gradients near 0 (see test_pipeline_conformance's gpt_tied).
    opt, ref_opt, fp32_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                              for m in (model, ref, fp32))
    # The reference sums the shards' gradients in fp32: so do the replicas (RaNNC's default,
    # False, all-reduces them in amp_dtype at O2: test_allreduce_amp_master_params).
    rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True,
                               allreduce_amp_master_params=True)
    names = [n for n, _ in ref.named_parameters()]
    try:
        if amp_dtype == "fp16" and not _cuda_daemon():
            # CPU devices have no fp16 autocast: the job is refused, saying what to use.
            with pytest.raises(pyrannc.RanncError, match="amp_dtype=fp16 needs CUDA devices"):
                case.loss(rmod, case.batch(0))
            return
        scale = FP16_SCALE if amp_dtype == "fp16" else 1.0
        for step in range(tpc.STEPS):
            batch = case.batch(step)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_batch = to_ref(batch)
            ref_loss = _reference_loss(case, ref, ref_batch, _shards(plan, len(batch[0])),
                                       AMP_DTYPES[amp_dtype], scale, amp_level)
            case.loss(fp32, ref_batch).backward()
            assert loss.dtype == ref_loss.dtype
            # An O2 loss is itself in the low precision: a shard's rounding moves it by an ulp.
            tolerance = _amp_tolerance(amp_dtype, amp_level)
            rtol, atol = (0, 0) if exact else (1e-4, 1e-5) if amp_level == "O1" and \
                not _cuda_daemon() else tolerance
            assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}",
                         rtol=rtol, atol=atol)
            for name, p in zip(names, ref.parameters()):
                _assert_amp_close(rmod.get_param_grad(name, amp_master_param=True), p.grad,
                                  f"gradient of {name} at step {step}", exact, tolerance)

            for opt_ in (opt, ref_opt, fp32_opt):
                opt_.step()
                opt_.zero_grad()
        ours = [rmod.get_param(n, amp_master_param=True) for n in names]
        assert all(p.dtype == torch.float32 for p in ours)  # the masters
        theirs = [p.detach() for p in ref.parameters()]
        ours_vs_ref = _relative_differences(ours, theirs)
        fp32_vs_ref = _relative_differences([p.detach() for p in fp32.parameters()], theirs)
        print(f"{model_name} {plan_name} {amp_dtype} {amp_level}: parameters vs the reference's, "
              f"mean relative difference: ranncd {sum(ours_vs_ref) / len(names):.1e}, "
              f"fp32 training {sum(fp32_vs_ref) / len(names):.1e}")
        for name, p, q in zip(names, ours, theirs):
            _assert_amp_close(p, q, f"{name} after {tpc.STEPS} steps", exact,
                              _amp_tolerance(amp_dtype, amp_level))
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        closer = 2 if _cuda_daemon() else 10
        assert mean(ours_vs_ref) < mean(fp32_vs_ref) / closer, (ours_vs_ref, fp32_vs_ref)
        if amp_dtype == "fp16":
            summary = _job_summary(rmod._job.id)
            assert (summary.loss_scale, summary.skipped_steps) == (FP16_SCALE, 0)
    finally:
        pyrannc.clear()


def _train(case, rmod, opt):
    """tpc.STEPS steps of `case` through `rmod`: the losses."""
    losses = []
    for step in range(tpc.STEPS):
        loss = case.loss(rmod, case.batch(step))
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("model_name", ["mlp", "client_loss"])
def test_o2_offload_streams_bf16_with_the_same_results(model_name, monkeypatch):
    # offload_low_precision: at O2, streamed parameters cross to the device as bf16 copies the
    # host casts, and their gradients come back in bf16, widened on the host. The device casts
    # what the host casts and the cast's backward only widens, so the job trains as without
    # offload, to the bit on CPU devices (one device: the same kernels; a GPU steps the masters
    # on the host, the plain job on the device: fp32 round-off), holding less on the device at
    # its peak than streaming the fp32 masters.
    case = tpc.MODELS[model_name]
    tpc._set_plan_config(monkeypatch, (1, 1, 1), "1f1b")
    monkeypatch.setenv("RANNC_AMP_LEVEL", "O2")
    monkeypatch.setenv("RANNC_OFFLOAD_BLOCK_BYTES", "1")
    monkeypatch.setenv("RANNC_OFFLOAD_KEEP_ON_DEVICE", "false")  # every parameter streamed
    runs = {}
    for run, offload, low in (("plain", False, False), ("fp32 streamed", True, False),
                              ("bf16 streamed", True, True)):
        monkeypatch.setenv("RANNC_OFFLOAD_LOW_PRECISION", str(low).lower())
        torch.manual_seed(0)
        model = case.make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True, offload_params=offload)
        try:
            losses = _train(case, rmod, opt)
            if offload:
                assert max(s.offload_blocks for s in rmod.deployment.stages) > 1
            peak = max(_job_summary(rmod._job.id).peak_device_bytes)
            runs[run] = (losses, {k: v.clone() for k, v in rmod.state_dict().items()}, peak)
        finally:
            pyrannc.clear()
    tol = {"rtol": 1e-5, "atol": 1e-6} if _cuda_daemon() else {"rtol": 0, "atol": 0}
    want_losses, want_state, _ = runs["plain"]
    for run in ("fp32 streamed", "bf16 streamed"):
        losses, state, _ = runs[run]
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert_close(got, want, f"{run}: loss at step {step}", **tol)
        for name, want in want_state.items():
            assert_close(state[name], want, f"{run}: {name} after {tpc.STEPS} steps", **tol)
    assert runs["bf16 streamed"][2] < runs["fp32 streamed"][2], \
        {run: peak for run, (_, _, peak) in runs.items()}


@pytest.mark.parametrize("plan", [(1, 1, 1), (2, 2, 2)])
def test_o2_casts_in_groups_train_as_the_graph_s_casts(plan, monkeypatch):
    # amp_cast_group_bytes: at O2 a stage casts its parameters before its ops run, a group at a
    # time, and widens their gradients back a group at a time (docs/runtime.md, "Grouped
    # casts"). The values are the graph's own casts', summed into the same fp32 leaves in the
    # same order: the same losses and parameters, whole or split over stages, replicas and
    # micro-batches, with a group a parameter or one group.
    case = tpc.MODELS["gpt_tied"]
    tpc._set_plan_config(monkeypatch, plan, "1f1b")
    monkeypatch.setenv("RANNC_AMP_LEVEL", "O2")
    runs = {}
    for group in ("0", "1", "1GiB"):
        monkeypatch.setenv("RANNC_AMP_CAST_GROUP_BYTES", group)
        torch.manual_seed(0)
        model = case.make()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True)
        try:
            losses = _train(case, rmod, opt)
            runs[group] = (losses, {k: v.clone() for k, v in rmod.state_dict().items()})
        finally:
            pyrannc.clear()
    # (Bitwise on CPU devices; a GPU's copies run other kernels, not yet compared there.)
    tol = {"rtol": 1e-5, "atol": 1e-6} if _cuda_daemon() else {"rtol": 0, "atol": 0}
    want_losses, want_state = runs["0"]
    for group in ("1", "1GiB"):
        losses, state = runs[group]
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert_close(got, want, f"groups of {group}: loss at step {step}", **tol)
        for name, want in want_state.items():
            assert_close(state[name], want, f"groups of {group}: {name}", **tol)


@pytest.mark.parametrize("master", [True, False])
def test_allreduce_amp_master_params(master, monkeypatch):
    # O2 over four replicas: with allreduce_amp_master_params=False (RaNNC's default) the
    # replicas all-reduce the gradients in bf16 (half the bytes), so every reduced gradient is a
    # bf16 value; with True they all-reduce the fp32 masters' gradients, which mostly are not.
    # Both are within bf16's precision of the fp32 reduction.
    tpc._set_plan_config(monkeypatch, (1, 1, 4), "1f1b")
    monkeypatch.setenv("RANNC_AMP_LEVEL", "O2")
    case = tpc.MODELS["mlp"]
    grads = {}
    for flag in (True, master):
        torch.manual_seed(0)
        model = case.make()
        rmod = pyrannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   enable_apex_amp=True, allreduce_amp_master_params=flag)
        try:
            case.loss(rmod, case.batch(0)).backward()
            grads[flag] = {n: rmod.get_param_grad(n, amp_master_param=True)
                           for n, _ in model.named_parameters()}
        finally:
            pyrannc.clear()
    bf16_values = [torch.equal(g, g.to(torch.bfloat16).float()) for g in grads[master].values()]
    if master:
        assert not all(bf16_values), "fp32 sums of bf16 gradients are not all bf16 values"
    else:
        assert all(bf16_values), "a gradient the replicas all-reduced in bf16 is not a bf16 value"
    for name, g in grads[master].items():
        assert_close(g, grads[True][name], f"gradient of {name}", rtol=2e-2, atol=1e-3)


def test_unknown_amp_level_is_refused(monkeypatch):
    tpc._set_plan_config(monkeypatch, (1, 1, 1), "1f1b")
    monkeypatch.setenv("RANNC_AMP_LEVEL", "O3")
    case = tpc.MODELS["mlp"]
    rmod = pyrannc.RaNNCModule(case.make(), enable_apex_amp=True)
    try:
        with pytest.raises(pyrannc.RanncError, match="amp_level=O3: expected O1 .* or O2"):
            case.loss(rmod, case.batch(0))
    finally:
        pyrannc.clear()


def _dynamic_scaling_case(case, plan, monkeypatch):
    """Dynamic loss scaling from 1024, doubled after 2 good steps, on `plan`; the model, its
    PyTorch reference and their optimizers."""
    tpc._set_plan_config(monkeypatch, plan, "1f1b")
    monkeypatch.setenv("RANNC_LOSS_SCALE", "dynamic")
    monkeypatch.setenv("RANNC_LOSS_SCALE_INIT", "1024")
    monkeypatch.setenv("RANNC_LOSS_SCALE_WINDOW", "2")
    monkeypatch.setenv("RANNC_DEFER_OPS", "0")  # step runs before ListJobs
    torch.manual_seed(0)
    model = case.make()
    ref = ref_copy(model)
    return model, ref, case.optimizer(model), case.optimizer(ref)


# Dynamic loss scaling, what fp16 mixed precision uses (config loss_scale=dynamic turns it on for
# any job; fp16 itself needs CUDA devices). The reference is GradScaler's algorithm written out
# in fp32: the loss times the scale backpropagated, the gradients times 1/scale, a step with a
# non-finite gradient skipped, the scale halved on overflow and doubled after a window of good
# steps. With power-of-two scales the scaling is exact: everything must equal the reference at
# fp32 round-off (assert_close), and the scale (ListJobs) must follow it.
@pytest.mark.parametrize("model_name", ["mlp", "client_loss"])
def test_dynamic_loss_scaling_skips_overflowing_steps_like_grad_scaler(model_name, monkeypatch):
    case = tpc.MODELS[model_name]
    model, ref, opt, ref_opt = _dynamic_scaling_case(case, (2, 2, 2), monkeypatch)
    rmod = pyrannc.RaNNCModule(model, opt)
    scale, good_steps, skipped = 1024.0, 0, 0
    try:
        for step in range(5):
            batch = case.batch(step)
            if step == 2:  # inputs that make the forward overflow
                batch = tuple(t * float("inf") if t.is_floating_point() else t for t in batch)
            loss = case.loss(rmod, batch)
            loss.backward()
            ref_loss = case.loss(ref, to_ref(batch))
            (ref_loss * scale).backward()
            grads = [p.grad for p in ref.parameters() if p.grad is not None]
            for g in grads:
                g.mul_(1.0 / scale)
            found_inf = any(not bool(torch.isfinite(g).all()) for g in grads)
            assert found_inf == (step == 2)
            if not found_inf:
                assert_close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
                tpc._compare_grads(rmod, ref, step)
                ref_opt.step()
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if found_inf:
                scale, good_steps, skipped = scale * 0.5, 0, skipped + 1
            else:
                good_steps += 1
                if good_steps == 2:
                    scale, good_steps = scale * 2, 0
            summary = _job_summary(rmod._job.id)
            assert summary.loss_scale == scale, f"step {step}"
            assert summary.skipped_steps == skipped, f"step {step}"
            for name, value in ref.state_dict().items():
                assert_close(rmod.state_dict()[name], value, f"{name} after step {step}")
    finally:
        pyrannc.clear()


def test_fp16_dynamic_loss_scaling_matches_autocast_and_grad_scaler(monkeypatch):
    # fp16 at O1 with dynamic loss scaling against PyTorch's recipe on the GPU:
    # torch.autocast("cuda", float16) and a GradScaler of the same schedule (scale 1024, halved
    # on overflow and the step skipped, doubled after 2 good steps). The loss each step, the
    # scale and the skipped steps after each, and the parameters (fp16's tolerance) must agree.
    case = tpc.MODELS["mlp"]
    monkeypatch.setenv("RANNC_AMP_DTYPE", "fp16")
    model, ref, opt, ref_opt = _dynamic_scaling_case(case, (1, 1, 1), monkeypatch)
    rmod = pyrannc.RaNNCModule(model, opt, enable_apex_amp=True)
    try:
        if not _cuda_daemon():
            with pytest.raises(pyrannc.RanncError, match="amp_dtype=fp16 needs CUDA devices"):
                case.loss(rmod, case.batch(0))
            return
        assert REF_DEVICE.type == "cuda", "the reference runs PyTorch's CUDA autocast"
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_factor=2.0,
                                      backoff_factor=0.5, growth_interval=2)
        tolerance = _amp_tolerance("fp16", "O1")
        skipped = 0
        for step in range(6):
            batch = case.batch(step)
            if step == 2:  # inputs that make the forward overflow
                batch = tuple(t * float("inf") if t.is_floating_point() else t for t in batch)
            loss = case.loss(rmod, batch)
            loss.backward()
            with torch.autocast("cuda", dtype=torch.float16):
                ref_loss = case.loss(ref, to_ref(batch))
            scaler.scale(ref_loss).backward()
            before = scaler.get_scale()
            scaler.step(ref_opt)
            scaler.update()
            if scaler.get_scale() < before:
                skipped += 1
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if step != 2:
                assert_close(loss.detach().float(), ref_loss.detach().float(),
                             f"loss at step {step}", *tolerance)
            summary = _job_summary(rmod._job.id)
            assert summary.loss_scale == scaler.get_scale(), f"scale after step {step}"
            assert summary.skipped_steps == skipped, f"skipped steps after step {step}"
        assert skipped == 1
        for name, value in ref.state_dict().items():
            _assert_amp_close(rmod.state_dict()[name], value, f"{name} after 6 steps", False,
                              tolerance)
    finally:
        pyrannc.clear()
