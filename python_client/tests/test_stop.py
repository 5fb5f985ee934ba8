"""How ranncd stops, on real daemons on loopback: on SIGTERM it lets in-flight calls finish (10 s
at most) before it exits, but never takes longer than --stop-timeout, and a second SIGTERM ends
it at once. What the stop waits for here is a call its client holds open: a CreateJob stream
that has sent nothing yet, as a client busy encoding its model (or gone without closing) holds
one. A step of a large model holds the stop the same way, for longer."""

import signal
import threading
import time

import pytest

from conftest import DaemonProcess

pytestmark = pytest.mark.usefixtures("pyrannc_daemon")


class HeldCall:
    """A CreateJob call whose request stream stays open, sending nothing, until released."""

    def __init__(self, daemon: DaemonProcess):
        self._release = threading.Event()

        def requests():
            self._release.wait()
            yield from ()

        self.future = daemon.conn.stub.CreateJob.future(requests())
        time.sleep(1.0)  # the call reaches the daemon's handler, which waits for a message
        assert not self.future.done(), "the held call ended before the test stopped the daemon"

    def release(self):
        self._release.set()


def _stopped_within(daemon: DaemonProcess, seconds: float) -> float:
    """Waits for the daemon's exit; returns the seconds it took, failing after `seconds`."""
    start = time.monotonic()
    deadline = start + seconds
    while daemon.proc.poll() is None:
        assert time.monotonic() < deadline, (
            f"ranncd still running {seconds} s after the signal:\n{daemon.output()}")
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_stop_waits_for_an_in_flight_call_and_exits_cleanly_once_it_ends():
    daemon = DaemonProcess()
    call = HeldCall(daemon)
    try:
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert daemon.proc.poll() is None, "ranncd did not wait for the call in flight"
        call.release()  # the stream ends empty: the handler answers, and the stop goes on
        _stopped_within(daemon, 8)
        assert daemon.proc.returncode == 0, daemon.output()
        assert "stopped" in daemon.output()
    finally:
        call.release()
        daemon.stop()


def test_the_stop_timeout_bounds_a_stop_that_waits_on_a_call():
    """With --stop-timeout 1s ranncd exits (status 1) about a second after SIGTERM, saying why,
    where the call would hold it for the 10 s it gives in-flight calls."""
    daemon = DaemonProcess("--stop-timeout", "1s")
    call = HeldCall(daemon)
    try:
        daemon.proc.send_signal(signal.SIGTERM)
        took = _stopped_within(daemon, 7)
        assert daemon.proc.returncode == 1, daemon.output()
        assert took >= 0.9, f"exited {took:.2f} s after SIGTERM, before its --stop-timeout"
        assert "still stopping 1 s after the signal (--stop-timeout): exiting now" in \
            daemon.output()
    finally:
        call.release()
        daemon.stop()


def test_a_second_signal_exits_at_once():
    daemon = DaemonProcess()  # the default --stop-timeout: 10 minutes
    call = HeldCall(daemon)
    try:
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert daemon.proc.poll() is None, "ranncd did not wait for the call in flight"
        daemon.proc.send_signal(signal.SIGINT)
        _stopped_within(daemon, 3)
        assert daemon.proc.returncode == 1, daemon.output()
        assert f"signal {int(signal.SIGINT)} again: exiting now" in daemon.output()
    finally:
        call.release()
        daemon.stop()
