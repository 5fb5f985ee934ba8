"""Deployment files without a daemon: reading, writing, checking and printing them
(pyrannc._deployment and pyrannc.show_deployment, which prints through the rannc CLI), on
Deployment protos built by hand."""

import re
import subprocess

import pytest

import pyrannc
from pyrannc import _deployment
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import deployment_pb2 as dpb
from conftest import built_binary


def _plan(micro_batches=4, stage_devices=((0, 1), (2, 3)), device_type="cuda",
          num_devices=4, batch_size=64):
    """Two stages over a 10-node model by default: nodes [0, 6) on devices 0-1, [6, 10) on 2-3."""
    d = dpb.Deployment(format_version=1, model_hash="abc123", num_nodes=10,
                       batch_size=batch_size, device_type=device_type, num_devices=num_devices,
                       device_memory_bytes=80 << 30, mem_margin=0.1,
                       schedule=dpb.SCHEDULE_1F1B, micro_batches=micro_batches,
                       estimated_step_ms=123.456, objective_ms=120.0, optimizer="adam",
                       created_by="ranncd test")
    bounds = [0, 6, 10] if len(stage_devices) == 2 else \
        [round(10 * i / len(stage_devices)) for i in range(len(stage_devices) + 1)]
    for i, devices in enumerate(stage_devices):
        d.stages.add(index=i, first_node=bounds[i], end_node=bounds[i + 1], devices=devices,
                     recompute=(i == 0), memory_bytes=int(1.2 * (1 << 30)),
                     fixed_bytes=400 << 20, param_bytes=100 << 20,
                     activation_bytes=600 << 20, fwd_ms=1.5, bwd_ms=3.0,
                     micro_batch=batch_size // (micro_batches * len(devices)),
                     ops=["aten::linear", "aten::tanh", "aten::linear,aten::relu",
                          "aten::linear"][:3 if i else 4],
                     params=[f"l{i}.weight", f"l{i}.bias"])
    return d


def _write(tmp_path, deployment, name="plan.deployment"):
    path = tmp_path / name
    path.write_bytes(deployment.SerializeToString())
    return path


def _device_lines(text):
    """{"cuda:0": (stage, micro_batch)} from the per-device table."""
    out = {}
    for m in re.finditer(r"^  (\w+:\d+) -> stage (\d+), micro-batch size (\d+)$", text, re.M):
        out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


@pytest.mark.parametrize("batch,expected", [
    (64, 8),    # 64 / (4 micro-batches * 2 replicas)
    (128, 16),
    (8, 1),     # the smallest batch the plan can run
    (65, 9),    # not divisible: ceil
    (70, 9),
    (9, 2),
])
def test_micro_batch_size_per_device(tmp_path, capsys, batch, expected):
    path = _write(tmp_path, _plan())
    text = pyrannc.show_deployment(path, batch)
    assert capsys.readouterr().out == text  # printed and returned
    assert _device_lines(text) == {"cuda:0": (0, expected), "cuda:1": (0, expected),
                                   "cuda:2": (1, expected), "cuda:3": (1, expected)}
    assert f"Batch size {batch}:" in text
    assert text.count(f"micro-batch size {expected} per device") == 2


def test_replicas_differ_between_stages(tmp_path):
    # Stage 0 on 3 replicas, stage 1 on one device; 2 micro-batches.
    path = _write(tmp_path, _plan(micro_batches=2, stage_devices=((0, 1, 2), (3,))))
    text = pyrannc.show_deployment(path, 12)
    assert _device_lines(text) == {"cuda:0": (0, 2), "cuda:1": (0, 2), "cuda:2": (0, 2),
                                   "cuda:3": (1, 6)}
    assert "(3 replicas)" in text and "(1 replica)" in text
    # ceil(13 / (2 * 3)) = 3, ceil(13 / 2) = 7
    assert _device_lines(pyrannc.show_deployment(path, 13))["cuda:0"] == (0, 3)
    assert _device_lines(pyrannc.show_deployment(path, 13))["cuda:3"] == (1, 7)


def test_header_and_stage_details(tmp_path):
    text = _deployment.format_deployment(_plan(), 64)
    assert "abc123" in text
    assert "4 x cuda, 80.0 GiB each" in text
    assert "mem_margin 0.1" in text
    assert "1F1B, 4 micro-batches" in text
    assert "123.46 ms" in text and "planned batch size 64" in text
    assert "Stage 0: nodes [0, 6)" in text and "Stage 1: nodes [6, 10)" in text
    # Ops condensed: the first four, then a count over every atomic node's ops.
    assert "ops: aten::linear, aten::tanh, aten::linear, aten::relu, ... (5 ops)" in text
    assert "ops: aten::linear, aten::tanh, aten::linear, aten::relu (4 ops)" in text
    assert "devices: cuda:0, cuda:1 (2 replicas)" in text
    assert "recompute yes" in text and "recompute no" in text
    assert "1.2 GiB per device" in text
    assert "fwd 1.50 ms, bwd 3.00 ms per micro-batch" in text
    # What the memory estimate assumed and where the plan came from, then the memory's split.
    assert "\n  optimizer adam; created by ranncd test\n" in text
    assert text.count(
        "\n  memory: fixed 400.0 MiB (params 100.0 MiB) + activations 600.0 MiB per device\n"
    ) == 2
    assert "batch kept whole" not in text
    d = _plan()
    d.zero, d.offload, d.loaded = True, True, True
    assert ("\n  optimizer adam + ZeRO + offload; created by ranncd test; loaded from a file\n"
            in _deployment.format_deployment(d, 64))
    d = _plan()
    d.batch_whole = "aten::batch_norm in bn (BatchNorm2d) normalizes over the batch"
    assert ("  batch kept whole: aten::batch_norm in bn (BatchNorm2d) normalizes over the batch"
            in _deployment.format_deployment(d, 64))


def test_unused_devices_and_cpu_and_gpipe():
    d = _plan(stage_devices=((0,),), device_type="cpu", num_devices=2, micro_batches=1)
    d.schedule = dpb.SCHEDULE_GPIPE
    text = _deployment.format_deployment(d, 5)
    assert "  cpu:0 -> stage 0, micro-batch size 5" in text
    assert "  cpu:1 -> unused" in text
    assert "GPipe, 1 micro-batches" in text


def test_the_text_is_the_cli_s(tmp_path):
    # One formatter: pyrannc prints what `rannc plan --show` prints, byte for byte.
    path = _write(tmp_path, _plan(stage_devices=((0, 1, 2), (3,)), micro_batches=2))
    cli = subprocess.run([built_binary("rannc", "RANNC_CLI_BIN", "client"), "plan", "--show",
                          str(path), "--batch", "13"], capture_output=True, text=True, check=True)
    assert pyrannc.show_deployment(path, 13) == cli.stdout


def test_a_missing_cli_is_a_clear_error(tmp_path, monkeypatch):
    path = _write(tmp_path, _plan())
    monkeypatch.setenv("RANNC_CLI_BIN", str(tmp_path / "no_rannc"))
    with pytest.raises(RanncError, match="RANNC_CLI_BIN=.*no_rannc is not an executable"):
        pyrannc.show_deployment(path, 8)


def test_too_small_batch_is_refused(tmp_path):
    path = _write(tmp_path, _plan())  # 4 micro-batches x 2 replicas
    with pytest.raises(ValueError, match=r"cannot run batch size 7.*at least 8"):
        pyrannc.show_deployment(path, 7)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            pyrannc.show_deployment(path, bad)


def test_bad_files_are_value_errors_naming_the_path(tmp_path):
    missing = tmp_path / "missing.deployment"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        pyrannc.show_deployment(missing, 8)
    empty = tmp_path / "empty.deployment"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        _deployment.load_deployment_file(empty)
    text = tmp_path / "notes.txt"
    text.write_text("this is not a deployment\n")
    with pytest.raises(ValueError, match=re.escape(str(text)) + ".*not a deployment file"):
        _deployment.load_deployment_file(text)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="not a deployment file"):
        _deployment.load_deployment_file(garbage)
    newer = _plan()
    newer.format_version = 2
    with pytest.raises(ValueError, match="format_version 2"):
        _deployment.load_deployment_file(_write(tmp_path, newer, "newer.deployment"))
    no_stages = _plan()
    del no_stages.stages[:]
    with pytest.raises(ValueError, match="no stages"):
        _deployment.load_deployment_file(_write(tmp_path, no_stages, "empty_plan.deployment"))
    directory = tmp_path / "a_directory"
    directory.mkdir()
    with pytest.raises(ValueError, match="cannot read deployment file"):
        _deployment.read_deployment_bytes(directory)


def test_save_and_load_round_trip(tmp_path):
    original = _plan()
    path = tmp_path / "sub.deployment"
    _deployment.save_deployment_file(original, path)
    loaded = _deployment.load_deployment_file(path)
    assert loaded == original
    assert _deployment.read_deployment_bytes(str(path)) == original.SerializeToString()
    # Overwriting replaces the file whole and leaves no temporary file behind.
    changed = _plan(micro_batches=2)
    _deployment.save_deployment_file(changed, path)
    assert _deployment.load_deployment_file(path).micro_batches == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub.deployment"]


def test_load_deployment_is_checked_at_construction(tmp_path):
    # No daemon is involved: the file is checked when the module is built.
    import torch
    bad = tmp_path / "bad.deployment"
    bad.write_text("hello")
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        pyrannc.RaNNCModule(torch.nn.Linear(2, 2), load_deployment=bad)
    good = _write(tmp_path, _plan())
    rmod = pyrannc.RaNNCModule(torch.nn.Linear(2, 2), load_deployment=good)
    assert rmod.deployment is None and rmod.plan_summary is None
    with pytest.raises(RuntimeError, match="after the first forward"):
        rmod.save_deployment(tmp_path / "out.deployment")


def test_human_bytes():
    assert _deployment.human_bytes(0) == "0 B"
    assert _deployment.human_bytes(1023) == "1023 B"
    assert _deployment.human_bytes(1536) == "1.5 KiB"
    assert _deployment.human_bytes(int(1.2 * (1 << 30))) == "1.2 GiB"
    assert _deployment.human_bytes(80 << 30) == "80.0 GiB"
