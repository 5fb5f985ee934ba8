"""The process-wide connection to ranncd: finding or starting it, calling it, stopping it.

One channel per process, created on first use by `connection()` (thread-safe). With the client
key `daemon` set (RANNC_DAEMON=host:port), pyrannc connects there. Otherwise it starts an
embedded `ranncd` on a free loopback port with `--devices` from the daemon key `devices`
(default `cpu:2`, not ranncd's own default) plus the flags in `daemon_args`, writes its output
to `daemon_log` if set, and stops it at interpreter exit (SIGTERM, then SIGKILL after
`daemon_stop_timeout` seconds). The daemon binary is the `daemon_bin` key, else Bazel's
`bazel-bin/daemon/ranncd` under the repository this package lives in, else `ranncd` on PATH
(pyrannc._binaries). Every key is read through pyrannc._config: its RANNC_<KEY> environment
variable (RANNC_DEVICES, RANNC_DAEMON_ARGS, ...) wins over rannc.toml.

Every RPC goes through `Connection.call`/`Connection.stream`, which turn gRPC errors into
RanncError carrying the status code and the daemon's message.
"""

import atexit
import collections
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Union

import grpc
import torch

from pyrannc import _config, _shm
from pyrannc._binaries import find_daemon_binary
from pyrannc.errors import JobMoved, RanncError, from_rpc_error
from pyrannc.proto.rannc.v1 import training_pb2 as pb
from pyrannc.proto.rannc.v1 import training_pb2_grpc as pb_grpc

logger = logging.getLogger("pyrannc")
daemon_logger = logging.getLogger("pyrannc.ranncd")

# The codes after which a mutating call is sent again (Connection._with_retries).
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

_DEFAULT_DEVICES = "cpu:2"
_CHANNEL_OPTIONS = [
    # The daemon enforces its own --max-message-size; the client must not cut in first.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


_TLS_KEYS = ("tls_ca", "tls_cert", "tls_key")


def _tls_files() -> Dict[str, str]:
    """The TLS files the client config names (tls_ca: the CA to verify ranncd with; tls_cert and
    tls_key: a client certificate to present), by key; empty for plain text."""
    return {key: path for key in _TLS_KEYS if (path := _config.client_setting(key).strip())}


def _token() -> str:
    """The token the client config names (token, else the first line of token_file); "" for
    none."""
    token = _config.client_setting("token").strip()
    if token:
        return token
    path = _config.client_setting("token_file").strip()
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except OSError as err:
        where = _config.client_setting_from("token_file")[1]
        raise RanncError(f"pyrannc: cannot read the token file of {where}: {err}") from None


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a plain-text channel (over TLS the
    token travels as call credentials instead)."""

    def __init__(self, token: str):
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = list(details.metadata or []) + [self._entry]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def make_channel(address: str, plain: bool = False) -> grpc.Channel:
    """A channel to the ranncd at `address`: TLS when the client config names TLS files (read
    now: a new channel uses rotated files), plain text otherwise or when `plain` (the embedded
    daemon); every call carries the config's token (token, token_file), if any. A file that
    cannot be read is a RanncError naming its key and path."""
    files = {} if plain else _tls_files()
    token = "" if plain else _token()
    if not files:
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        return grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel
    if ("tls_cert" in files) != ("tls_key" in files):
        raise RanncError("pyrannc: give tls_cert and tls_key together (RANNC_TLS_CERT, "
                         "RANNC_TLS_KEY: a client certificate and its private key)")
    pem = {}
    for key, path in files.items():
        try:
            with open(path, "rb") as f:
                pem[key] = f.read()
        except OSError as err:
            where = _config.client_setting_from(key)[1]
            raise RanncError(f"pyrannc: cannot read the TLS file of {where}: {err}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.get("tls_ca"),
                                               private_key=pem.get("tls_key"),
                                               certificate_chain=pem.get("tls_cert"))
    if token:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)


def _tls_hint() -> str:
    """What to check when a daemon does not answer: its TLS, as much as its being there."""
    if _tls_files():
        return (" (TLS: RANNC_TLS_CA must name the CA that signed ranncd's certificate, which "
                "must name the address dialled; a ranncd without --tls-cert speaks plain text)")
    return (" (a ranncd started with --tls-cert speaks TLS only: set RANNC_TLS_CA to the CA that "
            "signed its certificate)")


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _major_minor(version: str):
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_torch_version(daemon_version: str, client_version: str = torch.__version__) -> None:
    daemon_mm = _major_minor(daemon_version)
    client_mm = _major_minor(client_version)
    if daemon_mm is None:
        raise RanncError(f"ranncd reported no usable PyTorch version ({daemon_version!r}); "
                         f"cannot check that it can run models traced by PyTorch {client_version}")
    if daemon_mm != client_mm:
        raise RanncError(
            f"ranncd runs LibTorch {daemon_version} but this client has PyTorch "
            f"{client_version}; TorchScript models only load reliably within one major.minor "
            f"version. Use a PyTorch {daemon_mm[0]}.{daemon_mm[1]} client or a matching ranncd.")


class EmbeddedSettings(NamedTuple):
    """How pyrannc starts and stops its embedded ranncd, read once before it starts."""
    devices: str
    flags: List[str]
    log_path: str
    start_timeout: float
    stop_timeout: float
    origin: str  # where devices and flags came from, for a failed start's message


def embedded_settings() -> EmbeddedSettings:
    """The embedded daemon's settings (ValueError, naming the source, for a bad one). ranncd
    reads rannc.toml too, but --devices must be given: pyrannc's default is not ranncd's."""
    devices, devices_from = _config.client_setting_from("devices")
    flags = _config.client_flags("daemon_args")
    flags_from = _config.client_setting_from("daemon_args")[1] if flags else ""
    origin = "; ".join(f"{what} from {where}" for what, where in
                       (("devices", devices_from), ("flags", flags_from)) if where)
    return EmbeddedSettings(
        devices=devices.strip() or _DEFAULT_DEVICES, flags=flags,
        log_path=os.path.expanduser(_config.client_setting("daemon_log")),
        start_timeout=_config.client_seconds("daemon_start_timeout", 120.0),
        stop_timeout=_config.client_seconds("daemon_stop_timeout", 10.0),
        origin=f" ({origin})" if origin else "")


class _EmbeddedDaemon:
    """A ranncd child process; its output is kept (last lines) for error messages."""

    def __init__(self, binary: str, address: str, settings: EmbeddedSettings):
        self.address = address
        # Private to this process, it keeps no durable jobs (daemon_args may still ask), and
        # serves plain text on loopback without tokens: the client's TLS keys (RANNC_TLS_CA,
        # ...), which name a remote daemon's CA, are not its own.
        # Stopped (by stop() or, its client gone, by the kernel's SIGTERM), it exits within the
        # client's daemon_stop_timeout even in the middle of a step, with no client to wait for.
        self.args = [binary, "--listen", address, "--devices", settings.devices,
                     "--state-dir", "none", "--tls-cert=", "--tls-key=", "--tls-ca=",
                     "--auth-token-file=",
                     f"--stop-timeout={max(1, int(settings.stop_timeout * 1000))}ms"]
        self.args += settings.flags
        self.stop_timeout = settings.stop_timeout
        self.tail = collections.deque(maxlen=200)
        self.owner_pid = os.getpid()
        try:
            self._log_file = (open(settings.log_path, "a", encoding="utf-8")
                              if settings.log_path else None)
        except OSError as err:
            where = _config.client_setting_from("daemon_log")[1]
            raise RanncError(f"pyrannc cannot write the embedded ranncd's log ({where}): "
                             f"{err}") from None
        command = self.args
        setpriv = shutil.which("setpriv")
        # If the client dies without running atexit (SIGKILL), the kernel stops the daemon. The
        # signal follows the thread that spawned it, so only the main thread asks for it.
        if setpriv and threading.current_thread() is threading.main_thread():
            command = [setpriv, "--pdeathsig", "TERM", "--"] + self.args
        # A new session keeps a terminal's Ctrl-C away from the daemon, so the client can still
        # talk to it while it unwinds.
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read_output, name="ranncd-log", daemon=True)
        self._reader.start()

    def _read_output(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if self._log_file:
                self._log_file.write(line + "\n")
                self._log_file.flush()
            daemon_logger.debug("%s", line)

    def exited(self) -> Optional[int]:
        return self.proc.poll()

    def describe_exit(self) -> str:
        # Give the reader thread a moment to drain what the process printed before dying.
        self._reader.join(timeout=1.0)
        lines = "\n".join(list(self.tail)[-30:])
        return (f"embedded ranncd ({' '.join(self.args)}) exited with status "
                f"{self.proc.returncode}; its last output:\n{lines}")

    def stop(self, timeout: float):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=1.0)
        if self._log_file:
            self._log_file.close()


class Connection:
    """A channel to one ranncd, its stub, and the daemon's DaemonInfo."""

    def __init__(self, address: str, embedded: Optional[_EmbeddedDaemon] = None):
        self.address = address
        self.embedded = embedded
        self.channel = make_channel(address, plain=embedded is not None)
        self.stub = pb_grpc.TrainingServiceStub(self.channel)
        self.info: Optional[pb.DaemonInfo] = None
        # Same-host shared-memory transfer; set once the daemon answered (see _shm).
        self.shm: Optional[_shm.Transfer] = None
        self.closed = False
        # Jobs whose lease (JobOptions.lease_ms) this connection renews: id -> lease seconds.
        # Plain dict operations, atomic under the GIL: release_lease may run in a finalizer.
        self._leases: Dict[str, float] = {}
        self._renewer: Optional[threading.Thread] = None
        self._renewer_lock = threading.Lock()
        self._stop_renewing = threading.Event()
        self._calls = threading.local()  # _next_call_id's, per thread

    def hold_lease(self, job_id: str, lease_s: float) -> None:
        """Renews the job's lease from a thread of this connection, every fifth of the lease,
        until release_lease (or the daemon no longer knows the job, or the connection closes).
        While this process lives its jobs stay; once it is gone the daemon deletes them."""
        if lease_s <= 0:
            return
        self._leases[job_id] = lease_s
        with self._renewer_lock:
            if self._renewer is None and not self.closed:
                self._renewer = threading.Thread(target=self._renew_leases, daemon=True,
                                                 name="pyrannc-leases")
                self._renewer.start()

    def release_lease(self, job_id: str) -> None:
        self._leases.pop(job_id, None)

    def _renew_leases(self) -> None:
        while True:
            leases = dict(self._leases)
            interval = min(leases.values()) / 5 if leases else 1.0
            if self._stop_renewing.wait(interval):
                return
            leases = dict(self._leases)
            if not leases:
                continue
            try:
                resp = self.stub.RenewLeases(pb.RenewLeasesRequest(job_ids=list(leases)),
                                             timeout=max(interval, 1.0))
            except grpc.RpcError as err:  # the next round tries again
                logger.debug("pyrannc: renewing job leases at %s: %s", self.address,
                             err.details())
                continue
            for job_id in resp.unknown:
                self._leases.pop(job_id, None)

    def _hint(self, err: grpc.RpcError) -> str:
        if self.embedded is not None and self.embedded.exited() is not None:
            return self.embedded.describe_exit()
        # Not when the daemon answered about another one of its cluster (a lost member).
        if err.code() == grpc.StatusCode.UNAVAILABLE and "daemon " not in (err.details() or ""):
            return f"(is ranncd still running at {self.address}?)"
        return ""

    def call(self, method: str, request, timeout: Optional[float] = None):
        """Calls `method`. A mutating call (its request has a CallId field, `call`) is numbered
        and retried after a lost answer (see _with_retries): the daemon applies it once."""
        rpc = getattr(self.stub, method)
        if "call" in request.DESCRIPTOR.fields_by_name:
            request.call.CopyFrom(self._next_call_id())
            job_id = getattr(request, "job_id", "")
            return self._with_retries(method, lambda: rpc(request, timeout=timeout), job_id)
        try:
            return rpc(request, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(method, err, self._hint(err)) from None

    def call_streaming_request(self, method: str,
                               requests: Union[Iterable, Callable[[pb.CallId], Iterable]]):
        """A client-streamed call; `requests` may be a function of the call's CallId making the
        stream, for a mutating call that is retried like call()'s."""
        rpc = getattr(self.stub, method)
        if callable(requests):
            call_id = self._next_call_id()
            return self._with_retries(method, lambda: rpc(iter(requests(call_id))))
        try:
            return rpc(iter(requests))
        except grpc.RpcError as err:
            raise from_rpc_error(method, err, self._hint(err)) from None

    def _next_call_id(self) -> pb.CallId:
        """This thread's client id on this connection and its next sequence number."""
        local = self._calls
        if not hasattr(local, "client_id"):
            local.client_id, local.seq = uuid.uuid4().hex, 0
        local.seq += 1
        return pb.CallId(client_id=local.client_id, seq=local.seq)

    def _with_retries(self, method: str, attempt: Callable, job_id: str = ""):
        """Runs `attempt` (one call with a fixed CallId) until it gets an answer: the daemon
        unreachable (UNAVAILABLE) or a deadline passed is retried with backoff for up to
        call_retry_timeout seconds (RANNC_CALL_RETRY_TIMEOUT, default 30; 0: no retries), then
        raised with its cause. An error the daemon answers from its record of the call
        (metadata rannc-replayed) is the call's own, raised at once. Between retries, a job of a
        cluster with a registry (`watch_for_moves`) is looked for on the other daemons: taken
        over by one of them, it raises JobMoved."""
        deadline = None
        delay = 0.05
        while True:
            try:
                return attempt()
            except grpc.RpcError as err:
                replayed = any(k == "rannc-replayed" for k, _ in err.trailing_metadata() or ())
                gone = self.embedded is not None and self.embedded.exited() is not None
                # A job of a cluster's registry may move: its daemon is lost (UNAVAILABLE), or
                # lost a part and brings the job back under a new id (the call's own answer,
                # replayed, is UNAVAILABLE until then; the old id NOT_FOUND after).
                watched = bool(job_id) and _is_watched(job_id)
                if watched and (err.code() in _RETRIED or
                                err.code() == grpc.StatusCode.NOT_FOUND):
                    _raise_if_moved(job_id, self.address)
                    watched = _is_watched(job_id)  # no longer, when it is in no registry
                if (err.code() in _RETRIED and (not replayed or watched) and not gone):
                    if deadline is None:
                        deadline = time.monotonic() + _config.client_seconds(
                            "call_retry_timeout", 30.0)
                    if time.monotonic() + delay < deadline:
                        logger.warning("pyrannc: %s: %s (%s); retrying, the daemon applies "
                                       "it once", method, err.code().name, err.details())
                        time.sleep(delay)
                        delay = min(2 * delay, 2.0)
                        continue
                raise from_rpc_error(method, err, self._hint(err)) from None

    def stream(self, method: str, request) -> Iterator:
        try:
            for item in getattr(self.stub, method)(request):
                yield item
        except grpc.RpcError as err:
            raise from_rpc_error(method, err, self._hint(err)) from None

    def wait_ready(self, deadline: float, alive: Callable[[], None]) -> pb.DaemonInfo:
        last_error = None
        fresh_at = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            alive()
            try:
                self.info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=2.0)
                return self.info
            except grpc.RpcError as err:
                # (CANCELLED: a stopping daemon's answer; it may come back.)
                if err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED,
                                      grpc.StatusCode.CANCELLED):
                    raise from_rpc_error("GetInfo", err) from None
                last_error = err
            if time.monotonic() >= fresh_at:
                # A channel that failed to connect waits out gRPC's reconnect backoff (seconds)
                # even once the daemon listens; a new one connects at once.
                self.channel.close()
                self.channel = make_channel(self.address, plain=self.embedded is not None)
                self.stub = pb_grpc.TrainingServiceStub(self.channel)
                fresh_at = time.monotonic() + 0.5
            time.sleep(0.1)
        detail = last_error.details() if last_error is not None else "no answer"
        raise RanncError(f"ranncd at {self.address} did not answer GetInfo in time: {detail}"
                         f"{_tls_hint() if self.embedded is None else ''}",
                         code=grpc.StatusCode.DEADLINE_EXCEEDED, details=detail)

    def close(self):
        self._stop_renewing.set()
        if not self.closed:
            self.closed = True
            self.channel.close()
            if self.shm is not None:
                self.shm.close()


_lock = threading.Lock()
_connection: Optional[Connection] = None
_others: Dict[str, Connection] = {}  # other daemons of the cluster, by address


def _start_embedded() -> Connection:
    binary = find_daemon_binary()
    settings = embedded_settings()
    last_failure = ""
    # A port picked free may be taken before the daemon binds it; try a few.
    for _ in range(3):
        address = f"127.0.0.1:{_free_loopback_port()}"
        daemon = _EmbeddedDaemon(binary, address, settings)
        conn = Connection(address, daemon)

        def alive():
            if daemon.exited() is not None:
                raise RanncError(daemon.describe_exit())

        try:
            conn.wait_ready(time.monotonic() + settings.start_timeout, alive)
            logger.info("pyrannc started ranncd at %s (pid %d)", address, daemon.proc.pid)
            return conn
        except RanncError as err:
            conn.close()
            daemon.stop(timeout=5.0)
            last_failure = str(err)
            if "address already in use" not in last_failure.lower() and \
                    "bind" not in last_failure.lower():
                break
    raise RanncError(f"pyrannc could not start ranncd{settings.origin}: {last_failure}")


def _shutdown():
    global _connection
    with _lock:
        conn, _connection = _connection, None
        others = list(_others.values())
        _others.clear()
    for other in others:
        other.close()
    if conn is None:
        return
    conn.close()
    # A forked child inherits the connection but not the daemon: only its starter stops it.
    if conn.embedded is not None and conn.embedded.owner_pid == os.getpid():
        conn.embedded.stop(timeout=conn.embedded.stop_timeout)


def _connect(address: str, what: str) -> Connection:
    """A ready connection to the ranncd at `address` (`what` names where it came from)."""
    timeout = _config.client_seconds("daemon_connect_timeout", 30.0)
    conn = Connection(address)
    try:
        conn.wait_ready(time.monotonic() + timeout, lambda: None)
    except RanncError as err:
        conn.close()
        raise RanncError(f"pyrannc cannot reach ranncd at {address} ({what}): {err}",
                         code=err.code, details=err.details) from None
    return conn


def configured_addresses() -> List[str]:
    """The `daemon` key as a list: RANNC_DAEMON=host:port, or several, comma-separated (daemons
    of one cluster: the first that answers is used, and the others are where a job is looked for
    when its daemon is lost)."""
    return [a.strip() for a in _config.client_setting("daemon").split(",") if a.strip()]


def _connect_any(addresses: List[str], what: str) -> Connection:
    """A ready connection to the first of `addresses` that answers (asking each in turn, two
    seconds at a time, for up to daemon_connect_timeout)."""
    if len(addresses) == 1:
        return _connect(addresses[0], what)
    timeout = _config.client_seconds("daemon_connect_timeout", 30.0)
    deadline = time.monotonic() + timeout
    failures = {}
    while True:
        for address in addresses:
            conn = Connection(address)
            try:
                conn.wait_ready(min(deadline, time.monotonic() + 2.0), lambda: None)
                return conn
            except RanncError as err:
                conn.close()
                failures[address] = err.details or str(err)
        if time.monotonic() >= deadline:
            tried = "; ".join(f"{a}: {why}" for a, why in failures.items())
            raise RanncError(f"pyrannc cannot reach any ranncd of {', '.join(addresses)} "
                             f"({what}): {tried}", code=grpc.StatusCode.UNAVAILABLE,
                             details=tried)


# Jobs to look for on the other daemons when their own is lost (a cluster with --cluster-store
# takes them over): job id -> (job name, what to call with the RegisteredJob once moved).
_watched: Dict[str, tuple] = {}
_watched_lock = threading.Lock()


def watch_for_moves(job_id: str, name: str, on_moved: Callable) -> None:
    with _watched_lock:
        _watched[job_id] = (name, on_moved)


def _is_watched(job_id: str) -> bool:
    with _watched_lock:
        return job_id in _watched


def stop_watching(job_id: str) -> None:
    with _watched_lock:
        _watched.pop(job_id, None)


def _other_addresses(lost: str) -> List[str]:
    """Where a job may be: the configured daemons and every cluster member the daemons reported
    (GetInfo), `lost` last (it may be up, having brought the job back under a new id)."""
    seen = []
    conns = [c for c in [_connection] + list(_others.values()) if c is not None]
    for address in configured_addresses() + [m.address for c in conns if c.info is not None
                                            for m in c.info.cluster]:
        if address and address != lost and address not in seen:
            seen.append(address)
    return seen + [lost]


_NOT_REGISTERED = object()


def locate_job(name: str, lost: str):
    """The registry's entry of the job `name`, from the first daemon that answers; None when
    none answers, _NOT_REGISTERED when the job is in no registry (nothing will move it)."""
    for address in _other_addresses(lost):
        channel = make_channel(address)
        try:
            return pb_grpc.TrainingServiceStub(channel).LocateJob(
                pb.LocateJobRequest(name=name), timeout=2.0)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return _NOT_REGISTERED
        finally:
            channel.close()
    return None


def _raise_if_moved(job_id: str, lost: str) -> None:
    """Raises JobMoved when the job `job_id`, whose daemon at `lost` does not answer, runs
    elsewhere now (taken over under a new id), after rebinding its module there."""
    with _watched_lock:
        watched = _watched.get(job_id)
    if watched is None:
        return
    name, on_moved = watched
    located = locate_job(name, lost)
    if located is _NOT_REGISTERED:
        stop_watching(job_id)  # a job of no registry: its calls fail as they always did
        return
    if located is None or located.job_id == job_id or not located.leader:
        return  # not taken over (yet)
    stop_watching(job_id)
    on_moved(located)
    step = max(located.resumed_step, 0)
    what = (f"job '{name}' ({job_id}) lost a daemon it ran on; ranncd at {lost} brought it back"
            if located.leader == lost else
            f"ranncd at {lost} leading job '{name}' ({job_id}) was lost; the daemon at "
            f"{located.leader} took it over")
    raise JobMoved(f"{what} as {located.job_id} from its checkpoint of step {step}: go on from "
                   f"that step", name, located.job_id, located.leader, step)


def connection(address: Optional[str] = None) -> Connection:
    """The process's connection, connecting (or starting the embedded daemon) on first use.

    With `address`, a connection to that daemon of the cluster instead (a job led by another
    daemon than RANNC_DAEMON: JoinJob names it)."""
    global _connection
    if address is not None:
        default = connection()
        if default.address == address:
            return default
        with _lock:
            conn = _others.get(address)
            if conn is None:
                conn = _connect(address, "the daemon leading the job")
                try:
                    check_torch_version(conn.info.torch_version)
                    conn.shm = _shm.make_transfer(conn.address, conn.info, False)
                except Exception:  # a RanncError, or a bad shm setting
                    conn.close()
                    raise
                _others[address] = conn
            return conn
    with _lock:
        if _connection is not None:
            return _connection
        address, where = _config.client_setting_from("daemon")
        if address:
            conn = _connect_any(configured_addresses(), where)
        else:
            conn = _start_embedded()
        try:
            check_torch_version(conn.info.torch_version)
            conn.shm = _shm.make_transfer(conn.address, conn.info, conn.embedded is not None)
        except Exception:  # a RanncError, or a bad shm setting
            conn.close()
            if conn.embedded is not None:
                conn.embedded.stop(timeout=5.0)
            raise
        _connection = conn
        return conn


def current_connection() -> Optional[Connection]:
    """The connection if one was made, without making one."""
    return _connection


def shutdown() -> None:
    """Closes the channel and stops an embedded daemon. A later call connects afresh."""
    _shutdown()


atexit.register(_shutdown)
