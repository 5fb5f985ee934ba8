"""Detached jobs from Python (docs/detached.md): make a job from the model and optimizer objects
a RaNNC script uses, submit it to a daemon that trains it on its own, and follow it.

    import pyrannc.detached as dj
    job_file = dj.write_job("/tmp/job", model, optimizer, tokens="train.bin", batch=16, seq=64,
                            steps=200, schedule="cosine", warmup_steps=20)
    job_id = dj.submit(job_file)            # to RANNC_DAEMON (a daemon that outlives this process)
    print(dj.status(job_id).step)
    for line in dj.logs(job_id, follow=True):  # until it ends
        print(line.text)

`write_job` writes the model traced as (input_ids, targets) -> loss (token data) or on a batch
of a tensor dataset, and a job file that `rannc submit` reads too; `submit` reads such a file.
The daemon reads the files named there from its own file system; `submit(..., upload=True)`
sends them first (by default when the daemon runs on another host).
"""

import os
import socket
import time
import tomllib
from typing import Dict, Iterator, List, Optional, Union

import grpc
import torch

from pyrannc import _daemon, _optim
from pyrannc.errors import RanncError
from pyrannc.proto.rannc.v1 import training_pb2 as pb

# Token dtypes: bytes per id, and the ids they hold.
_TOKEN_DTYPES = {"uint8": (1, 0, 2**8), "uint16": (2, 0, 2**16), "uint32": (4, 0, 2**32),
                 "int32": (4, -2**31, 2**31)}
# The job file's optimizer names, by torch.optim class.
_NAMES = {cls: cls.__name__.lower() for cls in _optim._SUPPORTED}
# HyperParams fields written as pairs in a job file.
_PAIRS = {"betas": ("beta1", "beta2"), "etas": ("etaminus", "etaplus"),
          "step_sizes": ("step_size_min", "step_size_max")}


def _write_tokens(path: str, tokens, dtype: str) -> None:
    """`tokens` as a flat little-endian file of `dtype` ids (daemon/common/token_file.h)."""
    width, low, high = _TOKEN_DTYPES[dtype]
    t = torch.as_tensor(tokens).reshape(-1).to(torch.int64)
    if t.numel() and (int(t.min()) < low or int(t.max()) >= high):
        raise ValueError(f"token ids in [{int(t.min())}, {int(t.max())}] do not fit {dtype}")
    # Each id's `width` low bytes, least significant first (two's complement for int32).
    data = torch.stack([((t >> (8 * s)) & 0xFF).to(torch.uint8) for s in range(width)], dim=1)
    with open(path, "wb") as f:
        f.write(data.reshape(-1).numpy().tobytes())


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def write_job(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              tokens=None, *, batch: int, steps: int, seq: Optional[int] = None,
              eval_tokens=None, dataset=None, eval_dataset=None, token_dtype: str = "uint16",
              seed: int = 0, schedule: str = "constant", warmup_steps: int = 0,
              min_lr: float = 0.0, eval_every: int = 0, eval_batches: int = 4,
              config: Optional[Dict[str, object]] = None, name: Optional[str] = None,
              priority: int = 0) -> str:
    """Writes a detached job into `directory`: `model` as model.pt, the data, and job.toml,
    whose optimizer is `optimizer`'s kind and one param group's hyper-parameters (lr: the
    schedule's peak). `priority`: the queue's order (higher first, FIFO among equals). Returns
    the job file's path. The data is one of:
    - `tokens` / `eval_tokens`: a token file's path, or ids (a tensor or a list) written as
      `token_dtype`; the model is forward(input_ids, targets) -> a scalar loss, traced at
      [batch, seq] int64 ids, and trains on random windows of `seq` tokens;
    - `dataset` / `eval_dataset`: a file torch.save wrote, or the tensors themselves (a tuple,
      list or dict of tensors with one sample per row, torch.save'd as dataset.pt / eval.pt);
      the model is forward(*a batch's tensors) -> a scalar loss, traced on the first `batch`
      rows, and trains on batches of `batch` rows, epoch e's in the order of the e-th
      torch.randperm(n, generator=g) of one g = torch.Generator().manual_seed(seed), the rest
      of an epoch (less than a batch) dropped."""
    if (tokens is None) == (dataset is None):
        raise ValueError("name the training data: tokens or dataset, one of them")
    if tokens is not None and seq is None:
        raise ValueError("token data needs seq (tokens per window)")
    if type(optimizer) not in _NAMES:
        _optim.optimizer_type(optimizer)  # raises, naming what is supported
        raise NotImplementedError(
            f"a detached job runs torch.optim's optimizers; {type(optimizer).__name__} is "
            "registered for RaNNCModule only")
    if len(optimizer.param_groups) != 1:
        raise ValueError("a detached job trains one param group of every parameter; this "
                         f"optimizer has {len(optimizer.param_groups)}")
    if token_dtype not in _TOKEN_DTYPES:
        raise ValueError(f"token_dtype {token_dtype!r}: one of {', '.join(_TOKEN_DTYPES)}")
    os.makedirs(directory, exist_ok=True)

    def data(value, file_name):
        if isinstance(value, (str, os.PathLike)):
            return os.path.abspath(value)
        path = os.path.join(directory, file_name)
        if tokens is not None:
            _write_tokens(path, value, token_dtype)
        else:
            torch.save(value, path)
        return file_name

    top = {"name": name or os.path.basename(os.path.abspath(directory)), "model": "model.pt"}
    if tokens is not None:
        example = (torch.zeros(batch, seq, dtype=torch.long),) * 2
        top.update(tokens=data(tokens, "train.bin"), token_dtype=token_dtype, seq=seq)
        if eval_tokens is not None:
            top["eval_tokens"] = data(eval_tokens, "val.bin")
    else:
        top["dataset"] = data(dataset, "dataset.pt")
        if eval_dataset is not None:
            top["eval_dataset"] = data(eval_dataset, "eval.pt")
        tensors = torch.load(os.path.join(directory, top["dataset"]))
        tensors = list(tensors.values()) if isinstance(tensors, dict) else list(tensors)
        example = tuple(t[:batch] for t in tensors)
    top.update(batch=batch, steps=steps, seed=seed, eval_every=eval_every,
               eval_batches=eval_batches, priority=priority)
    was_training = model.training
    model.train()
    try:
        traced = torch.jit.trace(model, example)
    finally:
        model.train(was_training)
    traced.save(os.path.join(directory, "model.pt"))
    kind = _optim.optimizer_type(optimizer)
    hyper = _optim.hyper_params(optimizer.param_groups[0], kind)
    # Every field but the optional ones left unset (those take the daemon's defaults for the
    # kind); a zero is a value too.
    fields = {f.name: getattr(hyper, f.name) for f in hyper.DESCRIPTOR.fields
              if f.name != "named" and (f.containing_oneof is None or hyper.HasField(f.name))}
    for pair, (a, b) in _PAIRS.items():
        if a in fields or b in fields:
            fields[pair] = [fields.pop(a, 0.0), fields.pop(b, 0.0)]
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    lines += ["", "[optimizer]", f"type = {_toml_value(_NAMES[type(optimizer)])}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(fields.items())]
    lines += ["", "[schedule]", f"kind = {_toml_value(schedule)}",
              f"warmup_steps = {warmup_steps}", f"min_lr = {_toml_value(float(min_lr))}"]
    if config:
        lines += ["", "[config]"] + [f"{k} = {_toml_value(v)}" for k, v in config.items()]
    path = os.path.join(directory, "job.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def read_job(job_file: str) -> pb.DetachedJobSpec:
    """A job file as the spec SubmitJob takes (its paths made absolute), as `rannc submit`
    reads it."""
    with open(job_file, "rb") as f:
        doc = tomllib.load(f)
    base = os.path.dirname(os.path.abspath(job_file))

    def path(p):
        return p if os.path.isabs(p) else os.path.join(base, p)

    spec = pb.DetachedJobSpec()
    paths = {"model": "model_path", "tokens": "tokens_path", "eval_tokens": "eval_tokens_path",
             "dataset": "dataset_path", "eval_dataset": "eval_dataset_path"}
    plain = ("name", "token_dtype", "batch", "seq", "steps", "seed", "eval_every",
             "eval_batches", "priority")
    for key, value in doc.items():
        if key in paths:
            setattr(spec, paths[key], path(value))
        elif key in plain:
            setattr(spec, key, value)
        elif key == "optimizer":
            for k, v in value.items():
                if k == "type":
                    spec.optimizer = v
                elif k in _PAIRS:
                    for field, x in zip(_PAIRS[k], v):
                        spec.hyper[field] = float(x)
                else:
                    spec.hyper[k] = float(v)
        elif key == "schedule":
            for k, v in value.items():
                if k == "kind":
                    spec.schedule = v
                elif k in ("warmup_steps", "min_lr"):
                    setattr(spec, k, v)
                else:
                    raise ValueError(f"{job_file}: schedule.{k}: unknown; schedule has kind, "
                                     "warmup_steps, min_lr")
        elif key == "config":
            for k, v in value.items():
                text = ("true" if v else "false") if isinstance(v, bool) else str(v)
                spec.config[k] = path(text) if k == "checkpoint_dir" else text
        else:
            raise ValueError(f"{job_file}: {key!r}: unknown key of a job file "
                             "(docs/detached.md)")
    return spec


def _connection(daemon: Optional[str]):
    address = daemon or os.environ.get("RANNC_DAEMON")
    if not address:
        raise RanncError("a detached job needs a daemon that outlives this process: start "
                         "ranncd and pass its address (daemon=..., or RANNC_DAEMON)")
    return _daemon.Connection(address)


# The spec's fields naming files the daemon reads.
_FILE_FIELDS = ("model_path", "tokens_path", "eval_tokens_path", "dataset_path",
                "eval_dataset_path")
_UPLOAD_CHUNK = 4 << 20


def _upload(conn, path: str) -> str:
    """Sends the file at `path` to the daemon (UploadFile); its path there."""
    size = os.path.getsize(path)

    def chunks():
        with open(path, "rb") as f:
            first = True
            while True:
                data = f.read(_UPLOAD_CHUNK)
                if first:
                    yield pb.UploadChunk(name=os.path.basename(path), size=size, data=data)
                    first = False
                elif data:
                    yield pb.UploadChunk(data=data)
                if len(data) < _UPLOAD_CHUNK:
                    return

    return conn.call_streaming_request("UploadFile", chunks()).path


def submit(job: Union[str, pb.DetachedJobSpec], daemon: Optional[str] = None,
           upload: Optional[bool] = None) -> str:
    """Submits a job file (or spec) to `daemon` (default RANNC_DAEMON); returns the job id.
    `upload`: send the model and data files to the daemon instead of naming them (a daemon on
    another host cannot read this one's); None: when the daemon's hostname is not this host's,
    as `rannc submit` decides."""
    spec = pb.DetachedJobSpec()
    spec.CopyFrom(read_job(job) if isinstance(job, (str, os.PathLike)) else job)
    conn = _connection(daemon)
    try:
        if upload is None:
            upload = conn.call("GetInfo", pb.GetInfoRequest()).hostname != socket.gethostname()
        if upload:
            for field in _FILE_FIELDS:
                if getattr(spec, field):
                    setattr(spec, field, _upload(conn, getattr(spec, field)))
        return conn.call("SubmitJob", spec).job_id
    finally:
        conn.close()


def status(job_id: str, daemon: Optional[str] = None) -> pb.DetachedStatus:
    """The job's DetachedStatus: state, step, loss, tokens/s, ETA, eval loss, ..."""
    conn = _connection(daemon)
    try:
        return conn.call("DetachedJobStatus", pb.JobRef(job_id=job_id))
    finally:
        conn.close()


def list_jobs(daemon: Optional[str] = None) -> List[pb.DetachedStatus]:
    """Every detached job the daemon knows, as DetachedStatus: the running ones, then the queue
    in its order (`queue_position` 1, 2, ...), then those waiting to be resubmitted after a
    restart, then those ended since the daemon started (`rannc queue` prints the same)."""
    conn = _connection(daemon)
    try:
        return list(conn.call("ListDetachedJobs", pb.Empty()).jobs)
    finally:
        conn.close()


_ENDED = (pb.DETACHED_DONE, pb.DETACHED_FAILED, pb.DETACHED_CANCELLED)


def logs(job_id: str, follow: bool = False, after_seq: int = 0, daemon: Optional[str] = None,
         wait_for_daemon: float = 0.0) -> Iterator[pb.DetachedLogLine]:
    """The job's log lines numbered above `after_seq` (each with its `seq`, `unix_ms` and
    `text`); with `follow`, then each new line until the job ends. A followed log whose daemon
    stops (its jobs go on at its next start) or goes away ends there, unless `wait_for_daemon`
    > 0: then it goes on from the line after the last one yielded once the daemon answers
    again within that many seconds, as `rannc logs -f --wait-for-daemon` does."""
    conn = _connection(daemon)
    try:
        while True:
            failed = None
            try:
                for line in conn.stream("DetachedJobLogs", pb.DetachedLogsRequest(
                        job_id=job_id, follow=follow, after_seq=after_seq)):
                    after_seq = line.seq
                    yield line
            except RanncError as err:
                failed = err
            if not follow or wait_for_daemon <= 0:
                if failed is not None:
                    raise failed
                return
            if failed is None:
                try:
                    if conn.call("DetachedJobStatus", pb.JobRef(job_id=job_id)).state in _ENDED:
                        return
                except RanncError as err:
                    failed = err
            # A stopping daemon cancels the calls it has; one gone is unreachable.
            if failed is not None and failed.code not in (grpc.StatusCode.UNAVAILABLE,
                                                          grpc.StatusCode.CANCELLED):
                raise failed
            time.sleep(0.25)  # a stopping daemon still answers for a moment
            conn.wait_ready(time.monotonic() + wait_for_daemon, lambda: None)
    finally:
        conn.close()


def cancel(job_id: str, daemon: Optional[str] = None) -> None:
    """Stops the job after its current step (its checkpoints stay)."""
    conn = _connection(daemon)
    try:
        conn.call("CancelJob", pb.JobRef(job_id=job_id))
    finally:
        conn.close()
