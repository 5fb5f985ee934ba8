"""Writes the hand-made seeds of fuzz/corpus/tensor_codec and fuzz/corpus/rpc (run from the
repository root with /usr/bin/python3; the checked-in files are its output).

tensor_codec: frames of a little-endian uint32 length and a serialized message: a
rannc.v1.Tensor, then rannc.v1.StateDictChunks.
rpc: a byte picking the method (rpc_fuzzer.cc's switch), then the request; requests that name
no job reach the target's live job (the mlp fixture: x float32 [5, 6], y int64 [5] -> a loss;
parameters fc1.weight, fc1.bias, fc2.weight, fc2.bias). A call that streams requests takes them
as frames of a little-endian uint16 length and a serialized request; its CreateJob seeds send
fuzz/corpus/torchscript_import/mlp.pt (the fixture's archive) as the model."""

import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "python_client"))
from pyrannc.proto.rannc.v1 import training_pb2 as pb  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tensor_codec")


def frames(*messages):
    return b"".join(struct.pack("<I", len(m)) + m
                    for m in (x if isinstance(x, bytes) else x.SerializeToString()
                              for x in messages))


def chunk(name, dtype, shape, data, offset=0, total=None, is_buffer=False):
    return pb.StateDictChunk(name=name, dtype=dtype, shape=shape, data=data, offset=offset,
                             total_bytes=len(data) if total is None else total,
                             is_buffer=is_buffer)


F32 = pb.FLOAT32
SHM = "/tmp/rannc-fuzz-shm/rannc-fuzz"  # the fuzzer's shared-memory file
seeds = {
    "inline-f32": frames(pb.Tensor(dtype=F32, shape=[2, 3], data=bytes(24))),
    "inline-empty": frames(pb.Tensor(dtype=F32, shape=[0, 5])),
    "inline-scalar-i64": frames(pb.Tensor(dtype=pb.INT64, data=bytes(8))),
    "inline-short": frames(pb.Tensor(dtype=F32, shape=[4], data=bytes(3))),
    "shm-region": frames(pb.Tensor(dtype=F32, shape=[4], shm=pb.ShmRef(
        path=SHM, offset=64, length=16))),
    "shm-outside": frames(pb.Tensor(dtype=F32, shape=[1 << 20], shm=pb.ShmRef(
        path=SHM, offset=0, length=4 << 20))),
    "shm-escape": frames(pb.Tensor(dtype=F32, shape=[4], shm=pb.ShmRef(
        path="/tmp/rannc-fuzz-shm/rannc-../../etc/passwd", offset=0, length=16))),
    "state-two-entries": frames(
        pb.Tensor(dtype=F32, shape=[1], data=bytes(4)),
        chunk("w", F32, [2, 2], bytes(8), total=16),
        chunk("b", F32, [2], bytes(8), is_buffer=True),
        chunk("w", F32, [2, 2], bytes(8), offset=8, total=16)),
    "state-incomplete": frames(b"", chunk("w", F32, [4], bytes(8), total=16)),
    "state-repeated": frames(b"", chunk("w", F32, [1], bytes(4)), chunk("w", F32, [1], bytes(4))),
    "state-bf16-f16": frames(b"", chunk("h", pb.FLOAT16, [3], bytes(6)),
                             chunk("g", pb.BFLOAT16, [1, 1], bytes(2))),
}


def rpc(method, request=None):
    return bytes([method]) + (request.SerializeToString() if request is not None else b"")


def stream(method, *requests):
    out = bytes([method])
    for r in requests:
        data = r.SerializeToString()
        out += struct.pack("<H", len(data)) + data
    return out


def f32(shape, value=0.5):
    n = 1
    for d in shape:
        n *= d
    return pb.Tensor(dtype=F32, shape=shape, data=struct.pack(f"<{n}f", *([value] * n)))


X, Y = f32([5, 6]), pb.Tensor(dtype=pb.INT64, shape=[5], data=struct.pack("<5q", 0, 1, 2, 0, 1))
rpc_seeds = {
    "get-info": rpc(0, pb.GetInfoRequest()),
    "join": rpc(1, pb.JoinJobRequest(name="fuzz", client_world=1, timeout_ms=100)),
    "barrier": rpc(2, pb.ClientBarrierRequest(name="fuzz", client_rank=0, client_world=2,
                                              timeout_ms=100)),
    "list-jobs": rpc(3, pb.Empty()),
    "renew": rpc(4, pb.RenewLeasesRequest(job_ids=["nope", ""])),
    "forward": rpc(5, pb.ForwardRequest(inputs=[X, Y], requires_grad=True)),
    "forward-wrong-shape": rpc(5, pb.ForwardRequest(inputs=[f32([5, 7]), Y])),
    "forward-no-grad": rpc(5, pb.ForwardRequest(inputs=[X, Y], requires_grad=False)),
    "backward": rpc(6, pb.BackwardRequest(grads=[pb.OutputGrad(output_index=0,
                                                                grad=f32([], 1.0))])),
    "step": rpc(7, pb.StepRequest(groups=[pb.HyperParams(lr=0.1, momentum=0.9)])),
    "zero-grad": rpc(8, pb.ZeroGradRequest(set_to_none=True)),
    "clip": rpc(9, pb.ClipGradNormRequest(max_norm=1.0, norm_type=2.0)),
    "allreduce": rpc(10, pb.AllReduceGradsRequest()),
    "flush": rpc(11, pb.FlushRequest()),
    "get-param": rpc(12, pb.GetParamRequest(name="fc1.weight")),
    "get-grad": rpc(12, pb.GetParamRequest(name="fc2.bias", grad=True)),
    "set-mode": rpc(13, pb.SetModeRequest(mode=pb.Mode(training=False))),
    "recreate": rpc(14, pb.JobRef()),
    "locate": rpc(15, pb.LocateJobRequest(name="fuzz")),
    "checkpoint": rpc(16, pb.CheckpointRequest(wait=True)),
    "list-checkpoints": rpc(17, pb.CheckpointsRef()),
    "detached-status": rpc(18, pb.JobRef()),
    "delete-other": rpc(19, pb.JobRef(job_id="job-0000")),
    "undeploy-other": rpc(20, pb.JobRef(job_id="job-0000")),
}

MLP = open(os.path.join(os.path.dirname(OUT), "torchscript_import", "mlp.pt"), "rb").read()
SPEC = pb.JobSpec(name="fuzz-made", mode=pb.Mode(training=True), example_inputs=[X, Y],
                  optimizer=pb.OptimizerSpec(type=pb.SGD), model_bytes=len(MLP))
half = len(MLP) // 2
W1 = "fc1.weight"
rpc_seeds.update({
    "create-job": stream(21, pb.CreateJobRequest(spec=SPEC),
                         pb.CreateJobRequest(model_chunk=MLP[:half]),
                         pb.CreateJobRequest(model_chunk=MLP[half:])),
    "create-job-short": stream(21, pb.CreateJobRequest(spec=SPEC),
                               pb.CreateJobRequest(model_chunk=MLP[:half])),
    "create-job-chunk-first": stream(21, pb.CreateJobRequest(model_chunk=MLP[:half]),
                                     pb.CreateJobRequest(spec=SPEC)),
    "add-mode": stream(22, pb.AddModeRequest(header=pb.AddModeRequest.Header(
        mode=pb.Mode(training=False), model_bytes=len(MLP))),
        pb.AddModeRequest(model_chunk=MLP)),
    "state-dict": rpc(23, pb.StateDictRequest()),
    "load-state-dict": stream(24, pb.LoadStateDictRequest(
        header=pb.LoadStateDictRequest.Header(strict=False)),
        pb.LoadStateDictRequest(chunk=chunk(W1, F32, [8, 6], bytes(96), total=192)),
        pb.LoadStateDictRequest(chunk=chunk(W1, F32, [8, 6], bytes(96), offset=96, total=192))),
    "load-state-dict-gap": stream(24, pb.LoadStateDictRequest(
        header=pb.LoadStateDictRequest.Header(strict=True)),
        pb.LoadStateDictRequest(chunk=chunk(W1, F32, [8, 6], bytes(96), offset=96, total=192))),
    "optimizer-state": rpc(25, pb.JobRef()),
    "load-optimizer-state": stream(26, pb.LoadStateDictRequest(
        header=pb.LoadStateDictRequest.Header()),
        pb.LoadStateDictRequest(chunk=pb.StateDictChunk(
            name=W1, state_key="momentum_buffer", dtype=F32, shape=[8, 6], data=bytes(192),
            total_bytes=192))),
    "export-checkpoint": rpc(27, pb.CheckpointsRef(step=3)),
    "detached-logs": rpc(28, pb.DetachedLogsRequest(follow=True)),
    "list-detached": rpc(29, pb.Empty()),
})

for out, written in ((OUT, seeds), (os.path.join(os.path.dirname(OUT), "rpc"), rpc_seeds)):
    os.makedirs(out, exist_ok=True)
    for name, data in written.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(written)} seeds in {out}")
