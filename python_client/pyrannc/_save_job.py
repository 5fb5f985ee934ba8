"""RANNC_SAVE_JOB=DIR: what this client sends to create its job, and its first training batch,
written to DIR, so that benchmarks/job_bench.cc can train the same job in one process, with no
client and no gRPC in between (issue 7's in-process comparison; also a way to hand a job that
misbehaves to someone without the client's code).

DIR receives:
  job.pb      the CreateJob JobSpec as sent (rannc.v1.JobSpec, serialized)
  model.pt    the TorchScript archive sent after it
  rannc-*     copies of the shared-memory files the spec names (the model's large tensors)
  forward.pb  the first forward with requires_grad (rannc.v1.ForwardRequest), every tensor inline

The files hold the model's full state: GiBs for a large model. Only rank 0 (the process that
creates the job) writes them; a second job of the same process overwrites them.
"""

import logging
import os
import shutil

from pyrannc import _codec, _config

logger = logging.getLogger("pyrannc")


def directory() -> str:
    return _config.client_setting("save_job", "")


def save_job(spec, model_bytes: bytes) -> bool:
    """Writes job.pb, model.pt and the shared-memory files `spec` names; call while those files
    still exist (before the CreateJob call's shared-memory session ends). Returns whether
    RANNC_SAVE_JOB asked for it."""
    out = directory()
    if not out:
        return False
    os.makedirs(out, exist_ok=True)
    named = [t.tensor for t in spec.model_tensors] + list(spec.example_inputs)
    for path in sorted({t.shm.path for t in named if t.HasField("shm")}):
        shutil.copyfile(path, os.path.join(out, os.path.basename(path)))
    with open(os.path.join(out, "job.pb"), "wb") as f:
        f.write(spec.SerializeToString())
    with open(os.path.join(out, "model.pt"), "wb") as f:
        f.write(model_bytes)
    logger.info("pyrannc: saved the job to %s (RANNC_SAVE_JOB)", out)
    return True


def save_forward(request, inputs) -> None:
    """Writes forward.pb: `request` (a ForwardRequest) with `inputs` inline instead of its
    shared-memory references, which the next call reuses."""
    out = directory()
    if not out:
        return
    saved = type(request)()
    saved.CopyFrom(request)
    del saved.inputs[:]
    saved.inputs.extend(_codec.encode(x) for x in inputs)
    saved.ClearField("before")
    saved.ClearField("reply_shm")
    with open(os.path.join(out, "forward.pb"), "wb") as f:
        f.write(saved.SerializeToString())
