"""Client-side pieces that need no daemon: tensor codec, output structures, config, optimizer
mapping, version check, finding the binaries, the walk over a model's tensors, the saved trace's
fingerprint and output codec."""

import collections
import io
import json
import os
import tempfile
import time
import weakref

import pytest
import torch

from pyrannc import (_binaries, _codec, _config, _daemon, _deployment, _jobs, _optim,
                     _outputs, _runtime, _saved_trace, _shm, _tensors, _tracing)
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import deployment_pb2 as dpb
from pyrannc.proto.rannc.v1 import training_pb2 as pb
import models
from conftest import free_port

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_codec_round_trip(dtype):
    t = (torch.randn(3, 4) * 50).to(dtype)
    msg = _codec.encode(t)
    assert list(msg.shape) == [3, 4]
    assert len(msg.data) == t.numel() * t.element_size()
    back = _codec.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, t)


def test_codec_non_contiguous_scalar_and_empty():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(_codec.decode(_codec.encode(t)), t)
    s = torch.tensor(2.5)
    back = _codec.decode(_codec.encode(s))
    assert back.shape == () and back.item() == 2.5
    e = torch.zeros(0, 5)
    back = _codec.decode(_codec.encode(e))
    assert back.shape == (0, 5)
    grad = torch.ones(3, requires_grad=True) * 2
    assert torch.equal(_codec.decode(_codec.encode(grad)), grad.detach())


def test_codec_bfloat16_bytes_are_little_endian_bits():
    t = torch.tensor([1.0], dtype=torch.bfloat16)
    assert _codec.encode(t).data == b"\x80\x3f"


def test_codec_rejects_wrong_byte_count():
    with pytest.raises(ValueError, match="needs 48 bytes"):
        _codec.decode(pb.Tensor(dtype=pb.FLOAT32, shape=[4, 3], data=b"\x00" * 20))


def test_codec_reads_shared_memory(tmp_path):
    t = torch.randn(5, 2)
    path = tmp_path / "shm"
    path.write_bytes(b"pad" + _codec.tensor_bytes(t))
    msg = pb.Tensor(dtype=pb.FLOAT32, shape=[5, 2],
                    shm=pb.ShmRef(path=str(path), offset=3, length=40))
    assert torch.equal(_codec.decode(msg), t)


def test_state_chunks_reassemble(monkeypatch):
    monkeypatch.setattr(_codec, "STREAM_CHUNK_BYTES", 7)
    a, b, empty = torch.randn(5, 3), torch.arange(4), torch.zeros(0)
    chunks = list(_codec.state_chunks("a", a, False)) + list(_codec.state_chunks("b", b, True)) \
        + list(_codec.state_chunks("e", empty, True))
    assert all(len(c.data) <= 7 for c in chunks)
    assert len([c for c in chunks if c.name == "a"]) == 9  # ceil(60 / 7)
    asm = _codec.StateAssembler()
    for c in chunks:
        asm.add(c)
    out = asm.result()
    assert list(out) == ["a", "b", "e"]
    assert torch.equal(out["a"][0], a) and out["a"][1] is False
    assert torch.equal(out["b"][0], b) and out["b"][1] is True
    assert out["e"][0].shape == (0,)


def test_state_assembler_detects_missing_bytes():
    chunks = list(_codec.state_chunks("a", torch.randn(4), False))
    chunks[0].data = chunks[0].data[:8]
    asm = _codec.StateAssembler()
    asm.add(chunks[0])
    with pytest.raises(ValueError, match="8 of 16 bytes"):
        asm.result()


Pair = collections.namedtuple("Pair", "left right")


def test_outputs_flatten_unflatten():
    x, y, z = torch.ones(1), torch.zeros(2, requires_grad=True), torch.arange(3)
    out = {"a": (x, [y, None]), "b": Pair(z, 3), "c": "tag"}
    tensors, spec = _outputs.flatten(out)
    assert [t is s for t, s in zip(tensors, [x, y, z])] == [True] * 3
    assert [leaf.requires_grad for leaf in _outputs.leaves(spec)] == [False, True, False]
    new = [t + 10 for t in tensors]
    rebuilt = _outputs.unflatten(spec, new)
    assert set(rebuilt) == {"a", "b", "c"}
    assert rebuilt["a"][0] is new[0] and rebuilt["a"][1][0] is new[1]
    assert isinstance(rebuilt["a"][1], list) and rebuilt["a"][1][1] is None
    assert isinstance(rebuilt["b"], Pair) and rebuilt["b"].left is new[2]
    assert rebuilt["b"].right == 3 and rebuilt["c"] == "tag"
    single, spec = _outputs.flatten(x)
    assert _outputs.unflatten(spec, [y]) is y


def test_outputs_reject_unknown_types():
    with pytest.raises(TypeError, match="object"):
        _outputs.flatten((torch.ones(1), object()))


def test_config_file_and_environment(tmp_path, monkeypatch):
    (tmp_path / "rannc.toml").write_text(
        'partition_num = 2\nmem_margin = 0.1\nprofiling = true\ndevices = "cpu:4"\n'
        'replica_num = 1\n')
    for k in list(os.environ):
        if k.startswith("RANNC_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANNC_CONF_DIR", str(tmp_path))
    monkeypatch.setenv("RANNC_REPLICA_NUM", "4")
    monkeypatch.setenv("RANNC_DAEMON", "127.0.0.1:1")
    monkeypatch.setenv("RANNC_SOMETHING_ELSE", "x")  # another program's: not a concern
    # RaNNC's `profiling` is accepted and not sent; the daemon's `devices` is the daemon's.
    assert _config.job_config() == {"partition_num": "2", "mem_margin": "0.1",
                                    "replica_num": "4"}
    assert _config.client_setting("daemon") == "127.0.0.1:1"
    assert _config.client_setting("devices") == "cpu:4"


def test_config_file_with_a_misspelt_key_names_the_nearest(tmp_path, monkeypatch):
    (tmp_path / "rannc.toml").write_text('amp_level = "O2"\npipline_num = 2\n')
    monkeypatch.setenv("RANNC_CONF_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown key 'pipline_num'.*did you mean 'pipeline_num'"):
        _config.job_config()


def test_config_parse_error_names_file(tmp_path, monkeypatch):
    (tmp_path / "rannc.toml").write_text("partition_num = = 2\n")
    monkeypatch.setenv("RANNC_CONF_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="rannc.toml"):
        _config.job_config()


def test_config_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("RANNC_CONF_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _config.config_path() == str(tmp_path / ".rannc" / "rannc.toml")


@pytest.fixture
def rannc_toml(tmp_path, monkeypatch):
    """Writes rannc.toml (no RANNC_* variable set but RANNC_CONF_DIR) and returns its path."""
    for k in list(os.environ):
        if k.startswith("RANNC_"):
            monkeypatch.delenv(k)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
              "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    conf = tmp_path / "conf"
    conf.mkdir()
    monkeypatch.setenv("RANNC_CONF_DIR", str(conf))
    path = conf / "rannc.toml"

    def write(text: str):
        path.write_text(text)
        return path

    return write


def _shm_forced() -> bool:
    # A daemon whose address does not say it is on this host: shm only when the setting forces it.
    info = pb.DaemonInfo(shm_dir=tempfile.gettempdir(), hostname="elsewhere")
    return _shm.make_transfer("10.255.0.1:7411", info, False) is not None


def _traced_batch() -> int:
    return _tracing.trace_inputs([torch.ones(8, 2)])[0][0].shape[0]


# Every setting pyrannc reads, read where it is used: (rannc.toml line, what that gives,
# environment variables, what they give (the environment wins), what neither gives).
CLIENT_SETTINGS = {
    "devices": (lambda: _daemon.embedded_settings().devices,
                'devices = "cpu:3"', "cpu:3", {"RANNC_DEVICES": "cpu:1"}, "cpu:1", "cpu:2"),
    "daemon_args": (lambda: _daemon.embedded_settings().flags,
                    "daemon_args = \"--log-level debug --shm-dir '/a b'\"",
                    ["--log-level", "debug", "--shm-dir", "/a b"],
                    {"RANNC_DAEMON_ARGS": "--log-level warn"}, ["--log-level", "warn"], []),
    "daemon_log": (lambda: _daemon.embedded_settings().log_path,
                   'daemon_log = "/tmp/toml.log"', "/tmp/toml.log",
                   {"RANNC_DAEMON_LOG": "/tmp/env.log"}, "/tmp/env.log", ""),
    "daemon_start_timeout": (lambda: _daemon.embedded_settings().start_timeout,
                             "daemon_start_timeout = 5", 5.0,
                             {"RANNC_DAEMON_START_TIMEOUT": "7.5"}, 7.5, 120.0),
    "daemon_stop_timeout": (lambda: _daemon.embedded_settings().stop_timeout,
                            "daemon_stop_timeout = 2.5", 2.5,
                            {"RANNC_DAEMON_STOP_TIMEOUT": "1"}, 1.0, 10.0),
    "defer_ops": (_jobs.defer_ops, "defer_ops = false", False, {"RANNC_DEFER_OPS": "1"}, True,
                  True),
    "shm": (_shm_forced, "shm = true", True, {"RANNC_SHM": "0"}, False, False),
    "reuse_trace": (_saved_trace.reuse_enabled, "reuse_trace = false", False,
                    {"RANNC_REUSE_TRACE": "1"}, True, True),
    "trace_batch": (_traced_batch, "trace_batch = 2", 2, {"RANNC_TRACE_BATCH": "4"}, 4, 8),
    "client_rank": (lambda: (_runtime.get_rank(), _runtime.get_world_size()),
                    "client_rank = 1\nclient_world = 2", (1, 2), {"RANNC_CLIENT_RANK": "0"},
                    (0, 2), (0, 1)),
    "client_timeout": (_jobs.client_timeout_ms, "client_timeout = 12", 12000,
                       {"RANNC_CLIENT_TIMEOUT": "1.5"}, 1500, 300000),
    "job_lease": (_jobs.lease_seconds, "job_lease = 30", 30.0, {"RANNC_JOB_LEASE": "0"}, 0.0,
                  300.0),
}


@pytest.mark.parametrize("key", CLIENT_SETTINGS)
def test_client_setting_from_rannc_toml_and_environment(rannc_toml, monkeypatch, key):
    read, line, from_file, env, from_env, default = CLIENT_SETTINGS[key]
    assert read() == default
    rannc_toml(line + "\n")
    assert read() == from_file
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert read() == from_env


def test_connect_timeout_from_rannc_toml(rannc_toml, monkeypatch):
    # Nothing listens there: the whole timeout passes, 0 s from the file.
    address = f"127.0.0.1:{free_port()}"
    rannc_toml("daemon_connect_timeout = 0\n")
    started = time.monotonic()
    with pytest.raises(RanncError, match="cannot reach ranncd"):
        _daemon._connect(address, "test")
    assert time.monotonic() - started < 5
    monkeypatch.setenv("RANNC_DAEMON_CONNECT_TIMEOUT", "x")
    with pytest.raises(ValueError, match="RANNC_DAEMON_CONNECT_TIMEOUT=x is not a number"):
        _daemon._connect(address, "test")


def test_launcher_ranks_unless_rannc_keys_are_set(rannc_toml, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (_runtime.get_rank(), _runtime.get_world_size()) == (3, 4)
    rannc_toml("client_world = 2\n")
    assert (_runtime.get_rank(), _runtime.get_world_size()) == (0, 2)


# A bad value in rannc.toml: (the line, the setting's reader, what the message says is wrong).
BAD_CLIENT_SETTINGS = [
    ("daemon_args = \"--devices 'cpu:1\"", _daemon.embedded_settings, "a line of flags"),
    ('daemon_start_timeout = "soon"', _daemon.embedded_settings, "a number of seconds >= 0"),
    ("daemon_stop_timeout = -1", _daemon.embedded_settings, "a number of seconds >= 0"),
    ('daemon_connect_timeout = "nan"', lambda: _daemon._connect("127.0.0.1:1", "test"),
     "a number of seconds"),
    ('defer_ops = "maybe"', _jobs.defer_ops, "true or false"),
    ("shm = 2", _shm_forced, "true or false"),
    ('reuse_trace = "sometimes"', _saved_trace.reuse_enabled, "true or false"),
    ('trace_batch = "two"', _traced_batch, "an integer"),
    ('client_world = "two"', _runtime.get_world_size, "an integer"),
    ('client_timeout = "long"', _jobs.client_timeout_ms, "a number of seconds"),
    ("job_lease = 5000000", _jobs.lease_seconds, "a number of seconds from 0 to 4,000,000"),
]


@pytest.mark.parametrize("line,read,expected", BAD_CLIENT_SETTINGS,
                         ids=[b[0].split(" ")[0] for b in BAD_CLIENT_SETTINGS])
def test_bad_client_setting_names_where_it_came_from(rannc_toml, monkeypatch, line, read,
                                                     expected):
    path = rannc_toml(line + "\n")
    key, value = (part.strip() for part in line.split("=", 1))
    with pytest.raises(ValueError) as err:
        read()
    assert f"{key} = " in str(err.value) and f" in {path} is not {expected}" in str(err.value)
    # The same value in the environment: the message names the variable.
    env_value = value.strip('"')
    monkeypatch.setenv("RANNC_" + key.upper(), env_value)
    with pytest.raises(ValueError) as err:
        read()
    assert f"pyrannc: RANNC_{key.upper()}={env_value} is not {expected}" in str(err.value)


def test_bool_settings_read_as_toml_writes_them(rannc_toml, monkeypatch):
    for value, expected in (("true", True), ("false", False), ("1", True), ("0", False),
                            ("Yes", True), ("off", False), ("", True)):
        monkeypatch.setenv("RANNC_DEFER_OPS", value)
        assert _jobs.defer_ops() is expected, value


def test_config_file_is_parsed_again_once_changed(rannc_toml):
    rannc_toml("defer_ops = 0\n")
    assert _jobs.defer_ops() is False
    rannc_toml("defer_ops = 1\n")  # the same size, maybe the same mtime: the contents decide
    assert _jobs.defer_ops() is True


def test_hyper_params_mapping():
    p = [torch.zeros(1, requires_grad=True)]
    sgd = torch.optim.SGD(p, lr=0.3, momentum=0.9, dampening=0.1, weight_decay=0.01,
                          nesterov=False, maximize=True)
    h = _optim.hyper_params(sgd.param_groups[0], _optim.optimizer_type(sgd))
    assert (h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize) == \
        pytest.approx((0.3, 0.9, 0.1, 0.01, False, True))
    adam = torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, amsgrad=True)
    assert _optim.optimizer_type(adam) == pb.ADAM
    h = _optim.hyper_params(adam.param_groups[0], pb.ADAM)
    got = (h.lr, h.beta1, h.beta2, h.eps, h.amsgrad)
    assert got == pytest.approx((0.01, 0.8, 0.95, 1e-6, True))
    assert _optim.optimizer_type(torch.optim.AdamW(p)) == pb.ADAMW


def test_optimizer_spec_names_and_foreign_params():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 1.0},
                           {"params": model[1].parameters()}], lr=0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    spec = _optim.optimizer_spec(opt, names)
    assert [list(g.params) for g in spec.groups] == [["0.weight", "0.bias"],
                                                     ["1.weight", "1.bias"]]
    assert [g.hyper.lr for g in spec.groups] == [1.0, 0.5]
    foreign = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        _optim.optimizer_spec(foreign, names)


def test_unsupported_optimizer():
    # Named, with what is supported.
    for cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(NotImplementedError,
                           match=f"torch.optim.{cls.__name__} is not supported"):
            _optim.optimizer_type(cls([torch.zeros(1, requires_grad=True)]))
    with pytest.raises(NotImplementedError, match="torch.optim.Rprop in the daemon"):
        _optim.optimizer_type(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))


def test_torch_version_check():
    _daemon.check_torch_version("1.13.1", "1.13.0a0+git")
    with pytest.raises(RanncError, match="LibTorch 2.1.0.*PyTorch 1.13"):
        _daemon.check_torch_version("2.1.0", "1.13.0")
    with pytest.raises(RanncError, match="no usable PyTorch version"):
        _daemon.check_torch_version("", "1.13.0")


def test_find_daemon_binary(monkeypatch, tmp_path):
    exe = tmp_path / "ranncd"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("RANNC_DAEMON_BIN", str(exe))
    assert _daemon.find_daemon_binary() == str(exe)
    monkeypatch.setenv("RANNC_DAEMON_BIN", str(tmp_path / "missing"))
    with pytest.raises(RanncError, match="not an executable"):
        _daemon.find_daemon_binary()


def test_find_cli_binary(monkeypatch, tmp_path):
    exe = tmp_path / "rannc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("RANNC_CLI_BIN", str(exe))
    assert _binaries.find_cli_binary() == str(exe)
    monkeypatch.setenv("RANNC_CLI_BIN", str(tmp_path / "missing"))
    with pytest.raises(RanncError, match="RANNC_CLI_BIN=.*not an executable"):
        _binaries.find_cli_binary()


@pytest.mark.parametrize("key,find", [("daemon_bin", _binaries.find_daemon_binary),
                                      ("cli_bin", _binaries.find_cli_binary)])
def test_binaries_from_rannc_toml(monkeypatch, tmp_path, key, find):
    # The binaries are client keys of the registry: rannc.toml names them, the environment wins.
    exe = tmp_path / "prog"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    conf = tmp_path / "conf"
    conf.mkdir()
    monkeypatch.setenv("RANNC_CONF_DIR", str(conf))
    monkeypatch.delenv("RANNC_" + key.upper(), raising=False)
    (conf / "rannc.toml").write_text(f'{key} = "{exe}"\n')
    assert find() == str(exe)
    (conf / "rannc.toml").write_text(f'{key} = "{tmp_path / "missing"}"\n')
    with pytest.raises(RanncError, match=rf'{key} = ".*missing" in .*rannc.toml is not an exec'):
        find()
    monkeypatch.setenv("RANNC_" + key.upper(), str(exe))
    assert find() == str(exe)


class _Shared(torch.nn.Module):
    """A submodule reached by two paths, a weight tied across modules, buffers, an empty slot."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.block = torch.nn.Linear(16, 16)
        self.again = self.block
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.bn(self.again(self.block(self.emb(x).mean(1)))))


def test_tensor_walk_names_every_slot_and_each_tensor_once():
    model = _Shared()
    names = [(s.name, s.kind) for s in _tensors.slots(model)]
    assert ("block.weight", "parameter") in names and ("again.weight", "parameter") in names
    assert ("head.weight", "parameter") in names and ("bn.running_mean", "buffer") in names
    assert "head.bias" not in [n for n, _ in names]  # bias=False leaves the slot empty
    distinct = [s.name for s in _tensors.distinct(model)]
    assert "again.weight" not in distinct and "head.weight" not in distinct
    assert distinct == [n for n, _ in _saved_trace.model_tensors(model)]
    unique = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    assert _tensors.distinct_bytes(model, 0) == sum(_tensors.nbytes(t) for t in unique.values())
    assert _tensors.distinct_bytes(model, 1024) == _tensors.nbytes(model.emb.weight) + \
        _tensors.nbytes(model.block.weight)


def test_leave_out_keeps_ties_and_leaves_the_model_alone():
    model = _Shared().eval()
    traced = torch.jit.trace(model, torch.randint(0, 50, (4, 3)), check_trace=False)
    apart = _tensors.leave_out(traced, 1024)
    assert [n for n, _ in apart] == ["emb.weight", "block.weight"]
    assert _tensors.distinct_bytes(model, 1024) == sum(_tensors.nbytes(t) for _, t in apart)
    assert traced.emb.weight.stride() == (0, 0) and traced.block.bias.stride() == (1,)
    assert traced.head.weight is traced.emb.weight  # one stand-in for the tied pair
    assert model.emb.weight.stride() == (16, 1)  # the user's model keeps its tensors


class _SavesAnActivation(torch.nn.Module):
    """Notes, at the end of each forward, whether an activation that only autograd's saved
    tensors still hold is alive."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.alive = []

    def forward(self, x):
        h = torch.tanh(self.a(x))  # tanh saves h, and so does the Linear that reads it
        ref = weakref.ref(h)
        y = self.b(h)
        del h
        self.alive.append(ref() is not None)
        return y.sum()


class _GradInForward(torch.nn.Module):
    """A forward that runs a backward of its own (not in the graph: only its value is kept)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(8.0))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        y = (x * self.w).sum()
        g, = torch.autograd.grad(y, self.w, retain_graph=True)
        self.grad_norm = float(g.norm())
        # A Python branch on a buffer's value: a trace bakes in the one it takes.
        return y if float(self.calls) == 1 else -y


def _ops(traced):
    """The ops of a traced module's graph as its archive holds them."""
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    return [n.kind() for n in torch.jit.load(buf).inlined_graph.nodes()]


def test_trace_keeps_no_tensor_saved_for_a_backward():
    """The trace's forward runs with autograd on but keeps nothing for a backward (on a 10B GPT
    that is ~25 GiB of host memory for one sample), and makes the same graph as a plain trace."""
    model = _SavesAnActivation()
    x = torch.randn(4, 8)
    mode = pb.Mode(training=True, dropout=False)
    model_bytes, _, _, _ = _tracing.trace(model, [x], mode)
    assert model.alive == [False]
    with torch.enable_grad():
        plain = torch.jit.trace(model, [x], check_trace=False)
    assert model.alive == [False, True]  # the premise: a plain trace keeps it
    ours = torch.jit.load(io.BytesIO(model_bytes))
    assert _ops(ours) == _ops(plain)

    gpt = models.TinyGPT()
    batch = list(models.gpt_batch(0))
    gpt_bytes, _, _, _ = _tracing.trace(gpt, batch, pb.Mode(training=True, dropout=True))
    with torch.enable_grad():
        gpt_plain = torch.jit.trace(gpt, batch, check_trace=False)
    gpt_ours = torch.jit.load(io.BytesIO(gpt_bytes))
    assert _ops(gpt_ours) == _ops(gpt_plain)
    torch.testing.assert_close(gpt_ours(*batch), gpt(*batch), rtol=0, atol=0)


def test_trace_of_a_forward_that_runs_a_backward_keeps_what_it_reads():
    """Such a forward needs the saved tensors: it is traced again with them, from the buffers
    it started from."""
    model = _GradInForward()
    x = torch.randn(4, 8)
    model_bytes, _, _, _ = _tracing.trace(model, [x], pb.Mode(training=True, dropout=False))
    assert model.grad_norm == pytest.approx(float(x.sum(0).norm()))
    assert float(model.calls) == 0  # restored after both traces
    traced = torch.jit.load(io.BytesIO(model_bytes))
    torch.testing.assert_close(traced(x), model(x))  # the second trace started from calls = 0


def test_chunk_bytes_fit_the_message_limit():
    assert _codec.chunk_bytes(4 << 20, 64 << 20) == 4 << 20
    assert _codec.chunk_bytes(4 << 20, 2 << 20) == 1 << 20
    assert _codec.chunk_bytes(4 << 20, 0) == 4 << 20
    chunks = list(_codec.state_chunks("w", torch.zeros(1000), False, 1000))
    assert [len(c.data) for c in chunks] == [1000] * 4


def test_unflattened_outputs_die_with_their_last_reference():
    """No reference cycle keeps outputs alive until the garbage collector runs: pyrannc reuses
    an output's receive buffer only once the output is gone."""
    import gc
    import weakref
    out = (torch.zeros(2), [torch.ones(3), {"a": torch.ones(1)}])
    _, spec = _outputs.flatten(out)
    gc.disable()
    try:
        rebuilt = _outputs.unflatten(spec, [torch.zeros(2), torch.ones(3), torch.ones(1)])
        refs = [weakref.ref(rebuilt[0]), weakref.ref(rebuilt[1][0])]
        del rebuilt
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_received_buffers_are_reused():
    pool = _codec._ReceivePool(max_cached_bytes=64 << 20)
    a = pool.empty(torch.float32, (1 << 20,))
    ptr = a.data_ptr()
    del a
    b = pool.empty(torch.float32, (1 << 20,))
    assert b.data_ptr() == ptr
    assert b.shape == (1 << 20,)
    c = pool.empty(torch.bfloat16, (3, 4))  # small: not pooled
    assert c.dtype == torch.bfloat16 and c.shape == (3, 4)


# Saved traces (pyrannc._saved_trace).
def _fp(model, inputs=None, training=True, dropout=True):
    inputs = inputs if inputs is not None else models.mlp_batch(0)
    fp, why = _saved_trace.fingerprint(model, inputs, training, dropout)
    assert fp is not None, why
    return fp


def test_fingerprint_ignores_values_and_sees_what_makes_the_graph():
    torch.manual_seed(0)
    a = _fp(models.MLP())
    torch.manual_seed(1)
    assert _saved_trace.mismatch(a, _fp(models.MLP())) is None  # other values, same graph
    json.dumps(a)  # stored as JSON

    assert "mode" in _saved_trace.mismatch(a, _fp(models.MLP(), dropout=False))
    short = _fp(models.MLP(), inputs=models.mlp_batch(0, batch=8))
    assert "trace inputs" in _saved_trace.mismatch(a, short)
    frozen = models.MLP()
    frozen.l1.weight.requires_grad_(False)
    assert "'l1.weight', 'parameter', 'torch.float32', [16, 8], False" in \
        _saved_trace.mismatch(a, _fp(frozen))
    extra = models.MLP()
    extra.add_module("idle", torch.nn.Identity())
    assert "module trees" in _saved_trace.mismatch(a, _fp(extra))

    gpt = _fp(models.TinyGPT(), inputs=models.gpt_batch(0))
    heads = _fp(models.TinyGPT(heads=4), inputs=models.gpt_batch(0))
    # Same shapes, another head count: a constant the trace bakes in.
    assert "module attributes" in _saved_trace.mismatch(gpt, heads)
    assert "blocks.0.attn.heads" in _saved_trace.mismatch(gpt, heads)


def test_fingerprint_sees_ties_and_refuses_hooks():
    tied = models.TinyGPT()
    untied = models.TinyGPT()
    untied.head.weight = torch.nn.Parameter(untied.tok.weight.detach().clone())
    inputs = models.gpt_batch(0)
    a, b = _fp(tied, inputs), _fp(untied, inputs)
    assert "tied to" in _saved_trace.mismatch(a, b)

    hooked = models.MLP()
    hooked.l1.register_forward_hook(lambda m, i, o: o * 2)
    fp, why = _saved_trace.fingerprint(hooked, models.mlp_batch(0), True, True)
    assert fp is None and "hooks" in why


_Pair = collections.namedtuple("_Pair", "a b")


def test_output_structure_round_trips_through_json():
    out = {"loss": torch.zeros(()), "parts": _Pair(torch.ones(2, requires_grad=True), [None, 3]),
           "od": collections.OrderedDict(x=torch.ones(1))}
    flat, spec = _outputs.flatten(out)
    back = _saved_trace.outputs_from_json(_saved_trace.outputs_to_json(spec))
    rebuilt = _outputs.unflatten(back, flat)
    assert type(rebuilt["parts"]) is _Pair and rebuilt["parts"].b == [None, 3]
    assert type(rebuilt["od"]) is collections.OrderedDict
    assert [leaf.requires_grad for leaf in _outputs.leaves(back)] == [False, True, False]
    with pytest.raises(ValueError, match="not among the imported modules"):
        _saved_trace.outputs_from_json('{"seq": "nowhere.Pair", "items": []}')


def test_split_saved_trace_keeps_the_rest_of_the_file():
    d = dpb.Deployment(format_version=1, model_hash="h", num_nodes=1)
    d.stages.add(index=0, first_node=0, end_node=1, devices=[0])
    d.saved_trace.archive = b"graph"
    d.saved_trace.outputs = "{}"
    rest, trace = _deployment.split_saved_trace(d.SerializeToString())
    assert trace.archive == b"graph"
    stripped = dpb.Deployment.FromString(rest)
    assert not stripped.HasField("saved_trace")
    d.ClearField("saved_trace")
    assert stripped == d
    same, none = _deployment.split_saved_trace(rest)
    assert same == rest and none is None
