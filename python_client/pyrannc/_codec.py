"""Conversion between torch tensors and the wire's Tensor / StateDictChunk messages.

The wire carries contiguous little-endian bytes; this host's byte order is checked at import.
"""

import math
import sys
import threading
import weakref
from typing import Dict, Iterator, Tuple

import numpy
import torch

from pyrannc.proto.rannc.v1 import training_pb2 as pb

if sys.byteorder != "little":
    raise ImportError("pyrannc sends raw little-endian tensor bytes; big-endian hosts are not "
                      "supported")

_TO_WIRE = {
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.int16: pb.INT16,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.bool: pb.BOOL,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}

# Streams keep each message well under gRPC's default limits and the daemon's
# --max-message-size.
STREAM_CHUNK_BYTES = 4 << 20
MODEL_CHUNK_BYTES = 1 << 20


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise TypeError(f"pyrannc cannot send tensors of dtype {dtype}; supported: "
                        f"{', '.join(str(d) for d in _TO_WIRE)}") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise ValueError(f"ranncd sent a tensor of unsupported dtype {wire}") from None


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


def numpy_view(t: torch.Tensor):
    """A numpy array sharing `t`'s bytes (t must be host-contiguous)."""
    # numpy has no bfloat16; the bytes are the same through an int16 view.
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return numpy_view(host_contiguous(t)).tobytes()


def encode(t: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(dtype=wire_dtype(t.dtype), shape=list(t.shape), data=tensor_bytes(t))


def from_bytes(data, dtype: torch.dtype, shape) -> torch.Tensor:
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"tensor of dtype {dtype} and shape {list(shape)} needs {expected} bytes, "
                         f"got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # torch wants a writable buffer, and the tensor keeps it alive.
    if not isinstance(data, bytearray):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


class _ReceivePool:
    """Reusable host buffers for large tensors received from the daemon.

    New memory costs a page fault per 4 KiB on first touch, which on some VMs is slower than
    the copy itself (measured here: 16 MiB into a new tensor 33 ms, into a reused one 2.4 ms).
    Outputs of the same size arrive every step, so a buffer goes back to the pool once every
    tensor using it has died (a finalizer on the numpy view the tensor holds), and the next
    output lands in memory that is already mapped. Thread-safe.
    """

    MIN_BYTES = 1 << 20

    def __init__(self, max_cached_bytes: int = 1 << 30):
        self._max = max_cached_bytes
        self._free: Dict[int, list] = {}
        self._cached = 0
        self._lock = threading.Lock()

    def empty(self, dtype: torch.dtype, shape) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        bucket = 1 << (nbytes - 1).bit_length()
        with self._lock:
            idle = self._free.get(bucket)
            buf = idle.pop() if idle else None
            if buf is not None:
                self._cached -= bucket
        if buf is None:
            buf = numpy.empty(bucket, dtype=numpy.uint8)
        view = buf[:nbytes]
        weakref.finalize(view, self._release, bucket, buf)
        return torch.from_numpy(view).view(dtype).reshape(shape)

    def _release(self, bucket: int, buf) -> None:
        with self._lock:
            if self._cached + bucket <= self._max:
                self._free.setdefault(bucket, []).append(buf)
                self._cached += bucket


_receive_pool = _ReceivePool()


def _read_shm(ref: pb.ShmRef, dtype: torch.dtype, shape) -> torch.Tensor:
    """Reads a tensor the daemon wrote into shared memory straight into a pooled tensor: one
    copy, into memory that is usually mapped already."""
    t = _receive_pool.empty(dtype, tuple(int(s) for s in shape))
    nbytes = t.numel() * t.element_size()
    if nbytes != ref.length:
        raise ValueError(f"shared-memory region of {ref.length} bytes for a tensor of {nbytes}")
    if nbytes:
        view = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")
        with open(ref.path, "rb", buffering=0) as f:
            f.seek(ref.offset)
            done = 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"shared-memory file {ref.path} is shorter than the "
                                     "tensor it holds")
                done += n
    return t


def decode(msg: pb.Tensor) -> torch.Tensor:
    if msg.HasField("shm"):
        return _read_shm(msg.shm, torch_dtype(msg.dtype), msg.shape)
    return from_bytes(msg.data, torch_dtype(msg.dtype), msg.shape)


def chunk_bytes(limit: int, max_message_bytes: int) -> int:
    """`limit`, made smaller when the daemon's message limit leaves less room (the rest of
    the message needs a little)."""
    if max_message_bytes:
        limit = min(limit, max(4096, max_message_bytes // 2))
    return limit


def state_chunks(name: str, t: torch.Tensor, is_buffer: bool,
                 max_chunk: int = 0) -> Iterator[pb.StateDictChunk]:
    """Splits one tensor into StateDictChunks of at most `max_chunk` (default
    STREAM_CHUNK_BYTES) bytes."""
    step = max_chunk or STREAM_CHUNK_BYTES
    data = tensor_bytes(t)
    dtype = wire_dtype(t.dtype)
    shape = list(t.shape)
    offset = 0
    while True:
        piece = data[offset:offset + step]
        yield pb.StateDictChunk(name=name, dtype=dtype, shape=shape, total_bytes=len(data),
                                offset=offset, data=piece, is_buffer=is_buffer)
        offset += len(piece)
        if offset >= len(data):
            return


class StateAssembler:
    """Reassembles a StateDict stream into tensors, checking that every byte arrives once."""

    def __init__(self):
        self._parts: Dict[str, Tuple[torch.dtype, tuple, bytearray, int, bool]] = {}
        self._order = []

    def add(self, chunk: pb.StateDictChunk) -> None:
        entry = self._parts.get(chunk.name)
        if entry is None:
            entry = (torch_dtype(chunk.dtype), tuple(chunk.shape), bytearray(chunk.total_bytes),
                     0, chunk.is_buffer)
            self._order.append(chunk.name)
        dtype, shape, buf, received, is_buffer = entry
        end = chunk.offset + len(chunk.data)
        if end > len(buf):
            raise ValueError(f"state_dict chunk for '{chunk.name}' ends at byte {end}, past its "
                             f"total of {len(buf)}")
        buf[chunk.offset:end] = chunk.data
        self._parts[chunk.name] = (dtype, shape, buf, received + len(chunk.data), is_buffer)

    def result(self) -> Dict[str, Tuple[torch.Tensor, bool]]:
        """name -> (tensor, is_buffer), in stream order."""
        out = {}
        for name in self._order:
            dtype, shape, buf, received, is_buffer = self._parts[name]
            if received != len(buf):
                raise ValueError(f"state_dict stream for '{name}' carried {received} of "
                                 f"{len(buf)} bytes")
            out[name] = (from_bytes(buf, dtype, shape), is_buffer)
        return out
