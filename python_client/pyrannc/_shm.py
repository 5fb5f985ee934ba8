"""Same-host tensor transfer through shared-memory files, for large inputs, grads and outputs.

gRPC copies a tensor several times on its way through protobuf; a file under the daemon's
DaemonInfo.shm_dir (normally /dev/shm) is one copy each way, and is not bound by the daemon's
--max-message-size. The client owns two files, "rannc-pyrannc-<pid>-<tag>-<n>-in" for tensors it
sends and "...-out" for outputs the daemon writes back; the daemon copies in or out before the
RPC returns, so a region is reused by the next call (see training.proto, Tensor.shm). A one-off
upload (the model's tensors at CreateJob, GiBs) goes to "...-bulk" files of its own (one per
writing thread), removed when the RPC is done (bulk_session). <tag> is random per process:
processes in other PID namespaces (containers, Bazel's sandboxes) share the directory and may
have the same pid.

Used when the daemon offers a directory and runs on this host: the embedded daemon, or a
loopback/unix address whose DaemonInfo.hostname is this host's name. The client key shm
(RANNC_SHM, else rannc.toml) set to false turns it off, set to true forces it on whenever the
daemon offers a directory. Only tensors of at least MIN_BYTES go this way.

Thread-safety: `Transfer` hands its regions to one RPC at a time (`with transfer.session():`);
bulk sessions use files of their own and may overlap them.
"""

import concurrent.futures
import itertools
import os
import secrets
import socket
import threading
from typing import Optional

import torch

from pyrannc import _codec, _config
from pyrannc.proto.rannc.v1 import training_pb2 as pb

MIN_BYTES = 1 << 20
_ALIGN = 64
_counter = itertools.count()
_TAG = secrets.token_hex(4)  # other PID namespaces may reuse this process's pid (module doc)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _File:
    """A client-owned rannc-* file that grows as needed."""

    def __init__(self, directory: str, suffix: str):
        self.path = os.path.join(
            directory, f"rannc-pyrannc-{os.getpid()}-{_TAG}-{next(_counter)}-{suffix}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.size = 0

    def ensure(self, size: int) -> None:
        if size > self.size:
            os.ftruncate(self.fd, size)
            self.size = size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _Session:
    """One RPC's use of the regions: tensors placed for sending, and the reply region."""

    def __init__(self, transfer: "Transfer", bulk_files: Optional[list] = None):
        self._t = transfer
        # None: tensors go to the transfer's send file. A list: a bulk session's own files,
        # made as encode_all needs them and removed by the caller (bulk_session).
        self._bulk_files = bulk_files
        self._next = {}  # per file, the next free offset

    def encode(self, t: torch.Tensor) -> pb.Tensor:
        """A Tensor message, its bytes in the send file when large enough."""
        return self.encode_all([t])[0]

    def _files_for(self, count: int) -> list:
        if self._bulk_files is None:
            return [self._t.send_file()]
        while len(self._bulk_files) < count:
            self._bulk_files.append(_File(self._t.directory, "bulk"))
        return self._bulk_files

    def encode_all(self, tensors, threads: int = 1) -> list:
        """encode() of each tensor. In a bulk session the bytes are spread over up to `threads`
        files, each written by a thread of its own: tmpfs serializes the writes to one file (they
        hold its inode lock while they fault in its new pages), not writes to different files.
        The largest tensors are placed first, each in the least filled file."""
        messages = [None] * len(tensors)
        large = []
        for i, t in enumerate(tensors):
            t = _codec.host_contiguous(t)
            nbytes = t.numel() * t.element_size()
            if nbytes < MIN_BYTES:
                messages[i] = _codec.encode(t)
            else:
                large.append((nbytes, i, t))
        if not large:
            return messages
        files = self._files_for(max(1, min(threads, len(large))))
        writes = {}  # file -> [(tensor, offset, nbytes)]
        for nbytes, i, t in sorted(large, key=lambda item: -item[0]):
            f = min(files, key=lambda f: self._next.get(f, 0))
            offset = self._next.get(f, 0)
            self._next[f] = _align(offset + nbytes)
            writes.setdefault(f, []).append((t, offset, nbytes))
            messages[i] = pb.Tensor(dtype=_codec.wire_dtype(t.dtype), shape=list(t.shape),
                                    shm=pb.ShmRef(path=f.path, offset=offset, length=nbytes))

        def write_file(f):
            f.ensure(self._next[f])
            for t, offset, nbytes in writes[f]:
                view = memoryview(_codec.numpy_view(t)).cast("B")
                done = 0
                while done < nbytes:
                    done += os.pwrite(f.fd, view[done:], offset + done)

        if len(writes) == 1:
            write_file(next(iter(writes)))
        else:
            with concurrent.futures.ThreadPoolExecutor(len(writes)) as pool:
                list(pool.map(write_file, writes))  # os.pwrite releases the GIL
        return messages

    def reply_region(self) -> Optional[pb.ShmRef]:
        """Where the daemon may write outputs; None until outputs large enough were seen."""
        capacity = self._t.reply_capacity
        if capacity == 0:
            return None
        f = self._t.reply_file()
        f.ensure(capacity)
        return pb.ShmRef(path=f.path, offset=0, length=capacity)

    def decode_outputs(self, tensors) -> list:
        """Decodes a reply's tensors (copying out of the reply file) and sizes the reply region
        for the next call from what did not fit."""
        out = [_codec.decode(t) for t in tensors]
        needed = sum(_align(o.numel() * o.element_size()) for o in out
                     if o.numel() * o.element_size() >= MIN_BYTES)
        if needed > self._t.reply_capacity:
            self._t.reply_capacity = needed
        return out


class Transfer:
    def __init__(self, directory: str):
        self.directory = directory
        self._lock = threading.Lock()
        self._send: Optional[_File] = None
        self._reply: Optional[_File] = None
        self.reply_capacity = 0

    def send_file(self) -> _File:
        if self._send is None:
            self._send = _File(self.directory, "in")
        return self._send

    def reply_file(self) -> _File:
        if self._reply is None:
            self._reply = _File(self.directory, "out")
        return self._reply

    def session(self):
        transfer = self

        class _Held:
            def __enter__(self):
                transfer._lock.acquire()
                return _Session(transfer)

            def __exit__(self, *exc):
                transfer._lock.release()

        return _Held()

    def close(self) -> None:
        with self._lock:
            for f in (self._send, self._reply):
                if f is not None:
                    f.close()
            self._send = self._reply = None


class _InlineSession:
    """The session used without shared memory: every byte inline in the messages."""

    @staticmethod
    def encode(t: torch.Tensor) -> pb.Tensor:
        return _codec.encode(t)

    @staticmethod
    def encode_all(tensors, threads: int = 1) -> list:
        return [_codec.encode(t) for t in tensors]

    @staticmethod
    def reply_region() -> Optional[pb.ShmRef]:
        return None

    @staticmethod
    def decode_outputs(tensors) -> list:
        return [_codec.decode(t) for t in tensors]


class _NoLock:
    def __enter__(self):
        return _InlineSession()

    def __exit__(self, *exc):
        return False


def session(transfer: Optional[Transfer]):
    """`with session(conn.shm) as s:` encodes one RPC's tensors, through shm when offered."""
    return transfer.session() if transfer is not None else _NoLock()


class _Bulk:
    def __init__(self, transfer: Transfer):
        self._t = transfer
        self._files: list = []

    def __enter__(self):
        return _Session(self._t, self._files)

    def __exit__(self, *exc):
        for f in self._files:
            f.close()
        return False


def bulk_session(transfer: Optional[Transfer]):
    """Like session(), but tensors go to files of their own that are removed when the block
    ends, so a one-off upload (a model's parameters: GiBs) does not stay in shared memory for the
    connection's life as the reused send file would. Sessions of one transfer may overlap."""
    return _Bulk(transfer) if transfer is not None else _NoLock()


def has_room(transfer: Transfer, nbytes: int) -> bool:
    """Whether the transfer's directory has `nbytes` free (with a 5% margin): tmpfs pages
    written past its size fail the write, so a large upload checks first."""
    try:
        st = os.statvfs(transfer.directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes * 1.05


def _is_local_address(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def make_transfer(address: str, info: pb.DaemonInfo, embedded: bool) -> Optional[Transfer]:
    """A Transfer when shared memory can be used with this daemon, else None. The client key
    shm: unset, only with a daemon on this host; false, never; true, whenever the daemon's
    shm_dir is writable here. ValueError for a bad value."""
    setting = _config.client_bool("shm", None)
    if setting is False or not info.shm_dir:
        return None
    same_host = embedded or (_is_local_address(address)
                             and info.hostname == socket.gethostname())
    if setting is None and not same_host:
        return None
    if not (os.path.isdir(info.shm_dir) and os.access(info.shm_dir, os.W_OK)):
        return None
    return Transfer(info.shm_dir)
