"""Writes the hand-made seeds of fuzz/corpus/tensor_codec (run from the repository root with
/usr/bin/python3; the checked-in files are its output). Each seed is frames of a little-endian
uint32 length and a serialized message: a rannc.v1.Tensor, then rannc.v1.StateDictChunks."""

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
os.makedirs(OUT, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"{len(seeds)} seeds in {OUT}")
